"""The engine's priorities, deadlines and ``n`` choices, on a backend slowed on purpose so
that every claim is counted in steps of a known length, not in this machine's speed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from ember.deployments._textgen_admission import BATCH
from ember.deployments._textgen_backend import TinyLMBackend
from ember.deployments._textgen_engine import Chunk, Engine, EngineConfig
from ember.deployments._textgen_sampling import SamplingParams
from ember.deployments._tinylm import TinyLM, encode
from ember.errors import BadRequest, DeadlineExceeded

from slowgen import SlowBackend

STEP_S = 0.02


def slow_engine(model: TinyLM, step_s: float = STEP_S,
                **options: object) -> tuple[Engine, SlowBackend]:
    backend = SlowBackend(TinyLMBackend(model), step_s)
    backend.eos_token_id = None  # every sequence runs to max_tokens: lengths in steps are known
    return Engine(backend, EngineConfig.model_validate(options)), backend


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


async def tokens(chunks: AsyncIterator[Chunk]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async for chunk in chunks:
        out.setdefault(chunk.index, []).extend(chunk.token_ids)
    return out


def test_a_later_high_priority_request_runs_before_an_earlier_low_one(model: TinyLM) -> None:
    async def scenario() -> list[str]:
        eng, _ = slow_engine(model, max_num_seqs=1, priority_aging_s=0)
        done: list[str] = []

        async def follow(name: str, chunks: AsyncIterator[Chunk]) -> None:
            await tokens(chunks)
            done.append(name)

        first = eng.generate(encode("a"), greedy(10))
        await anext(first)  # A holds the only slot; the others wait behind it
        waiting = [asyncio.ensure_future(follow(name, eng.generate(encode(name), greedy(3),
                                                                   priority=priority)))
                   for name, priority in (("batch", BATCH), ("low", -5), ("high", 5))]
        while eng.waiting < 3:
            await asyncio.sleep(0)
        await follow("a", first)
        await asyncio.gather(*waiting)
        await eng.close()
        return done

    assert asyncio.run(scenario()) == ["a", "high", "low", "batch"]


def test_a_deadline_that_passes_while_waiting_is_a_504_and_nothing_is_computed(
        model: TinyLM) -> None:
    async def scenario() -> tuple[DeadlineExceeded, SlowBackend, int]:
        eng, backend = slow_engine(model, max_num_seqs=1)
        running = eng.generate(encode("a"), greedy(40))  # 40 steps of 20 ms hold the slot
        await anext(running)
        with pytest.raises(DeadlineExceeded) as err:
            await anext(eng.generate(encode("late"), greedy(4), timeout_s=0.2))
        left = len((await tokens(running))[0])
        await eng.close()
        return err.value, backend, left

    err, backend, left = asyncio.run(scenario())
    assert err.status_code == 504 and "nothing was computed" in str(err)
    assert backend.prefills == [encode("a")]  # the late request was never prefilled
    assert left == 39  # and the running one was not disturbed


def test_a_running_request_past_its_deadline_is_stopped_and_its_slot_freed(
        model: TinyLM) -> None:
    async def scenario() -> tuple[list[Chunk], DeadlineExceeded, int]:
        # 40 steps of 250 ms: 10 s unless stopped; the first token has 3 s to come, so a
        # loaded machine still sees it run before its deadline.
        eng, _ = slow_engine(model, step_s=0.25, max_num_seqs=1)
        got: list[Chunk] = []
        with pytest.raises(DeadlineExceeded) as err:
            async for chunk in eng.generate(encode("a"), greedy(40), timeout_s=3.0):
                got.append(chunk)
        # Freed within a step, not after the 40 tokens it asked for.
        while eng.slots_used:
            await asyncio.sleep(STEP_S / 4)
        steps = eng.steps
        after = await tokens(eng.generate(encode("b"), greedy(3)))
        assert len(after[0]) == 3
        await eng.close()
        return got, err.value, steps

    got, err, steps = asyncio.run(scenario())
    assert err.status_code == 504 and "while it ran" in str(err)
    assert 0 < sum(len(c.token_ids) for c in got) < 40
    assert steps < 40


def test_n_greedy_choices_share_one_prefill_and_are_equal(model: TinyLM) -> None:
    async def scenario() -> tuple[dict[int, list[int]], dict[int, list[int]], SlowBackend]:
        eng, backend = slow_engine(model, max_num_seqs=4)
        three = await tokens(eng.generate(encode("Return the"), greedy(12), n=3))
        one = await tokens(eng.generate(encode("Return the"), greedy(12)))
        await eng.close()
        return three, one, backend

    three, one, backend = asyncio.run(scenario())
    assert sorted(three) == [0, 1, 2]
    assert three[0] == three[1] == three[2] == one[0]
    assert len(backend.prefills) == 2 and backend.forks == 2  # one prefill per request


def test_seeded_choices_differ_from_each_other_and_repeat_with_the_seed(model: TinyLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11)

    async def run() -> dict[int, list[int]]:
        eng, _ = slow_engine(model, max_num_seqs=4)
        out = await tokens(eng.generate(encode("seeded"), params, n=3))
        await eng.close()
        return out

    first, again = asyncio.run(run()), asyncio.run(run())
    assert first == again
    assert len({tuple(first[i]) for i in range(3)}) == 3


def test_limits_are_400s_naming_the_field_and_the_limit(model: TinyLM) -> None:
    async def scenario() -> None:
        eng, _ = slow_engine(model, max_num_seqs=2)
        prompt = encode("hello")  # 6 tokens; the model holds 128
        assert eng.room(len(prompt)) == 122
        with pytest.raises(BadRequest) as err:
            await anext(eng.generate(prompt, greedy(123)))
        assert err.value.fields["param"] == "max_tokens" and "128" in str(err.value)
        with pytest.raises(BadRequest) as err:
            await anext(eng.generate(prompt, greedy(4), n=3))
        assert err.value.fields["param"] == "n" and "limit of 2" in str(err.value)
        await eng.close()

    asyncio.run(scenario())
