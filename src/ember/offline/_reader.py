"""Reading shards as a Ray Data datasource: one read task per shard, bad rows marked.

Each read task parses its shard's records and emits blocks in ``ROW_SCHEMA``: a good row
carries its item (as JSON, ready for the handler), a bad row its reason and message. Bad
rows travel with the good ones so that every row of a shard comes back exactly once, which
is how the driver knows a shard is complete.
"""

from __future__ import annotations

import csv
import functools
import json
from collections.abc import Iterator
from typing import Any

import fsspec
import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from ember.offline._mapping import ROW_SCHEMA, InputPlan, encode_item
from ember.offline._shards import Shard, iter_records

_BLOCK_ROWS = 1024
#: ``(row_index, row or None, reason, message, size_bytes)`` of one parsed record.
Parsed = tuple[int, dict[str, Any] | None, str | None, str | None, int]


class ShardSource(Datasource):
    """The pending shards of a job; one read task each.

    Args:
        shards: Shards to read, in plan order.
        plan: Builds each row's item.
        max_item_bytes: Larger rows are bad rows.
        storage_options: fsspec options of the inputs.
        block_rows: Most rows per block a read task yields.
    """

    def __init__(self, shards: list[Shard], plan: InputPlan, max_item_bytes: int,
                 storage_options: dict[str, Any], block_rows: int = _BLOCK_ROWS) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._shards = shards
        self._plan = plan
        self._limit = max_item_bytes
        self._storage = storage_options
        self._block_rows = block_rows

    def get_name(self) -> str:
        return "EmberShards"

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(_estimate_bytes(s) for s in self._shards)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        """One task per shard, whatever ``parallelism`` asks: a shard is the unit of redo."""
        return [
            ReadTask(functools.partial(read_shard, s, self._plan, self._limit, self._storage,
                                       self._block_rows),
                     BlockMetadata(num_rows=s.num_rows, size_bytes=_estimate_bytes(s),
                                   input_files=(s.url,), exec_stats=None))
            for s in self._shards
        ]


def _estimate_bytes(shard: Shard) -> int:
    return max(shard.end_byte - shard.start_byte, shard.num_rows * 64)


def read_shard(shard: Shard, plan: InputPlan, limit: int, storage_options: dict[str, Any],
               block_rows: int = _BLOCK_ROWS) -> Iterator[pa.Table]:
    """Blocks of up to ``block_rows`` of one shard's rows, in ``ROW_SCHEMA``."""
    block: dict[str, list[Any]] = {name: [] for name in ROW_SCHEMA.names}
    for row_index, row, reason, message, size in _parsed(shard, limit, storage_options):
        item: bytes | None = None
        if row is not None:
            prepared = plan.prepare(row)
            reason, message = prepared.reason, prepared.message
            if reason is None:
                item = encode_item(prepared.item)
        row_id = plan.row_id(row, row_index) if row is not None else str(row_index)
        for name, value in zip(ROW_SCHEMA.names,
                               (shard.index, row_index, row_id, reason, message, item, size),
                               strict=True):
            block[name].append(value)
        if len(block["_row"]) >= block_rows:
            yield pa.table(block, schema=ROW_SCHEMA)
            block = {name: [] for name in ROW_SCHEMA.names}
    if block["_row"]:
        yield pa.table(block, schema=ROW_SCHEMA)


def _parsed(shard: Shard, limit: int, storage_options: dict[str, Any]) -> Iterator[Parsed]:
    with fsspec.open(shard.url, "rb", **storage_options) as f:
        if shard.format == "parquet":
            yield from _parquet_rows(f, shard, limit)
            return
        header = _csv_header(f, limit) if shard.format == "csv" else None
        records = iter_records(f, shard.format, shard.start_byte, shard.end_byte, limit)
        for i, rec in enumerate(records):
            row_index = shard.first_row + i
            if rec.data is None:
                yield (row_index, None, "too_large",
                       f"row is {rec.size} bytes, over the limit of {limit}", rec.size)
            elif header is None:
                yield (row_index, *_json_row(rec.data), rec.size)
            else:
                yield (row_index, *_csv_row(rec.data, header), rec.size)


def _json_row(data: bytes) -> tuple[dict[str, Any] | None, str | None, str | None]:
    try:
        row = json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
        return None, "invalid_json", str(exc)[:500]
    if not isinstance(row, dict):
        return None, "not_an_object", f"expected a JSON object, got {type(row).__name__}"
    return row, None, None


def _csv_header(f: Any, limit: int) -> list[str]:
    first = next(iter_records(f, "csv", 0, None, limit), None)
    if first is None or first.data is None:
        return []  # every row then fails the field count check, with that message
    return next(csv.reader([first.data.decode("utf-8-sig").rstrip("\r\n")]), [])


def _csv_row(data: bytes, header: list[str]) -> tuple[dict[str, Any] | None, str | None,
                                                       str | None]:
    try:
        text = data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        return None, "bad_encoding", f"not UTF-8: {exc}"
    try:
        fields = next(csv.reader([text], strict=True), [])
    except csv.Error as exc:
        return None, "invalid_csv", str(exc)
    if len(fields) != len(header):
        return None, "invalid_csv", f"expected {len(header)} fields, got {len(fields)}"
    return dict(zip(header, fields, strict=True)), None, None


def _parquet_rows(f: Any, shard: Shard, limit: int) -> Iterator[Parsed]:
    import pyarrow.parquet as pq  # type: ignore[import-not-found,import-untyped,unused-ignore]

    parquet = pq.ParquetFile(f)
    groups, skip = _row_groups(parquet.metadata, shard.file_row, shard.num_rows)
    row_index, left = shard.first_row, shard.num_rows
    for batch in parquet.iter_batches(batch_size=_BLOCK_ROWS, row_groups=groups):
        rows = batch.to_pylist()[skip : skip + left]
        skip = max(0, skip - batch.num_rows)
        for row in rows:
            size = _approx_bytes(row)
            if size > limit:
                yield (row_index, None, "too_large",
                       f"row is about {size} bytes, over the limit of {limit}", size)
            else:
                yield row_index, row, None, None, size
            row_index += 1
        left -= len(rows)
        if left <= 0:
            return


def _row_groups(metadata: Any, first: int, count: int) -> tuple[list[int], int]:
    """Row groups overlapping rows ``first .. first + count`` and the rows to skip in them."""
    groups: list[int] = []
    start, skip = 0, 0
    for g in range(metadata.num_row_groups):
        n = metadata.row_group(g).num_rows
        if start + n > first and start < first + count:
            if not groups:
                skip = first - start
            groups.append(g)
        start += n
    return groups, skip


def _approx_bytes(row: dict[str, Any]) -> int:
    """A Parquet row's size: its text and binary values plus 8 bytes per other value."""
    return sum(len(v) if isinstance(v, str | bytes) else 8 for v in row.values())
