"""The slot table's memory: pages are backed as rows are written, not for its capacity."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import torch

from ember.deployments._textgen_slots import SlotTable, lazy_zeros

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t``'s storage this process has backed (``mincore`` of its range)."""
    storage = t.untyped_storage()
    start = storage.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = storage.data_ptr() + storage.nbytes() - start
    vec = ctypes.create_string_buffer((length + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
    assert _libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


#: What one written row may back: its pages, or the huge page a THP-always host backs it with.
_ROW_BOUND_BYTES = (2 << 20) + (64 << 10)
_HEADS = 32


def _prompt(layers: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    keys = [torch.randn(1, _HEADS, n, 64, dtype=torch.bfloat16) for _ in range(layers)]
    return keys, [k + 1 for k in keys]


def test_placing_one_prompt_backs_its_row_only() -> None:
    # 16 slots x 32 heads x 256 columns x 64 dims of bf16: 16 MiB a layer.
    table = SlotTable(2, 16, max_columns=1024)
    keys, values = _prompt(2, 3)
    table.place(0, keys, values)
    assert table.keys[0].untyped_storage().nbytes() == 16 << 20
    # Row 0's three columns (a page per head), not the whole table zero-filled.
    for t in (table.keys[0], table.values[1]):
        assert _resident_pages(t) * mmap.PAGESIZE <= _ROW_BOUND_BYTES
    assert torch.equal(table.keys[1][0, :, :3], keys[1][0])
    assert not table.keys[0][1:].any()  # unwritten rows read as zeros (read last, as below)


def test_growing_copies_held_rows_and_leaves_the_rest_unbacked() -> None:
    table = SlotTable(1, 16, max_columns=1024, initial_columns=128)
    keys, values = _prompt(1, 120)
    table.place(0, keys, values)
    for _ in range(10):  # past 128 columns: the table doubles
        table.begin_decode(1)
        table.end_decode(1)
    assert table.capacity == 256
    assert torch.equal(table.keys[0][0, :, :120], keys[0][0])
    for t in (table.keys[0], table.values[0]):
        assert _resident_pages(t) * mmap.PAGESIZE <= _ROW_BOUND_BYTES
    # Read last: a read of a page never written maps the zero page, which mincore counts.
    assert not table.keys[0][1:].any() and not table.values[0][1:].any()


def test_lazy_zeros_are_zeros_of_the_shape_asked() -> None:
    t = lazy_zeros(3, 5, 7, dtype=torch.float16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.float16 and not t.any()
    t[1, 2, 3] = 4.0
    assert float(t.sum()) == 4.0
    assert lazy_zeros(0, 4, dtype=torch.float32).shape == (0, 4)


def test_compacting_packs_held_rows_and_leaves_the_rest_unbacked() -> None:
    table = SlotTable(1, 16, max_columns=128, initial_columns=128)
    keys, values = _prompt(1, 60)
    table.place(0, keys, values)
    for _ in range(68):  # to the last column
        table.begin_decode(1)
        table.end_decode(1)
    long_keys, long_values = _prompt(1, 100)
    table.place(1, long_keys, long_values)  # right-aligned under col: columns 28-127
    table.free(0)
    table.begin_decode(2)  # no column left: row 1's 100 are packed to the left
    assert table.compactions == 1 and table.col == 100
    assert torch.equal(table.keys[0][1, :, :100], long_keys[0][0])
    # 16 slots x 32 heads x 128 columns x 64 dims, 8 MiB: rows 0 and 1 back 1 MiB of it.
    for t in (table.keys[0], table.values[0]):
        assert _resident_pages(t) * mmap.PAGESIZE <= 2 * _ROW_BOUND_BYTES
    assert not table.keys[0][2:].any()
