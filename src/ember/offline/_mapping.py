"""How dataset rows become a handler's items, and its results become output columns.

The rule (also in ``ember.offline``'s docstring):

* Inputs, for a batch-form handler ``list[X] -> list[Y]``: a pydantic ``X`` is validated
  from the whole row; ``dict`` (or no type argument) gets the row as a dict; any other ``X``
  (``str``, ``int``, ``list[float]``...) is one column, ``text`` unless ``input_column`` says
  otherwise, validated as ``X`` (a ``str`` column is not filled from a number). A tensor-form
  handler gets column ``input`` (a list of numbers per row), stacked into a float32 tensor.
* Outputs: a pydantic ``Y`` becomes one column per field (``model_dump``); a dict, one
  column per key; a vector (list, tuple, numpy array, 1-D tensor, tensor-form rows) the
  list column ``embedding``; anything else the column ``output``. Every output row also has
  ``id`` (the row's ``id`` field as a string, or its row index) and ``row_index``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import to_json

from ember.app.decorator import RouteSpec
from ember.errors import ConfigError, HandlerContract, OfflineError

InputMode = Literal["column", "row", "model", "tensor"]
#: Columns Ember adds to every output row; a handler's output may not use these names.
RESERVED_COLUMNS = ("id", "row_index")

ROW_SCHEMA = pa.schema([
    ("_shard", pa.int32()), ("_row", pa.int64()), ("_id", pa.string()),
    ("_reason", pa.string()), ("_message", pa.string()), ("_input", pa.binary()),
    ("_size", pa.int64()),
])
RESULT_SCHEMA = pa.schema([
    ("_shard", pa.int32()), ("_row", pa.int64()), ("_id", pa.string()),
    ("_reason", pa.string()), ("_message", pa.string()), ("_result", pa.binary()),
])


@functools.lru_cache(maxsize=64)
def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


# Items and results cross Ray Data's blocks as JSON, not pickles: a job's inputs come from
# outside, and nothing in Ember ever loads a pickle.

def encode_item(item: Any) -> bytes:
    """An item prepared by :meth:`InputPlan.prepare`, as JSON for the block."""
    return to_json(item, by_alias=True)


def decode_items(blobs: list[bytes], item_type: Any) -> list[Any]:
    """The handler's items back from their JSON, typed as ``item_type`` again."""
    adapter = _adapter(item_type)
    return [adapter.validate_json(blob) for blob in blobs]


def encode_result(columns: dict[str, Any]) -> bytes:
    """One result's output columns as JSON (numpy arrays become lists)."""
    return to_json(columns, fallback=lambda value: value.tolist())


@dataclass(frozen=True)
class Prepared:
    """A row made ready for the handler: its item, or why it cannot be one."""

    item: Any = None
    reason: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class InputPlan:
    """What a row must hold for one handler, and how its item is built."""

    mode: InputMode
    item_type: Any
    #: The item's column in "column" and "tensor" modes; "" when the item is the whole row.
    column: str
    id_column: str

    def prepare(self, row: Mapping[str, Any]) -> Prepared:
        """Build the item of one row, or say why the row is bad."""
        if self.mode == "row":
            return Prepared(dict(row))
        if self.mode == "model":
            try:
                return Prepared(self.item_type.model_validate(dict(row)))
            except ValidationError as exc:
                return Prepared(reason="invalid_row", message=_first_error(exc))
        if self.column not in row or row[self.column] is None:
            return Prepared(reason="missing_field", message=f"no value in field {self.column!r}")
        try:
            return Prepared(_adapter(self.item_type).validate_python(row[self.column]))
        except ValidationError as exc:
            return Prepared(reason="wrong_type",
                            message=f"field {self.column!r}: {_first_error(exc)}")

    def row_id(self, row: Mapping[str, Any], row_index: int) -> str:
        """The output id: the row's id field as a string, or its row index."""
        value = row.get(self.id_column)
        return str(row_index) if value is None or value == "" else str(value)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    return f"{loc}: {err['msg']}" if loc else str(err["msg"])


def item_type_of(route: RouteSpec) -> Any:
    """``X`` of a batch handler's ``list[X]`` (``Any`` when unparameterised)."""
    args = typing.get_args(route.input_model)
    return args[0] if args else Any


def result_type_of(route: RouteSpec) -> Any:
    """``Y`` of a batch handler's ``list[Y]`` (``Any`` when unknown)."""
    args = typing.get_args(route.output_model)
    return args[0] if args else Any


def plan_inputs(route: RouteSpec, column: str | None, id_column: str) -> InputPlan:
    """The input half of the mapping rule for ``route``.

    Raises:
        ConfigError: when the handler's output model uses a reserved column name.
    """
    _check_output_names(route)
    if route.kind == "tensor":
        return InputPlan("tensor", list[float], column or "input", id_column)
    item = item_type_of(route)
    if isinstance(item, type) and issubclass(item, BaseModel):
        return InputPlan("model", item, "", id_column)
    if item is Any or item is dict or typing.get_origin(item) in (dict, Mapping):
        return InputPlan("row", item, "", id_column)
    return InputPlan("column", item, column or "text", id_column)


def _check_output_names(route: RouteSpec) -> None:
    result = result_type_of(route)
    if isinstance(result, type) and issubclass(result, BaseModel):
        clash = sorted(set(result.model_fields) & set(RESERVED_COLUMNS))
        if clash:
            raise ConfigError(
                f"{route.deployment}.{route.attr} returns {result.__name__} with field(s)"
                f" {clash}; Ember adds {list(RESERVED_COLUMNS)} to batch output, rename them"
            )


def flatten(value: Any) -> dict[str, Any]:
    """The output columns of one result (see the module docstring).

    Raises:
        OfflineError: when a result uses a reserved column name.
    """
    if isinstance(value, BaseModel):
        columns = {k: _plain(v) for k, v in value.model_dump().items()}
    elif isinstance(value, Mapping):
        columns = {str(k): _plain(v) for k, v in value.items()}
    else:
        plain = _plain(value)
        is_vector = isinstance(plain, list) or type(plain).__name__ == "ndarray"
        columns = {"embedding" if is_vector else "output": plain}
    clash = set(columns) & set(RESERVED_COLUMNS)
    if clash:
        raise OfflineError(detail=f"result field(s) {sorted(clash)} collide with the columns"
                           f" Ember adds ({list(RESERVED_COLUMNS)}); rename them")
    return columns


def _plain(value: Any) -> Any:
    """Tensors to numpy, numpy scalars and 0-d arrays to Python scalars, tuples to lists."""
    if type(value).__module__ == "torch":
        value = value.detach().cpu().numpy()
    if type(value).__module__ == "numpy" and getattr(value, "ndim", 0) == 0:
        return value.item()
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Outcome:
    """One item's result, or the error that made it a bad row."""

    value: Any = None
    error: str | None = None


class BatchRunner:
    """Call a batch function on items, in byte-bounded chunks, isolating failing items.

    A chunk that raises is split in halves until the failing items stand alone; they become
    bad rows and their neighbours still get results. A memory error also lowers the largest
    chunk tried from then on, so batches settle at what memory allows.

    Args:
        call: Runs the handler on a list of items, returning one result per item.
        max_batch_bytes: Most input bytes in one call.
        where: ``(deployment, attr)``, for messages.
    """

    def __init__(self, call: Callable[[list[Any]], Sequence[Any]], max_batch_bytes: int,
                 where: tuple[str, str]) -> None:
        self._call = call
        self._max_bytes = max_batch_bytes
        self._where = where
        self.max_items: int | None = None

    def run(self, items: list[Any], sizes: list[int]) -> list[Outcome]:
        """Outcomes of ``items`` (``sizes`` are their input bytes), in order."""
        outcomes: list[Outcome] = []
        start = 0
        while start < len(items):
            stop = self._chunk_end(sizes, start)
            outcomes.extend(self._isolating(items[start:stop]))
            start = stop
        return outcomes

    def _chunk_end(self, sizes: list[int], start: int) -> int:
        stop, total = start, 0
        limit = len(sizes) if self.max_items is None else min(len(sizes), start + self.max_items)
        while stop < limit and (stop == start or total + sizes[stop] <= self._max_bytes):
            total += sizes[stop]
            stop += 1
        return stop

    def _isolating(self, items: list[Any]) -> list[Outcome]:
        try:
            results = self._checked(items)
        except OfflineError:
            raise
        except Exception as exc:
            if _is_memory_error(exc) and len(items) > 1:
                self.max_items = max(1, len(items) // 2)
            if len(items) == 1:
                return [Outcome(error=describe(exc))]
            mid = len(items) // 2
            return self._isolating(items[:mid]) + self._isolating(items[mid:])
        return [Outcome(value=r) for r in results]

    def _checked(self, items: list[Any]) -> Sequence[Any]:
        results = self._call(items)
        if len(results) != len(items):
            raise HandlerContract(deployment=self._where[0], attr=self._where[1],
                                  got=len(results), expected=len(items))
        return results


def describe(exc: BaseException) -> str:
    """``Type: message`` of the user's exception (unwrapped from Ray's), kept short."""
    cause = getattr(exc, "cause", None)  # RayTaskError carries the handler's own exception
    if isinstance(cause, BaseException):
        exc = cause
    return f"{type(exc).__name__}: {exc}"[:2000]


def _is_memory_error(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


class Runs(Protocol):
    """Anything that turns items into outcomes, one each, in order."""

    def run(self, items: list[Any], sizes: list[int]) -> list[Outcome]: ...


def map_table(table: pa.Table, runner: Runs, item_type: Any) -> pa.Table:
    """Run the good rows of a ``ROW_SCHEMA`` table; bad rows pass through as they came."""
    cols = table.to_pydict()
    reasons: list[str | None] = list(cols["_reason"])
    messages: list[str | None] = list(cols["_message"])
    good = [i for i, reason in enumerate(reasons) if reason is None]
    items = decode_items([cols["_input"][i] for i in good], item_type)
    outcomes = runner.run(items, [int(cols["_size"][i]) for i in good])
    results: list[bytes | None] = [None] * len(reasons)
    for i, outcome in zip(good, outcomes, strict=True):
        if outcome.error is not None:
            reasons[i], messages[i] = "handler_error", outcome.error
        else:
            results[i] = encode_result(flatten(outcome.value))
    return pa.table({"_shard": cols["_shard"], "_row": cols["_row"], "_id": cols["_id"],
                     "_reason": reasons, "_message": messages, "_result": results},
                    schema=RESULT_SCHEMA)


class LocalMapper:
    """The Ray Data callable class of a job: one user instance per worker.

    The instance is built once per worker and gets a replica's lifecycle, ``setup()`` then
    ``warmup()`` if defined, before its first batch.

    Args:
        cls: The decorated user class.
        attr: Its batch-form or tensor-form handler.
        tensor: Whether the handler takes a tensor whose rows are the items.
        max_batch_bytes: Most input bytes per handler call.
        deployment: Deployment name, for messages.
    """

    def __init__(self, cls: type, attr: str, tensor: bool, max_batch_bytes: int,
                 deployment: str, item_type: Any = Any) -> None:
        # One loop per worker: async handlers and setup run on it, sync ones directly.
        self._loop = asyncio.new_event_loop()
        impl = cls()
        for hook in ("setup", "warmup"):  # the lifecycle of a replica, once per worker
            method = getattr(impl, hook, None)
            if callable(method):
                self._await(method())
        self._fn: Callable[[Any], Any] = getattr(impl, attr)
        self._tensor = tensor
        self._item_type = item_type
        self.runner = BatchRunner(self._call, max_batch_bytes, (deployment, attr))

    def _await(self, value: Any) -> Any:
        return self._loop.run_until_complete(value) if inspect.isawaitable(value) else value

    def _call(self, items: list[Any]) -> list[Any]:
        if self._tensor:
            import torch

            return list(self._await(self._fn(torch.tensor(items, dtype=torch.float32))))
        return list(self._await(self._fn(items)))

    def __call__(self, batch: pa.Table) -> pa.Table:
        return map_table(batch, self.runner, self._item_type)
