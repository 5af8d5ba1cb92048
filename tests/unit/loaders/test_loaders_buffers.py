"""A streamed file's buffer: no memory until its ranges are read, then each range's pages
allocated in one call by the thread that reads it."""

from __future__ import annotations

import psutil
import pytest

from ember.loaders._reader import anonymous_buffer, buffer_address
from ember.loaders.pages import prefault

MIB = 1 << 20


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def test_a_buffer_takes_no_memory_until_a_range_read_allocates_its_pages() -> None:
    before = _rss()
    buffer = anonymous_buffer(512 * MIB)
    # Allocating every page here would hold back the first range read (and cost 512 MiB now).
    assert _rss() - before < 64 * MIB
    address = buffer_address(buffer)
    if not prefault(address, 4096 + 17, 256 * MIB):
        pytest.skip("the kernel cannot populate a range (before Linux 5.14)")
    assert _rss() - before > 200 * MIB
    assert buffer[:8] == bytes(8) and buffer[256 * MIB - 1] == 0  # allocated, still zero
    buffer[100:108] = b"weights!"
    assert prefault(address, 0, 4096)  # an allocated page keeps its bytes
    assert buffer[100:108] == b"weights!"
    buffer.close()  # the address taken leaves the mapping closable
