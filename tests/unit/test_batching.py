"""Dynamic batching without a cluster: Ember's batch queue runs in a plain event loop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from ember.app.batching import LIST_CODEC, TENSOR_CODEC, Batch, make_batcher


class Recorder:
    def __init__(self, fail_on: Any = None) -> None:
        self.calls: list[int] = []
        self.fail_on = fail_on

    async def __call__(self, batch: Any) -> Any:
        self.calls.append(len(batch))
        if self.fail_on is not None and self.fail_on in list(batch):
            raise ValueError(f"bad item {self.fail_on}")
        return [x * 10 for x in batch]


def test_concurrent_requests_share_one_call_and_get_their_own_results() -> None:
    async def main() -> list[Any]:
        submit = make_batcher(rec, Batch(max_size=64, max_wait_ms=50), LIST_CODEC)
        return await asyncio.gather(*(submit([i, i + 100]) for i in range(8)))

    rec = Recorder()
    results = asyncio.run(main())
    assert results == [[i * 10, (i + 100) * 10] for i in range(8)]
    assert rec.calls == [16]  # batch size counts items: 8 requests x 2 items


def test_one_bad_item_fails_only_its_request() -> None:
    async def main() -> list[Any]:
        submit = make_batcher(rec, Batch(max_size=64, max_wait_ms=50), LIST_CODEC)
        return await asyncio.gather(*(submit([i]) for i in range(6)), return_exceptions=True)

    rec = Recorder(fail_on=3)
    results = asyncio.run(main())
    assert isinstance(results[3], ValueError)
    assert [r for i, r in enumerate(results) if i != 3] == [[0], [10], [20], [40], [50]]


def test_request_larger_than_a_batch_is_chunked() -> None:
    async def main() -> Any:
        submit = make_batcher(rec, Batch(max_size=4, max_wait_ms=1), LIST_CODEC)
        return await submit(list(range(10)))

    rec = Recorder()
    assert asyncio.run(main()) == [i * 10 for i in range(10)]
    assert max(rec.calls) <= 4 and sum(rec.calls) == 10


def test_tensor_rows_are_stacked_and_split() -> None:
    async def double(x: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return x * 2

    async def main() -> list[Any]:
        submit = make_batcher(double, Batch(max_size=32, max_wait_ms=50), TENSOR_CODEC)
        parts = [torch.full((n, 3), float(n)) for n in (1, 2, 3)]
        return await asyncio.gather(*(submit(p) for p in parts))

    seen: list[tuple[int, ...]] = []
    outs = asyncio.run(main())
    assert seen == [(6, 3)]
    for n, out in zip((1, 2, 3), outs, strict=True):
        assert torch.equal(out, torch.full((n, 3), 2.0 * n))


def test_handler_returning_wrong_count_is_an_error() -> None:
    async def short(batch: Any) -> Any:
        return list(batch)[:-1]

    async def main() -> Any:
        return await make_batcher(short, Batch(max_size=8, max_wait_ms=1), LIST_CODEC)([1, 2])

    with pytest.raises(ValueError, match="returned 1 results for 2 inputs"):
        asyncio.run(main())


def test_max_concurrent_lets_batches_overlap() -> None:
    """With max_concurrent=2 a second batch starts while the first is still running."""
    running = 0
    peak = 0

    async def slow(batch: Any) -> Any:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.05)
        running -= 1
        return batch

    async def main(concurrent: int) -> int:
        nonlocal peak
        peak = 0
        submit = make_batcher(slow, Batch(max_size=2, max_wait_ms=1, max_concurrent=concurrent),
                              LIST_CODEC)
        outs = await asyncio.gather(*(submit([i, i]) for i in range(4)))
        assert outs == [[i, i] for i in range(4)]
        return peak

    assert asyncio.run(main(1)) == 1
    assert asyncio.run(main(2)) == 2


def test_requests_that_arrive_while_a_batch_runs_go_together_as_the_next_batch() -> None:
    """A batch forms when a slot is free, not max_wait after its first request: ten
    requests that trickle in during a 100 ms forward pass make one batch of ten, even with
    a 1 ms wait (Ray Serve's serve.batch would queue several small batches behind it)."""
    calls: list[int] = []

    async def forward(batch: Any) -> Any:
        calls.append(len(batch))
        await asyncio.sleep(0.1)
        return list(batch)

    async def main() -> list[Any]:
        submit = make_batcher(forward, Batch(max_size=32, max_wait_ms=1), LIST_CODEC)
        first = asyncio.ensure_future(submit([0]))
        await asyncio.sleep(0.01)  # the first batch is running
        later = []
        for i in range(1, 11):
            later.append(asyncio.ensure_future(submit([i])))
            await asyncio.sleep(0.005)
        return await asyncio.gather(first, *later)

    assert asyncio.run(main()) == [[i] for i in range(11)]
    assert calls == [1, 10]


def test_a_request_that_gave_up_is_left_out_of_the_next_batch() -> None:
    calls: list[list[int]] = []
    release = asyncio.Event()

    async def forward(batch: Any) -> Any:
        calls.append(list(batch))
        await release.wait()  # the first batch runs until the test lets it go
        return list(batch)

    async def main() -> Any:
        submit = make_batcher(forward, Batch(max_size=32, max_wait_ms=1), LIST_CODEC)
        first = asyncio.ensure_future(submit([0]))
        while not calls:  # the first batch is running (a condition, not a guess of time)
            await asyncio.sleep(0.001)
        gone = asyncio.ensure_future(submit([1]))
        kept = asyncio.ensure_future(submit([2]))
        await asyncio.sleep(0)
        gone.cancel()  # its caller timed out while the first batch ran
        release.set()
        return await asyncio.gather(first, kept)

    assert asyncio.run(main()) == [[0], [2]]
    assert calls == [[0], [2]]


def test_one_poisoned_item_in_64_costs_at_most_13_forward_calls() -> None:
    rec = Recorder(fail_on=37)

    async def main() -> list[Any]:
        submit = make_batcher(rec, Batch(max_size=64, max_wait_ms=50), LIST_CODEC)
        return await asyncio.gather(*(submit([i]) for i in range(64)), return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[37], ValueError)
    assert [r for i, r in enumerate(results) if i != 37] == [[i * 10] for i in range(64)
                                                            if i != 37]
    # The whole batch, then two halves per level down to the bad item: 1 + 2 * log2(64).
    assert len(rec.calls) == 13, rec.calls
    assert rec.calls[0] == 64 and sorted(rec.calls[1:3]) == [32, 32]
