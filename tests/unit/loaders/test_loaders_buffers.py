"""A streamed file's buffer: no memory until its ranges are read, then each range's pages
allocated in one call by the thread that reads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from ember.loaders._reader import anonymous_buffer, buffer_address
from ember.loaders.pages import prefault, remap_onto

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


def _mapped_file(address: int) -> str | None:
    """The file this process maps at ``address`` ("" for anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in parts[0].split("-"))
        if low <= address < high:
            return parts[5] if len(parts) > 5 else ""
    return None


def test_a_buffer_remapped_onto_its_blob_keeps_its_tensors_and_frees_its_pages(
        tmp_path: Path) -> None:
    """The write-behind's last step: the published blob's pages take the buffer's place under
    the tensors already built on it; a write afterwards stays private to this process."""
    size = 8 << 20
    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes()
    buffer = anonymous_buffer(size)
    buffer[:] = data
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)  # as the loaders build them
    blob = tmp_path / "blob"
    blob.write_bytes(data)
    address = buffer_address(buffer)
    assert _mapped_file(address) == ""
    anon_before = _rss_anon()
    assert remap_onto(buffer, blob)
    assert _mapped_file(address) == str(blob)
    assert _rss_anon() < anon_before - size // 2  # the anonymous copy is gone
    assert bytes(tensor[:4096].numpy()) == data[:4096] and int(tensor.sum()) == sum(data)
    tensor[0] = (data[0] + 1) % 256  # copy-on-write: the blob is never written through
    assert blob.read_bytes()[0] == data[0]
    short = tmp_path / "short"
    short.write_bytes(b"x")
    assert not remap_onto(buffer, short)  # a file of another size: refused, nothing changed
    assert _mapped_file(address) == str(blob)


def _rss_anon() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024
