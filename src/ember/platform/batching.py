"""Dynamic batching on top of Ray Serve's ``serve.batch``.

A handler written for a batch (``def f(self, items: list[X]) -> list[Y]``, or
``def f(self, x: torch.Tensor) -> torch.Tensor`` whose rows are the items) receives items
gathered from concurrent requests on the replica. Batch size counts *items*: a request
carrying 10 inputs contributes 10 elements to ``serve.batch``'s queue, and gets its 10
results back in order. Results are never mixed between requests because ``serve.batch``
answers each element's own future.

When a whole batch raises, every item is retried alone, so one bad item fails only its own
request and its neighbours still get answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt
from ray import serve

BatchFn = Callable[[list[Any]], Awaitable[list[Any]]]


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


class _ItemFailed:
    """Marks one item's exception inside a batch's result list."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def stack_rows(items: Sequence[Any]) -> Any:
    """Stack per-item tensors into one batch tensor (items are rows)."""
    import torch

    return torch.stack(list(items))


def split_rows(result: Any, count: int) -> list[Any]:
    """Split a batch tensor back into ``count`` rows, checking the handler kept the rows."""
    if len(result) != count:
        raise ValueError(f"batch handler returned {len(result)} rows for {count} inputs")
    return list(result.unbind(0))


def make_batcher(run: BatchFn, batch: Batch) -> Callable[[Any], Awaitable[Any]]:
    """Return ``submit(item) -> result``, batching concurrent submissions through ``run``."""

    async def run_isolated(items: list[Any]) -> list[Any]:
        try:
            results = await run(items)
        except Exception as exc:
            if len(items) == 1:
                return [_ItemFailed(exc)]
            return [await _run_one(run, item) for item in items]
        if len(results) != len(items):
            err = ValueError(f"batch handler returned {len(results)} results for {len(items)}")
            return [_ItemFailed(err)] * len(items)
        return list(results)

    batched = serve.batch(max_batch_size=batch.max_size,
                          batch_wait_timeout_s=batch.max_wait_ms / 1000.0)(run_isolated)

    async def submit(item: Any) -> Any:
        result = await batched(item)
        if isinstance(result, _ItemFailed):
            raise result.error
        return result

    return submit


async def _run_one(run: BatchFn, item: Any) -> Any:
    try:
        return (await run([item]))[0]
    except Exception as exc:
        return _ItemFailed(exc)


async def submit_all(submit: Callable[[Any], Awaitable[Any]], items: Sequence[Any]) -> list[Any]:
    """Submit every item of one request; the first failing item fails the request."""
    return list(await asyncio.gather(*(submit(item) for item in items)))
