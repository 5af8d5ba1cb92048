"""The generation engine without Ray: batching equality, disconnects, admission, sampling."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.deployments._textgen_admission import Waiting, plan
from ember.deployments._textgen_backend import TinyLMBackend
from ember.deployments._textgen_engine import Chunk, Engine, EngineConfig, Need
from ember.deployments._textgen_sampling import SamplingParams, StopText, _nucleus, _overlap
from ember.deployments._tinylm import TinyLM, encode
from ember.errors import BadRequest, QueueFull

PROMPTS = ["The licence", "def f(x):", "Return the", "a", "PYTHON SOFTWARE FOUNDATION",
           "socket", "Copyright (c) 2001", "x = [1, 2"]
LENGTHS = [5, 23, 9, 40, 1, 17, 31, 12]


def engine(model: TinyLM, **options: object) -> Engine:
    return Engine(TinyLMBackend(model), EngineConfig.model_validate(options))


async def collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    return [c async for c in chunks]


def greedy(n: int, **extra: object) -> SamplingParams:
    return SamplingParams.model_validate({"max_tokens": n, "temperature": 0, **extra})


def reference(model: TinyLM, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with no cache at all: the full sequence through forward() each time."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


async def run_all(eng: Engine, lengths: list[int]) -> list[list[int]]:
    outs = await asyncio.gather(*(collect(eng.generate(encode(p), greedy(n)))
                                  for p, n in zip(PROMPTS, lengths, strict=True)))
    await eng.close()
    return [[t for c in chunks for t in c.token_ids] for chunks in outs]


def test_batched_greedy_equals_one_at_a_time_token_for_token(model: TinyLM) -> None:
    # No EOS here: every sequence runs its full length, so joins and leaves happen mid-batch.
    batched_engine = engine(model, max_num_seqs=4)
    batched_engine.backend.eos_token_id = None
    alone = engine(model, max_num_seqs=1)
    alone.backend.eos_token_id = None
    batched = asyncio.run(run_all(batched_engine, LENGTHS))
    single = asyncio.run(run_all(alone, LENGTHS))
    assert batched_engine.steps < alone.steps  # it did batch
    assert batched == single
    assert [len(t) for t in batched] == LENGTHS
    # And both equal decoding without any KV cache.
    for prompt, n, got in zip(PROMPTS, LENGTHS, batched, strict=True):
        assert got == reference(model, encode(prompt), n)


def test_static_mode_gives_the_same_tokens(model: TinyLM) -> None:
    static = engine(model, max_num_seqs=4, mode="static")
    static.backend.eos_token_id = None
    alone = engine(model, max_num_seqs=1)
    alone.backend.eos_token_id = None
    assert asyncio.run(run_all(static, LENGTHS)) == asyncio.run(run_all(alone, LENGTHS))


def test_a_disconnect_frees_the_slot_within_one_step(model: TinyLM) -> None:
    async def scenario() -> None:
        eng = engine(model, max_num_seqs=2)
        keep = asyncio.ensure_future(collect(eng.generate(encode("a"), greedy(60))))
        stream = cast(AsyncGenerator[Chunk, None], eng.generate(encode("b"), greedy(60)))
        await anext(stream)
        await anext(stream)
        assert eng.slots_used == 2
        await stream.aclose()  # what the replica does when the caller disconnects
        closed_at = eng.steps
        # Look on every turn of the loop: a timer would let the next step finish unseen.
        while eng.slots_used == 2:
            await asyncio.sleep(0)
        assert eng.steps <= closed_at + 1
        assert not keep.done()  # the other sequence runs on
        assert len([t for c in await keep for t in c.token_ids]) == 60
        await eng.close()

    asyncio.run(scenario())


def test_admission_refuses_beyond_the_waiting_limit_with_503(model: TinyLM) -> None:
    async def scenario() -> None:
        eng = engine(model, max_num_seqs=1, max_waiting_seqs=2)
        streams = [eng.generate(encode("x"), greedy(30)) for _ in range(4)]
        # The first is admitted at the first step; two wait; the fourth is refused.
        first = asyncio.ensure_future(anext(streams[0]))
        await asyncio.sleep(0)
        waits = [asyncio.ensure_future(anext(s)) for s in streams[1:3]]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as err:
            await anext(streams[3])
        assert err.value.status_code == 503 and "limit 2" in str(err.value)
        for task in [first, *waits]:
            task.cancel()
        await asyncio.gather(first, *waits, return_exceptions=True)
        await eng.close()

    asyncio.run(scenario())


def test_a_request_that_cannot_fit_is_a_400_naming_max_tokens(model: TinyLM) -> None:
    async def scenario() -> None:
        eng = engine(model, max_num_batched_tokens=50)
        with pytest.raises(BadRequest) as err:
            await anext(eng.generate(encode("hello"), greedy(46)))
        assert err.value.status_code == 400 and "max_tokens" in str(err.value)
        # 6 prompt tokens + 44 fits exactly.
        assert len(await collect(eng.generate(encode("hello"), greedy(44)))) >= 1
        await eng.close()

    asyncio.run(scenario())


def admitted(needs: list[Need], config: EngineConfig, *, running: int = 0, reserved: int = 0,
             oldest_wait_s: float = 0) -> int:
    line = [Waiting(need, arrived_s=i) for i, need in enumerate(needs)]
    return len(plan(line, running=running, reserved=reserved, config=config, max_len=512,
                    now_s=0, oldest_wait_s=oldest_wait_s).admit)


def test_token_budget_limits_the_running_batch() -> None:
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=100)
    needs = [Need(10, 30)] * 5
    assert admitted(needs, cfg) == 2
    assert admitted(needs, cfg, running=1, reserved=80) == 0
    assert admitted(needs, cfg, running=7) == 1
    static = EngineConfig(max_num_seqs=4, mode="static", static_wait_s=1)
    assert admitted(needs[:2], static, oldest_wait_s=0.1) == 0  # still gathering its batch
    assert admitted(needs[:2], static, oldest_wait_s=1) == 2
    assert admitted(needs, static, running=1, oldest_wait_s=5) == 0  # a batch is running


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(model: TinyLM) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7)

    async def one(extra: int) -> list[int]:
        eng = engine(model, max_num_seqs=4)
        eng.backend.eos_token_id = None
        others = [asyncio.ensure_future(collect(eng.generate(encode("z"), greedy(10))))
                  for _ in range(extra)]
        mine = await collect(eng.generate(encode("seeded"), params))
        await asyncio.gather(*others)
        await eng.close()
        return [t for c in mine for t in c.token_ids]

    alone, shared = asyncio.run(one(0)), asyncio.run(one(3))
    assert alone == shared
    other_seed = asyncio.run(_sampled(model, params.model_copy(update={"seed": 8})))
    assert other_seed != alone


async def _sampled(model: TinyLM, params: SamplingParams) -> list[int]:
    eng = engine(model)
    eng.backend.eos_token_id = None
    out = [t for c in await collect(eng.generate(encode("seeded"), params)) for t in c.token_ids]
    await eng.close()
    return out


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert _nucleus(probs.clone(), 0.7).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert _nucleus(probs.clone(), 0.1).tolist() == pytest.approx([1, 0, 0, 0])
    assert _nucleus(probs.clone(), 1.0).tolist() == pytest.approx(probs.tolist())


def test_stop_strings_cut_the_text_and_never_leak_in_pieces() -> None:
    stop = StopText(("END",))
    sent = ""
    for piece in ["hel", "lo E", "N", "D and more"]:
        stop.add(piece)
        sent += stop.release(final=False)
        if piece == "lo E":
            assert sent == "hello "  # "E" might start END: held back
    assert stop.stopped and sent == "hello "
    loose = StopText(("END",))
    loose.add("hello E")
    assert loose.release(final=False) == "hello " and loose.release(final=True) == "E"


def _overlap_by_brute_force(text: str, stop: str) -> int:
    return max((n for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab", max_size=30), stop=st.text("ab", min_size=1, max_size=12))
def test_the_held_back_tail_is_the_longest_suffix_starting_a_stop(text: str, stop: str) -> None:
    assert _overlap(text, stop) == _overlap_by_brute_force(text, stop)


class _Counted(str):
    """A stop string that counts the characters read out of it (by index or slice)."""

    read = 0

    def __getitem__(self, key: Any) -> str:
        part = str.__getitem__(self, key)
        _Counted.read += len(part)
        return part

    def __hash__(self) -> int:  # _failure's cache must not serve another test's count
        return id(self)


@pytest.mark.parametrize("length", [64, 256])
def test_the_held_back_tail_reads_each_stop_character_a_bounded_number_of_times(
        length: int) -> None:
    """Linear, not quadratic, per token: trying every prefix (``text.endswith(stop[:n])``)
    reads about length**2 / 2 characters here (2,000 at 64, 33,000 at 256)."""
    stop = _Counted("a" * (length - 1) + "b")  # every proper prefix is a suffix of the text
    _Counted.read = 0
    assert _overlap("x" + "a" * (length - 1), stop) == length - 1
    assert _Counted.read <= 10 * length, _Counted.read  # KMP: about 8 per character


def test_a_stop_string_finishes_the_sequence_with_reason_stop(model: TinyLM) -> None:
    async def scenario() -> tuple[str, list[Chunk]]:
        eng = engine(model)
        eng.backend.eos_token_id = None
        free = await collect(eng.generate(encode("q"), greedy(30)))
        text = "".join(c.text for c in free)
        stop = text[5:7]
        chunks = await collect(eng.generate(encode("q"), greedy(30, stop=(stop,))))
        await eng.close()
        return text[:text.find(stop)], chunks

    expected, chunks = asyncio.run(scenario())
    assert "".join(c.text for c in chunks) == expected
    assert chunks[-1].finish_reason == "stop"


def test_a_failed_step_fails_its_sequences_and_the_engine_serves_on(model: TinyLM) -> None:
    async def scenario() -> None:
        eng = engine(model)
        backend = eng.backend
        real_decode = backend.decode
        calls = 0

        def flaky(slots: list[int], tokens: list[int]) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise RuntimeError("kernel failed")
            return real_decode(slots, tokens)

        backend.decode = flaky  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="kernel failed"):
            await collect(eng.generate(encode("a"), greedy(10)))
        assert eng.slots_used == 0
        assert len(await collect(eng.generate(encode("b"), greedy(5)))) == 5
        await eng.close()

    asyncio.run(scenario())


def test_ignore_eos_decodes_past_the_end_of_sequence_token(model: TinyLM) -> None:
    first = reference(model, encode("Return the"), 1)[0]

    async def run(**extra: object) -> list[Chunk]:
        eng = engine(model)
        eng.backend.eos_token_id = first  # the model's very first token ends the sequence
        chunks = await collect(eng.generate(encode("Return the"), greedy(12, **extra)))
        await eng.close()
        return chunks

    stopped, ignored = asyncio.run(run()), asyncio.run(run(ignore_eos=True))
    assert (stopped[-1].finish_reason, stopped[-1].completion_tokens) == ("stop", 1)
    assert (ignored[-1].finish_reason, ignored[-1].completion_tokens) == ("length", 12)
    assert [t for c in ignored for t in c.token_ids] == reference(model, encode("Return the"), 12)


def test_a_consumer_that_falls_behind_gets_the_waiting_tokens_in_one_chunk(
        model: TinyLM) -> None:
    async def scenario() -> list[Chunk]:
        eng = engine(model)
        chunks = []
        async for chunk in eng.generate(encode("Return the"), greedy(40)):
            chunks.append(chunk)
            await asyncio.sleep(0.05)  # a slow transport: several steps pass meanwhile
        await eng.close()
        return chunks

    chunks = asyncio.run(scenario())
    assert len(chunks) < 40 and max(len(c.token_ids) for c in chunks) > 1
    assert [t for c in chunks for t in c.token_ids] == reference(model, encode("Return the"), 40)
    assert [c.completion_tokens for c in chunks] == list(
        itertools.accumulate(len(c.token_ids) for c in chunks))
    assert chunks[-1].finish_reason == "length"
