"""The job's output: manifest, per-shard files committed atomically, errors, summary.

Layout of an output (local path or any fsspec URL)::

    _manifest.json            the shard plan, written before any work
    part-00000.parquet        one file per shard: id, row_index, then the result columns
    errors/part-00000.jsonl   bad rows of that shard, if any: id, row_index, reason, message
    errors.jsonl              every bad row, gathered when the last shard is done
    _SUCCESS.json             written last: row counts of the whole job

A shard's file appears only complete. Locally it is written to a hidden temporary name,
flushed to disk, then renamed over the final name (an atomic step). On an object store it is
one PUT, and an object is only visible once its upload completes. The shard's errors file is
committed *before* its output file, so "the output file exists" means "the shard is done"
and resume can trust it.

The driver is the only writer: the rows of one shard may be computed by several workers in
several batches, and only the consumer of the stream sees when the last one arrives.
"""

from __future__ import annotations

import json
import os
import posixpath
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from ember.errors import ShardIncomplete
from ember.offline._config import OutputFormat
from ember.offline._shards import Manifest, Shard

MANIFEST = "_manifest.json"
SUMMARY = "_SUCCESS.json"
ERRORS = "errors.jsonl"
_TEMP_MARK = ".tmp-"
#: What the driver keeps of a row until its shard is committed.
Row = tuple[str, str | None, str | None, bytes | None]


def part_name(index: int, fmt: OutputFormat) -> str:
    """Relative name of shard ``index``'s output file."""
    return f"part-{index:05d}.{fmt}"


def errors_name(index: int) -> str:
    """Relative name of shard ``index``'s errors file."""
    return f"errors/part-{index:05d}.jsonl"


class OutputStore:
    """Files under one output root, written atomically.

    Args:
        url: Local path or fsspec URL of the output directory.
        storage_options: fsspec options (credentials, endpoint).
    """

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.url = url
        self.fs, self.root = url_to_fs(url, **storage_options)
        self.local = isinstance(self.fs, LocalFileSystem)
        #: The root as a full URL, comparable with the URLs of discovered inputs.
        self.prefix = str(self.fs.unstrip_protocol(self.root)).rstrip("/")

    def path(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def read_text(self, name: str) -> str | None:
        """The file's text, or None when it does not exist."""
        try:
            with self.fs.open(self.path(name), "rb") as f:
                return bytes(f.read()).decode("utf-8")
        except FileNotFoundError:
            return None

    def commit(self, name: str, data: bytes) -> None:
        """Publish ``data`` at ``name`` whole, never half-written."""
        final = self.path(name)
        if not self.local:
            self.fs.pipe_file(final, data)  # one object PUT: visible only once complete
            return
        directory, base = posixpath.split(final)
        os.makedirs(directory, exist_ok=True)
        temp = posixpath.join(directory, f".{base}{_TEMP_MARK}{uuid.uuid4().hex}")
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final)
        _fsync_dir(directory)

    def remove(self, name: str) -> None:
        """Delete ``name`` if it exists."""
        if self.fs.exists(self.path(name)):
            self.fs.rm(self.path(name))

    def names(self, subdir: str = "") -> set[str]:
        """Names of the files directly under ``subdir``."""
        try:
            entries = self.fs.ls(self.path(subdir) if subdir else self.root, detail=False)
        except FileNotFoundError:
            return set()
        return {posixpath.basename(str(e).rstrip("/")) for e in entries}

    def clean_temp(self) -> int:
        """Remove temporary files a killed run left behind; returns how many."""
        removed = 0
        for subdir in ("", "errors"):
            for name in self.names(subdir):
                if _TEMP_MARK in name:
                    self.fs.rm(self.path(posixpath.join(subdir, name)))
                    removed += 1
        return removed

    def read_manifest(self) -> Manifest | None:
        text = self.read_text(MANIFEST)
        return None if text is None else Manifest.model_validate_json(text)

    def write_manifest(self, manifest: Manifest) -> None:
        self.commit(MANIFEST, manifest.model_dump_json(indent=1).encode())


def _fsync_dir(directory: str) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def done_shards(store: OutputStore, manifest: Manifest, fmt: OutputFormat) -> set[int]:
    """Indexes of shards whose output file exists, i.e. that are committed."""
    present = store.names()
    return {s.index for s in manifest.shards if part_name(s.index, fmt) in present}


def encode_rows(rows: list[dict[str, Any]], fmt: OutputFormat) -> bytes:
    """One output file's bytes: Parquet (columns in first-seen order) or JSON lines."""
    if fmt == "jsonl":
        return "".join(json.dumps(r, default=_json_default) + "\n" for r in rows).encode()
    return parquet_bytes(rows_table(rows))


def rows_table(rows: list[dict[str, Any]], schema: pa.Schema | None = None) -> pa.Table:
    """Rows as a table; an empty one gets ``schema`` (the job's other parts') when known."""
    if rows:
        return pa.Table.from_pylist(rows)
    return (schema or pa.schema([("id", pa.string()), ("row_index", pa.int64())])).empty_table()


def parquet_bytes(table: pa.Table) -> bytes:
    """A Parquet file's bytes."""
    import pyarrow.parquet as pq  # type: ignore[import-not-found,import-untyped,unused-ignore]

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return bytes(sink.getvalue().to_pybytes())


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


class ShardAssembler:
    """Collect streamed rows per shard; commit each shard once all its rows are in.

    Rows are keyed by row index, so a block delivered twice (a retried task) counts once.

    Args:
        shards: The shards this run must produce.
        store: Where shards are committed.
        fmt: Output file format.
        on_commit: Called with ``(shard, rows_ok, rows_failed)`` after each commit.
    """

    def __init__(self, shards: Iterable[Shard], store: OutputStore, fmt: OutputFormat,
                 on_commit: Callable[[Shard, int, int], None] | None = None) -> None:
        self._expected = {s.index: s for s in shards}
        self._buffers: dict[int, dict[int, Row]] = {}
        self._store = store
        self._fmt = fmt
        self._on_commit = on_commit
        self.rows_ok = 0
        self.rows_failed = 0
        self.committed: list[int] = []
        self._schema: pa.Schema | None = None

    def add(self, table: pa.Table) -> int:
        """Take one block of mapped rows; returns how many rows were new."""
        cols = table.to_pydict()
        fresh, touched = 0, set()
        for shard, row, row_id, reason, message, result in zip(
                cols["_shard"], cols["_row"], cols["_id"], cols["_reason"], cols["_message"],
                cols["_result"], strict=True):
            buffer = self._buffers.setdefault(shard, {})
            if row not in buffer:
                buffer[row] = (row_id, reason, message, result)
                fresh += 1
                touched.add(shard)
        for shard in touched:
            if len(self._buffers[shard]) == self._expected[shard].num_rows:
                self._commit(self._expected[shard], self._buffers.pop(shard))
        return fresh

    def finish(self) -> None:
        """Check that every shard was committed.

        Raises:
            ShardIncomplete: naming the first shard whose rows did not all arrive.
        """
        for index, shard in sorted(self._expected.items()):
            if index not in self.committed:
                got = len(self._buffers.get(index, {}))
                raise ShardIncomplete(shard=index, got=got, expected=shard.num_rows)

    def _commit(self, shard: Shard, rows: dict[int, Row]) -> None:
        good: list[dict[str, Any]] = []
        bad: list[dict[str, Any]] = []
        for row_index, (row_id, reason, message, result) in sorted(rows.items()):
            if reason is None and result is not None:
                good.append({"id": row_id, "row_index": row_index, **json.loads(result)})
            else:
                bad.append({"id": row_id, "row_index": row_index, "reason": reason,
                            "message": message})
        if bad:
            self._store.commit(errors_name(shard.index), encode_rows(bad, "jsonl"))
        else:  # a stale file of an interrupted earlier commit of this shard
            self._store.remove(errors_name(shard.index))
        if self._fmt == "parquet":
            # An all-bad shard still gets its file (the "done" mark), typed like the others
            # so that the parts read back as one table.
            table = rows_table(good, self._schema)
            self._schema = table.schema if good else self._schema
            data = parquet_bytes(table)
        else:
            data = encode_rows(good, self._fmt)
        self._store.commit(part_name(shard.index, self._fmt), data)
        self.committed.append(shard.index)
        self.rows_ok += len(good)
        self.rows_failed += len(bad)
        if self._on_commit is not None:
            self._on_commit(shard, len(good), len(bad))


def gather_errors(store: OutputStore, manifest: Manifest) -> int:
    """Concatenate the shards' errors files into ``errors.jsonl``; returns the bad rows."""
    present = store.names("errors")
    chunks: list[str] = []
    for shard in manifest.shards:
        name = errors_name(shard.index)
        if posixpath.basename(name) in present:
            chunks.append(store.read_text(name) or "")
    text = "".join(chunks)
    if text:
        store.commit(ERRORS, text.encode())
    else:
        store.remove(ERRORS)
    return text.count("\n")


def write_summary(store: OutputStore, manifest: Manifest, rows_failed: int) -> None:
    """Mark the job complete with its row counts."""
    total = manifest.total_rows
    summary = {"rows": total, "rows_ok": total - rows_failed, "rows_failed": rows_failed,
               "shards": len(manifest.shards)}
    store.commit(SUMMARY, (json.dumps(summary, indent=1) + "\n").encode())
