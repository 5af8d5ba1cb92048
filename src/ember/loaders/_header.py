"""Parse and validate a safetensors header before any tensor byte is read.

The file is ``u64 little-endian N`` + ``N bytes of JSON`` + the tensor bytes. Everything the
header claims is checked against the file size, so a lying header is refused before a large
read or allocation happens.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from ember.errors import HeaderInvalid, UnsafeFormat

#: Element size in bytes of every dtype the loader accepts.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
PREFIX_BYTES = 8
_MAX_RANK = 64
# A pickle stream starts with PROTO (0x80); torch.save writes a zip archive.
_PICKLE_MAGICS = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor's entry: dtype, shape and absolute byte span in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    """A validated header: tensors sorted by offset, and where the data region lies."""

    tensors: tuple[TensorSpec, ...]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def parse_length(prefix: bytes, *, name: str, file_size: int, cap_bytes: int) -> int:
    """Decode and check the 8-byte header length.

    Args:
        prefix: the first 8 bytes of the file.
        name: the file's name, for messages.
        file_size: the object's size in bytes.
        cap_bytes: the largest header accepted.

    Returns:
        The JSON header's length N.

    Raises:
        UnsafeFormat: the bytes are a pickle or zip (``torch.save``) file.
        HeaderInvalid: N is 0, over the cap, or larger than the file allows.
    """
    if prefix.startswith(_PICKLE_MAGICS):
        raise UnsafeFormat(name=name)
    if len(prefix) != PREFIX_BYTES:
        raise HeaderInvalid(name=name, reason=f"file is {file_size} bytes, shorter than 8")
    (length,) = struct.unpack("<Q", prefix)
    if length == 0:
        raise HeaderInvalid(name=name, reason="header length is 0")
    if length > cap_bytes:
        raise HeaderInvalid(name=name, reason=f"header length {length} exceeds {cap_bytes}")
    if length > file_size - PREFIX_BYTES:
        raise HeaderInvalid(
            name=name, reason=f"header length {length} exceeds file size {file_size} - 8"
        )
    return int(length)


def parse_header(raw: bytes, *, name: str, file_size: int) -> Header:
    """Decode and validate the JSON header.

    Args:
        raw: the N header bytes that follow the length prefix.
        name: the file's name, for messages.
        file_size: the object's size in bytes.

    Returns:
        The validated :class:`Header`.

    Raises:
        HeaderInvalid: the JSON is malformed or inconsistent with the file size.
    """
    doc = _decode(raw, name)
    metadata = _metadata(doc.pop("__metadata__", None), name)
    data_start = PREFIX_BYTES + len(raw)
    specs = [_tensor(key, value, name, data_start) for key, value in doc.items()]
    specs.sort(key=lambda s: (s.start, s.end))
    _check_layout(specs, name=name, data_start=data_start, file_size=file_size)
    return Header(tuple(specs), metadata, data_start, file_size)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _decode(raw: bytes, name: str) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderInvalid(name=name, reason=f"header is not UTF-8 ({exc.reason})") from None
    if not text.startswith("{"):
        raise HeaderInvalid(name=name, reason="header does not start with '{'")
    try:
        doc = json.loads(text, object_pairs_hook=_reject_duplicates)
    except (ValueError, RecursionError) as exc:
        raise HeaderInvalid(name=name, reason=f"header is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise HeaderInvalid(name=name, reason="header is not a JSON object")
    return doc


def _metadata(value: Any, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HeaderInvalid(name=name, reason="__metadata__ is not an object")
    for key, item in value.items():
        if not isinstance(item, str):
            raise HeaderInvalid(name=name, reason=f"__metadata__[{key!r}] is not a string")
    return dict(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tensor(key: str, entry: Any, name: str, data_start: int) -> TensorSpec:
    where = f"tensor {key!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise HeaderInvalid(name=name, reason=f"{where} needs exactly dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise HeaderInvalid(name=name, reason=f"{where} has dtype {dtype!r} not in the allowlist")
    if not isinstance(shape, list) or len(shape) > _MAX_RANK:
        raise HeaderInvalid(name=name, reason=f"{where} shape is not a list of <= 64 sizes")
    if not all(_is_int(d) and d >= 0 for d in shape):
        raise HeaderInvalid(name=name, reason=f"{where} shape has a negative or non-integer size")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets)):
        raise HeaderInvalid(name=name, reason=f"{where} data_offsets is not [begin, end]")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise HeaderInvalid(name=name, reason=f"{where} data_offsets {offsets} are out of order")
    nbytes = 0 if 0 in shape else DTYPE_SIZES[dtype]
    for dim in shape:
        nbytes *= dim
        # Python ints do not overflow; stop once the product exceeds the span to stay cheap.
        if nbytes > end - begin:
            break
    if nbytes != end - begin:
        raise HeaderInvalid(
            name=name, reason=f"{where} shape {shape} x {dtype} != byte span {end - begin}"
        )
    return TensorSpec(key, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_layout(specs: list[TensorSpec], *, name: str, data_start: int, file_size: int) -> None:
    cursor = data_start
    for spec in specs:
        if spec.start > cursor:
            raise HeaderInvalid(name=name, reason=f"gap before tensor {spec.name!r}")
        if spec.start < cursor:
            raise HeaderInvalid(name=name, reason=f"tensor {spec.name!r} overlaps another")
        cursor = spec.end
    if cursor > file_size:
        raise HeaderInvalid(
            name=name, reason=f"data ends at {cursor}, past the file size {file_size}"
        )
    if cursor != file_size:
        raise HeaderInvalid(
            name=name, reason=f"{file_size - cursor} trailing bytes after the last tensor"
        )
