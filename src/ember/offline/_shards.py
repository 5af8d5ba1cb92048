"""Input discovery, record framing and the deterministic shard plan of a batch job.

A shard is a contiguous range of records of one input file: a byte range for JSONL and CSV
(so a worker seeks straight to it), a row range for Parquet (from the footer, no data read).
The plan is made once, written to the job's manifest, and reused as is on resume, so a
shard means the same rows in every run. A row's index is its position among the data
records of all inputs, in order: stable across runs, and the join key when rows carry no id.

Records are framed without trusting the input: a line longer than ``max_item_bytes`` is
skipped over in chunks and reported as oversized, never read into memory whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, BinaryIO, Literal

import fsspec
from fsspec.core import url_to_fs
from pydantic import BaseModel, ConfigDict

from ember.errors import InputError
from ember.offline._config import InputFormat

_EXTENSIONS: dict[str, InputFormat] = {
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
    ".parquet": "parquet", ".pq": "parquet",
}
_CHUNK_BYTES = 1 << 20
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class Record:
    """One framed record: its bytes (terminator included), or None when over the limit."""

    offset: int
    size: int
    data: bytes | None

    @property
    def end(self) -> int:
        return self.offset + self.size


class InputFile(BaseModel):
    """One input file as it was when the job was planned."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    format: InputFormat
    size_bytes: int
    ukey: str | None
    rows: int
    first_row: int


class Shard(BaseModel):
    """Rows ``first_row .. first_row + num_rows`` of the job: one output file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int
    file: int
    url: str
    format: InputFormat
    first_row: int
    num_rows: int
    #: JSONL/CSV: the byte range holding the shard's records. Parquet: unused (0, 0).
    start_byte: int
    end_byte: int
    #: Parquet: index of the shard's first row within its file.
    file_row: int


class Manifest(BaseModel):
    """The shard plan of a job, written before any work starts."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    job: dict[str, Any]
    files: list[InputFile]
    shards: list[Shard]

    @property
    def total_rows(self) -> int:
        return sum(s.num_rows for s in self.shards)


def iter_records(f: BinaryIO, fmt: InputFormat, start: int, end: int | None,
                 limit: int) -> Iterator[Record]:
    """Records of a JSONL or CSV byte range; blank lines are not records.

    Args:
        f: The open binary file.
        fmt: ``"jsonl"`` (one record per line) or ``"csv"`` (a quoted field may span lines).
        start: Offset of the first record.
        end: Offset just past the range, or None for the end of the file.
        limit: Records larger than this many bytes come back with ``data=None``.
    """
    lines = _iter_lines(f, start, end, limit)
    if fmt == "csv":
        yield from _csv_records(lines, limit)
        return
    for line in lines:
        if line.data is None or line.data.strip():
            yield line


def _iter_lines(f: BinaryIO, start: int, end: int | None, limit: int) -> Iterator[Record]:
    """Lines of a byte range, holding at most one chunk plus one line of ``limit`` bytes."""
    f.seek(start)
    left = math.inf if end is None else end - start
    buf, i, line_start, skipped = b"", 0, start, 0
    while True:
        nl = buf.find(b"\n", i)
        if nl < 0:
            tail = buf[i:]
            if skipped or len(tail) > limit + 1:  # too long: count it, stop holding it
                skipped, tail = skipped + len(tail), b""
            data = f.read(int(min(_CHUNK_BYTES, left))) if left > 0 else b""
            left -= len(data)
            if not data:
                if skipped or tail:
                    yield _line(line_start, tail, skipped, limit)
                return
            buf, i = tail + data, 0
            continue
        piece, i = buf[i : nl + 1], nl + 1
        yield _line(line_start, piece, skipped, limit)
        line_start, skipped = line_start + skipped + len(piece), 0


def _line(offset: int, piece: bytes, skipped: int, limit: int) -> Record:
    if skipped or len(piece.rstrip(b"\r\n")) > limit:
        return Record(offset, skipped + len(piece), None)
    return Record(offset, len(piece), piece)


def _csv_records(lines: Iterator[Record], limit: int) -> Iterator[Record]:
    """Join lines while a quoted field is open (an odd number of quotes so far)."""
    parts: list[bytes] | None = []
    offset, size, odd = -1, 0, False
    for line in lines:
        if offset < 0:
            if line.data is not None and not line.data.strip():
                continue
            offset, size, odd, parts = line.offset, 0, False, []
        size += line.size
        # An oversized line's quotes are unknown: end the record there rather than guess.
        odd = odd ^ bool(line.data.count(b'"') & 1) if line.data is not None else False
        if parts is not None and line.data is not None and size <= limit + 2:
            parts.append(line.data)
        else:
            parts = None
        if not odd:
            yield Record(offset, size, b"".join(parts) if parts is not None else None)
            offset = -1
    if offset >= 0:  # an unclosed quote at the end of the file: the parser reports it
        yield Record(offset, size, b"".join(parts) if parts is not None else None)


def discover(inputs: Sequence[str], fmt: InputFormat | None,
             storage_options: dict[str, Any]) -> list[tuple[str, InputFormat, int, str | None]]:
    """List input files as ``(url, format, size_bytes, ukey)``, in a stable order.

    An input is a file, a directory (every file in it with a known extension, recursively)
    or a glob, local or any fsspec URL.

    Raises:
        InputError: when an input does not exist, matches nothing, or has an unknown format.
    """
    found: list[tuple[str, InputFormat, int, str | None]] = []
    for item in inputs:
        fs, path = url_to_fs(item, **storage_options)
        for p in _expand(fs, path, item, fmt):
            info = fs.info(p)
            found.append((fs.unstrip_protocol(p), fmt or _format_of(p, item),
                          int(info.get("size") or 0), _ukey(fs, p)))
    if not found:
        raise InputError(path=", ".join(inputs), detail="no input files found")
    return found


def _expand(fs: Any, path: str, item: str, fmt: InputFormat | None) -> list[str]:
    if _GLOB_CHARS & set(path):
        paths = sorted(p for p in fs.glob(path) if fs.isfile(p))
    elif fs.isdir(path):
        paths = sorted(p for p in fs.find(path) if _is_data_file(p, fmt))
    elif fs.isfile(path):
        paths = [path]
    else:
        raise InputError(path=item, detail="no such file or directory")
    if not paths:
        raise InputError(path=item, detail="matches no .jsonl, .csv or .parquet file")
    return list(paths)


def _is_data_file(path: str, fmt: InputFormat | None) -> bool:
    name = PurePosixPath(path).name
    if name.startswith((".", "_")):  # hidden files and markers such as _SUCCESS
        return False
    return fmt is not None or PurePosixPath(name).suffix.lower() in _EXTENSIONS


def _format_of(path: str, item: str) -> InputFormat:
    suffix = PurePosixPath(path).suffix.lower()
    if suffix not in _EXTENSIONS:
        raise InputError(path=item, detail=f"unknown format of {path!r}: name it .jsonl, .csv or"
                         " .parquet, or pass input_format (compressed files are not supported)")
    return _EXTENSIONS[suffix]


def _ukey(fs: Any, path: str) -> str | None:
    """A fingerprint that changes when the file does (mtime or ETag), if the store has one."""
    try:
        return str(fs.ukey(path))
    except Exception:  # stores without ukey: the size alone is checked on resume
        return None


def plan(found: Sequence[tuple[str, InputFormat, int, str | None]], shard_rows: int,
         limit: int, storage_options: dict[str, Any], job: dict[str, Any]) -> Manifest:
    """Count each file's records and cut them into shards of ``shard_rows``.

    Raises:
        InputError: when a file cannot be read.
    """
    files: list[InputFile] = []
    shards: list[Shard] = []
    row = 0
    for file_index, (url, fmt, size, ukey) in enumerate(found):
        try:
            ranges = _file_ranges(url, fmt, shard_rows, limit, storage_options)
        except (OSError, ValueError) as exc:
            raise InputError(path=url, detail=str(exc)) from exc
        count = sum(r[2] for r in ranges)
        files.append(InputFile(url=url, format=fmt, size_bytes=size, ukey=ukey, rows=count,
                               first_row=row))
        file_row = 0
        for start, end, n in ranges:
            shards.append(Shard(index=len(shards), file=file_index, url=url, format=fmt,
                                first_row=row + file_row, num_rows=n, start_byte=start,
                                end_byte=end, file_row=file_row))
            file_row += n
        row += count
    return Manifest(job=job, files=files, shards=shards)


def _file_ranges(url: str, fmt: InputFormat, shard_rows: int, limit: int,
                 storage_options: dict[str, Any]) -> list[tuple[int, int, int]]:
    """``(start_byte, end_byte, rows)`` per shard of one file."""
    with fsspec.open(url, "rb", **storage_options) as f:
        if fmt == "parquet":
            import pyarrow.parquet as pq  # type: ignore[import-not-found,import-untyped,unused-ignore]

            total = pq.ParquetFile(f).metadata.num_rows
            return [(0, 0, min(shard_rows, total - s)) for s in range(0, total, shard_rows)]
        records = iter_records(f, fmt, 0, None, limit)
        if fmt == "csv":
            next(records, None)  # the header is not a row
        ranges: list[tuple[int, int, int]] = []
        start, count, end = -1, 0, 0
        for rec in records:
            start = rec.offset if start < 0 else start
            count, end = count + 1, rec.end
            if count == shard_rows:
                ranges.append((start, end, count))
                start, count = -1, 0
        if count:
            ranges.append((start, end, count))
        return ranges
