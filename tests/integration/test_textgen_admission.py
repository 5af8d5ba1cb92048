"""Admission of generation requests on a real cluster, through the official ``openai``
client: priorities, deadlines (504 before prefill, a running request stopped), ``n``
choices, ``usage`` and the ``max_tokens`` limit.

The model sleeps 50 ms before every step (``apps/textgen_admission.py``), so the requests
that hold the two slots stay there for as long as a test needs; nothing depends on how
fast this machine is. Waiting for a state polls the deployment's stats route."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

from ember.deployments.textgen import MODEL_NAME

from apps import textgen_admission
from serving import ServeApp

pytestmark = pytest.mark.cluster

#: Long enough (400 steps of 50 ms) that only a test can end it early.
HOLD_TOKENS = 400


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(textgen_admission.app, ready_timeout_s=120) as base:
        yield base


def client(url: str) -> openai.AsyncOpenAI:
    # No retries: a 504 or a 400 is the answer under test, not something to try again.
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                              timeout=120)


async def until(url: str, test: Callable[[dict[str, Any]], bool], timeout_s: float = 60
                ) -> dict[str, Any]:
    """The deployment's stats once ``test`` passes on them; fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient(timeout=30) as http:
        while True:
            stats: dict[str, Any] = (await http.get(f"{url}/admitgen/stats")).json()
            if test(stats):
                return stats
            assert asyncio.get_running_loop().time() < deadline, f"never reached: {stats}"
            await asyncio.sleep(0.05)


async def hold(oa: openai.AsyncOpenAI, name: str) -> Any:
    """A stream holding one slot for ``HOLD_TOKENS`` steps, once its first token came."""
    stream = await oa.completions.create(model=MODEL_NAME, prompt=name, max_tokens=HOLD_TOKENS,
                                         temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    await anext(aiter(stream))
    return stream


@asynccontextmanager
async def both_slots_held(url: str) -> AsyncIterator[list[Any]]:
    """Two long streams in the two slots; closed (their slots freed) on the way out."""
    oa = client(url)
    streams = [await hold(oa, "hold-a"), await hold(oa, "hold-b")]
    try:
        await until(url, lambda s: s["slots_used"] == 2)
        yield streams
    finally:
        for stream in streams:
            await stream.close()
        await until(url, lambda s: s["slots_used"] == 0)


def test_a_later_high_priority_request_finishes_before_an_earlier_low_one(url: str) -> None:
    async def run() -> list[str]:
        oa, done = client(url), list[str]()

        async def ask(name: str, priority: str) -> None:
            await oa.completions.create(model=MODEL_NAME, prompt=name, max_tokens=6,
                                        temperature=0, extra_body={"ignore_eos": True},
                                        extra_headers={"X-Ember-Priority": priority})
            done.append(name)

        async with both_slots_held(url) as (_, second):
            low = asyncio.ensure_future(ask("low", "-5"))
            await until(url, lambda s: s["waiting"] == 1)
            high = asyncio.ensure_future(ask("high", "5"))
            await until(url, lambda s: s["waiting"] == 2)
            await second.close()  # one slot frees: the later, higher request takes it
            await asyncio.gather(low, high)
        return done

    assert asyncio.run(run()) == ["high", "low"]


def test_a_deadline_passing_while_waiting_is_a_504_and_nothing_is_computed(url: str) -> None:
    async def run() -> tuple[openai.APIStatusError, dict[str, Any]]:
        async with both_slots_held(url):
            with pytest.raises(openai.APIStatusError) as err:
                await client(url).completions.create(
                    model=MODEL_NAME, prompt="late-request", max_tokens=4,
                    extra_headers={"X-Ember-Timeout-S": "0.5"})
            stats = await until(url, lambda s: True)
        return err.value, stats

    err, stats = asyncio.run(run())
    assert err.status_code == 504 and "nothing was computed" in err.message, err.message
    assert not any("late-request" in p for p in stats["prefilled"])


def test_a_running_request_past_its_deadline_is_stopped_and_its_slot_freed(url: str) -> None:
    async def run() -> tuple[int, openai.APIError, openai.APIStatusError]:
        oa = client(url)
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": "Return the",
                                "max_tokens": HOLD_TOKENS, "temperature": 0,
                                "extra_body": {"ignore_eos": True},
                                # 4 s for a first token through Ray and HTTP, under load too
                                "extra_headers": {"X-Ember-Timeout-S": "4"}}
        chunks = 0
        with pytest.raises(openai.APIError) as in_band:  # the error event after a 200
            async for _ in await oa.completions.create(**body, stream=True):
                chunks += 1
        # Its slot is free long before its 400 tokens (20 s) could have run.
        await until(url, lambda s: s["slots_used"] == 0, timeout_s=10)
        with pytest.raises(openai.APIStatusError) as whole:
            await oa.completions.create(**body)
        return chunks, in_band.value, whole.value

    chunks, in_band, whole = asyncio.run(run())
    assert 0 < chunks < HOLD_TOKENS and "while it ran" in in_band.message, in_band.message
    assert whole.status_code == 504 and "while it ran" in whole.message


def test_n_choices_and_usage_through_the_official_client(url: str) -> None:
    async def run() -> None:
        oa = client(url)
        # 24 tokens: enough that a choice decoding over a cache it did not copy differs.
        ask: dict[str, Any] = {"model": MODEL_NAME, "prompt": "Return the", "max_tokens": 24,
                               "temperature": 0, "extra_body": {"ignore_eos": True}}
        one = await oa.completions.create(**ask)
        whole = await oa.completions.create(**ask, n=2)
        assert [c.index for c in whole.choices] == [0, 1]
        # Greedy: both choices are the one-choice answer.
        assert [c.text for c in whole.choices] == [one.choices[0].text] * 2
        assert whole.usage is not None and whole.usage.completion_tokens == 48
        assert whole.usage.total_tokens == whole.usage.prompt_tokens + 48
        stream = await oa.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "What is a socket?"}],
            max_tokens=5, n=2, seed=3, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        indexes, last = set(), None
        async for chunk in stream:
            indexes |= {c.index for c in chunk.choices}
            last = chunk
        assert indexes == {0, 1}
        assert last is not None and last.choices == [] and last.usage is not None
        assert last.usage.completion_tokens == 10

    asyncio.run(run())


def test_max_tokens_over_the_context_and_bad_headers_are_400s_naming_them(url: str) -> None:
    async def run() -> None:
        oa = client(url)
        with pytest.raises(openai.BadRequestError) as err:
            await oa.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=600)
        assert "max_tokens" in err.value.message and "limit of 512" in err.value.message
        for header, value in (("X-Ember-Priority", "high"), ("X-Ember-Timeout-S", "-2")):
            with pytest.raises(openai.BadRequestError) as err:
                await oa.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2,
                                            extra_headers={header: value})
            assert header in err.value.message

    asyncio.run(run())
