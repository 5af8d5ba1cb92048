"""Dynamic batching on top of Ray Serve's ``serve.batch``.

A handler written for a batch (``def f(self, items: list[X]) -> list[Y]``, or
``def f(self, x: torch.Tensor) -> torch.Tensor`` whose rows are the items) receives the
items of concurrent requests on the replica in one call. Batch size counts *items*: each
request enters ``serve.batch``'s queue as one element whose size (``batch_size_fn``) is its
item count, so a request of 10 inputs fills 10 places, and its results come back as one
slice, in order. A request larger than a batch is cut into batch-sized chunks. Results are
never mixed between requests because ``serve.batch`` answers each element's own future.

When a whole batch raises, each request in it is retried alone, so one bad item fails
only its own request and its neighbours still get answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt

BatchFn = Callable[[Any], Awaitable[Any]]


class Batch(BaseModel):
    """Dynamic batching options of a deployment.

    Example:
        >>> Batch(max_size=32, max_wait_ms=5).max_wait_ms
        5.0
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_size: PositiveInt = Field(default=32, description="Most items in one call.")
    max_wait_ms: NonNegativeFloat = Field(
        default=5.0, description="How long a partial batch waits for more items."
    )
    max_concurrent: PositiveInt = Field(
        default=1,
        description="Batches in flight at once. Sync handlers run each in a worker thread, so "
        "above 1 a CPU model can use more cores, or host work can overlap an accelerator's.",
    )


@dataclass(frozen=True)
class Codec:
    """How a kind of batch is joined and cut: lists of items, or tensors by rows."""

    join: Callable[[Sequence[Any]], Any]
    cut: Callable[[Any, list[int]], list[Any]]
    chunk: Callable[[Any, int], list[Any]]


def _cut_list(joined: Any, sizes: list[int]) -> list[Any]:
    results = list(joined)
    if len(results) != sum(sizes):
        raise ValueError(f"batch handler returned {len(results)} results for {sum(sizes)} inputs")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [results[s : s + n] for s, n in zip(starts, sizes, strict=True)]


def _cut_rows(joined: Any, sizes: list[int]) -> list[Any]:
    if len(joined) != sum(sizes):
        raise ValueError(f"batch handler returned {len(joined)} rows for {sum(sizes)} inputs")
    return list(joined.split(sizes))


def _join_rows(parts: Sequence[Any]) -> Any:
    import torch

    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


LIST_CODEC = Codec(
    join=lambda parts: [item for part in parts for item in part],
    cut=_cut_list,
    chunk=lambda items, n: [items[i : i + n] for i in range(0, len(items), n)],
)
TENSOR_CODEC = Codec(join=_join_rows, cut=_cut_rows, chunk=lambda t, n: list(t.split(n)))


class _Failed:
    """Marks one request's exception inside a batch's result list."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def make_batcher(run: BatchFn, batch: Batch, codec: Codec) -> Callable[[Any], Awaitable[Any]]:
    """Return ``submit(items) -> results``, batching concurrent submissions through ``run``.

    Args:
        run: Calls the user's handler on a joined batch.
        batch: Size and wait limits.
        codec: Joins requests into a batch and cuts the result back.
    """

    async def run_parts(parts: list[Any]) -> list[Any]:
        sizes = [len(p) for p in parts]
        try:
            return codec.cut(await run(codec.join(parts)), sizes)
        except Exception as exc:
            if len(parts) == 1:
                return [_Failed(exc)]
        return [(await run_parts([part]))[0] for part in parts]  # isolate the bad request

    from ray import serve  # imported here so that declaring deployments does not import Ray

    batched = serve.batch(max_batch_size=batch.max_size,
                          batch_wait_timeout_s=batch.max_wait_ms / 1000.0,
                          max_concurrent_batches=batch.max_concurrent,
                          batch_size_fn=lambda parts: sum(len(p) for p in parts))(run_parts)

    async def submit_one(part: Any) -> Any:
        result = await batched(part)
        if isinstance(result, _Failed):
            raise result.error
        return result

    async def submit(items: Any) -> Any:
        if len(items) <= batch.max_size:
            return await submit_one(items)
        chunks = codec.chunk(items, batch.max_size)
        return codec.join(await asyncio.gather(*(submit_one(c) for c in chunks)))

    return submit
