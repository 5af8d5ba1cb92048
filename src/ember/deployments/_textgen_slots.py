"""A slotted KV cache for ``transformers`` models: one fused forward per decode step.

Every running sequence owns a row (slot) of preallocated key/value tensors
``[slots, kv_heads, columns, head_dim]`` per layer. A decode step writes every row's new
key/value at the same column ``col`` and attends over columns ``0..col``; each row sees only
its own columns through a per-row mask, and each row's token gets its own position id. Keys
are stored after the model applied its position encoding (rotary or learned), so where a
token's column lies does not matter to attention: rows of different lengths share one step
without padding their inputs, and a sequence can join or leave at any step.

A prompt is prefilled alone (batch 1, the model's own ``DynamicCache``) and its keys/values
are copied into a free row, right-aligned under ``col``. When the columns run out, each
row's live columns are packed to the right (``compact``), so a row never needs more than
its own length; the tensors grow by doubling up to ``max_columns`` on demand.

The tensors are zeros that cost nothing until written (:func:`lazy_zeros`): a table sized for
every slot is mostly rows no sequence holds, and zero-filling it with ``torch.zeros`` made the
first prefill of a replica write all of it (570 MB for the 2 GB ladder Llama at 256 columns;
``bench/textgen_first_prefill.py`` counts its page faults either way).

This is the padded-batch layout of Hugging Face's static batches, with per-row masks
instead of left padding, so continuous batching needs no paging kernel; it runs on any
model whose attention reads a 4D additive mask (Llama, Qwen2, Mistral, GPT-2, ...).
"""

from __future__ import annotations

import mmap
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def lazy_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros in a fresh anonymous mapping: the kernel backs a page when it is first written,
    and a read of a page never written maps its shared zero page, so memory grows with the
    rows and columns in use, not with the table's capacity.

    Unused rows must still read as zeros (attention reads every column of a row up to
    ``col``, masked; garbage there could be NaN, and NaN times a zero weight is NaN), which
    ``torch.empty`` does not promise. The mapping is released with the tensor's storage.
    """
    count = 1
    for dim in shape:
        count *= dim
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


class SlotTable:
    """Keys/values of ``slots`` rows for every layer, and which columns each row owns."""

    def __init__(self, n_layers: int, slots: int, *, max_columns: int,
                 initial_columns: int = 256) -> None:
        self.n_layers, self.slots, self.max_columns = n_layers, slots, max_columns
        self.capacity = min(initial_columns, max_columns)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.valid = torch.zeros(slots, self.capacity, dtype=torch.bool)
        #: Tokens each row holds: the position id of its next token.
        self.lengths = [0] * slots
        #: The column the next decode step writes, for every row at once.
        self.col = 0
        #: Times the rows were packed to the right (the cache ran out of columns).
        self.compactions = 0

    def _allocate(self, like: torch.Tensor, like_v: torch.Tensor) -> None:
        heads, dim, vdim = like.shape[1], like.shape[-1], like_v.shape[-1]
        self.keys = [_zeros_like(like, self.slots, heads, self.capacity, dim)
                     for _ in range(self.n_layers)]
        self.values = [_zeros_like(like_v, self.slots, heads, self.capacity, vdim)
                       for _ in range(self.n_layers)]

    def place(self, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Copy one prefilled sequence's ``[1, H, n, D]`` keys/values into empty ``slot``."""
        if not self.keys:
            self._allocate(keys[0], values[0])
        n = keys[0].shape[2]
        if n > self.col:
            self._grow_to(n)
            self.col = n
        start = self.col - n
        for layer in range(self.n_layers):
            self.keys[layer][slot, :, start:self.col] = keys[layer][0]
            self.values[layer][slot, :, start:self.col] = values[layer][0]
        self.valid[slot].zero_()
        self.valid[slot, start:self.col] = True
        self.lengths[slot] = n

    def begin_decode(self, rows: int) -> torch.Tensor:
        """Claim column ``col`` for rows ``0..rows-1``; their additive mask ``[B, 1, 1, col+1]``."""
        if self.col + 1 > self.max_columns:
            self._compact()
        self._grow_to(self.col + 1)
        self.valid[:rows, self.col] = True
        visible = self.valid[:rows, :self.col + 1]
        dtype = self.keys[0].dtype
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible,
                                                                     torch.finfo(dtype).min)
        return mask[:, None, None, :]

    def end_decode(self, rows: int) -> None:
        self.col += 1
        for row in range(rows):
            self.lengths[row] += 1

    def positions(self, rows: int) -> torch.Tensor:
        return torch.tensor(self.lengths[:rows]).unsqueeze(1)

    def move(self, src: int, dst: int) -> None:
        self.fork(src, dst)
        self.free(src)

    def fork(self, src: int, dst: int) -> None:
        """Copy row ``src`` into ``dst``, keeping ``src`` (a request's other choices)."""
        for tensors in (self.keys, self.values):
            for t in tensors:
                t[dst, :, :self.col] = t[src, :, :self.col]
        self.valid[dst] = self.valid[src]
        self.lengths[dst] = self.lengths[src]

    def free(self, slot: int) -> None:
        self.valid[slot].zero_()
        self.lengths[slot] = 0

    def _grow_to(self, columns: int) -> None:
        """Make the tensors hold ``columns`` columns (doubling, up to ``max_columns``)."""
        if columns <= self.capacity:
            return
        if columns > self.max_columns:
            raise RuntimeError(f"the KV cache holds {self.max_columns} columns, {columns} needed")
        self._grow(min(self.max_columns, max(columns, 2 * self.capacity)))

    def _grow(self, capacity: int) -> None:
        def grown(t: torch.Tensor) -> torch.Tensor:
            out = _zeros_like(t, *t.shape[:2], capacity, *t.shape[3:])
            for row in self._held_rows():  # an empty row stays unwritten, so unbacked
                out[row, :, :self.col] = t[row, :, :self.col]
            return out

        self.keys = [grown(t) for t in self.keys]
        self.values = [grown(t) for t in self.values]
        valid = torch.zeros(self.slots, capacity, dtype=torch.bool)
        valid[:, :self.col] = self.valid[:, :self.col]
        self.valid, self.capacity = valid, capacity

    def _held_rows(self) -> list[int]:
        return [row for row in range(self.slots) if self.lengths[row] > 0]

    def _compact(self) -> None:
        """Pack every held row's live columns to the right of column ``max(lengths)``; rows
        no sequence holds are not written (they stay unbacked, :func:`lazy_zeros`)."""
        held = self._held_rows()
        width = max(self.lengths)
        rows = torch.tensor(held, dtype=torch.long)
        index = torch.zeros(len(held), width, dtype=torch.long)
        valid = torch.zeros(self.slots, self.capacity, dtype=torch.bool)
        for i, row in enumerate(held):
            live = self.valid[row, :self.col].nonzero().flatten()
            index[i, width - len(live):] = live
            valid[row, width - len(live):width] = True
        for tensors in (self.keys, self.values):
            for t in tensors:
                gather = index[:, None, :, None].expand(len(held), t.shape[1], width,
                                                        t.shape[3])
                t[rows, :, :width] = t[rows, :, :self.col].gather(2, gather)
        self.valid, self.col = valid, width
        self.compactions += 1


def _zeros_like(like: torch.Tensor, *shape: int) -> torch.Tensor:
    if like.device.type != "cpu":
        return like.new_zeros(*shape)
    return lazy_zeros(*shape, dtype=like.dtype)


class _SlotLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One layer of :class:`SlotTable` as ``transformers`` sees it during a decode step."""

    is_sliding = False

    def __init__(self, table: SlotTable, layer: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.table, self.layer = table, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Never needed: the table allocates when the first prompt is placed."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        table, rows = self.table, key_states.shape[0]
        keys, values = table.keys[self.layer], table.values[self.layer]
        keys[:rows, :, table.col] = key_states[:, :, -1]
        values[:rows, :, table.col] = value_states[:, :, -1]
        return keys[:rows, :, :table.col + 1], values[:rows, :, :table.col + 1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.table.col + 1, 0

    def get_seq_length(self) -> int:
        return self.table.col

    def get_max_length(self) -> int:
        return self.table.max_columns


def slot_cache(table: SlotTable) -> Cache:
    """A ``transformers`` cache whose layers write into ``table``'s rows."""
    layers: list[Any] = [_SlotLayer(table, i) for i in range(table.n_layers)]
    return Cache(layers=layers)
