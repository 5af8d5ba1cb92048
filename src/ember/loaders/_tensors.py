"""Tensors as views on a mapping: no copy on a node-cache hit.

A hit maps the blob copy-on-write (``MAP_PRIVATE``): pages come straight from the page
cache and are shared by every replica on the node, and an in-place edit of a weight stays
private to its process instead of corrupting the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from ember.errors import IntegrityError
from ember.loaders._header import PREFIX_BYTES, Header, TensorSpec, parse_header, parse_length

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
):
    if hasattr(torch, _attr):
        _TORCH_DTYPES[_name] = getattr(torch, _attr)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype name (validated by the header parser)."""
    return _TORCH_DTYPES[name]


def flat_view(buffer: mmap.mmap) -> torch.Tensor:
    """A uint8 tensor over the whole buffer, sharing its memory."""
    return torch.frombuffer(buffer, dtype=torch.uint8)


def tensor_view(flat: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor ``spec`` describes, as a view on ``flat`` (a copy only if misaligned)."""
    dtype = torch_dtype(spec.dtype)
    if spec.end == spec.start:
        return torch.empty(spec.shape, dtype=dtype)
    part = flat[spec.start : spec.end]
    if spec.start % dtype.itemsize:
        part = part.clone()  # a misaligned view is refused by torch; copy this one tensor
    return part.view(dtype).reshape(spec.shape)


class MappedFile:
    """A safetensors file mapped copy-on-write, with its validated header.

    Args:
        path: the file (a published node-cache blob).
        cap_bytes: the largest header accepted.
        huge_pages: advise the mapping ``MADV_HUGEPAGE`` (``LoaderConfig.huge_pages``).

    Raises:
        HeaderInvalid: the mapped header does not validate (a corrupted blob).
    """

    def __init__(self, path: Path, cap_bytes: int, *, huge_pages: bool = False) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            # The mapping faults through this open file: a sequential one reads ahead twice
            # as far (``ember.loaders.pages.populate`` reads the weights in file order).
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self.buffer = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else mmap.mmap(-1, 1)
            if huge_pages and size and hasattr(mmap, "MADV_HUGEPAGE"):
                # Before the header read below faults the first pages in: pages the mapping
                # reads from disk come in 2 MiB folios, each mapped by one entry, now and by
                # every later mapping of the blob. A hint: refused, it changes nothing.
                with contextlib.suppress(OSError):
                    self.buffer.madvise(mmap.MADV_HUGEPAGE)
        finally:
            os.close(fd)  # the mapping keeps the file alive, even after an eviction unlinks it
        name = str(path)
        prefix = bytes(self.buffer[:PREFIX_BYTES]) if size else b""
        length = parse_length(prefix, name=name, file_size=size, cap_bytes=cap_bytes)
        raw = bytes(self.buffer[PREFIX_BYTES : PREFIX_BYTES + length])
        self.header: Header = parse_header(raw, name=name, file_size=size)
        self.path = path

    def verify(self, sha256: str) -> None:
        """Hash the whole mapping and compare (``verify_hits``).

        Raises:
            IntegrityError: the bytes do not match ``sha256``.
        """
        digest = hashlib.sha256(self.buffer).hexdigest()
        if digest != sha256:
            raise IntegrityError(what="sha256", name=self.path, expected=sha256, actual=digest)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, in file order, as views on the mapping."""
        flat = flat_view(self.buffer)
        for spec in self.header.tensors:
            yield spec.name, tensor_view(flat, spec)
