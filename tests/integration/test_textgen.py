"""Generation on a real cluster: the official client, SSE, admission, disconnects, metrics,
the cold-start header and scale to zero."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from ember.deployments.textgen import MODEL_NAME

from apps import textgen
from serving import ServeApp
from support import wait_for_scale_down

pytestmark = pytest.mark.cluster

BODY = {"model": MODEL_NAME, "prompt": "Return the", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(textgen.app, ready_timeout_s=120) as base:
        yield base


def test_the_first_response_of_a_cold_deployment_carries_the_cold_start_header(
        url: str) -> None:
    reply = httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)
    assert reply.status_code == 200, reply.text
    assert "x-ember-cold-start" in reply.headers
    again = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
    assert "x-ember-cold-start" not in again.headers
    assert again.json()["choices"][0]["text"] == reply.json()["choices"][0]["text"]


def test_the_official_client_streams_and_does_not(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    whole = client.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=24,
                                      temperature=0)
    stream = client.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=24,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is a socket?"}],
        max_tokens=16, seed=5, top_p=0.9, stop=["\n\n"])
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is a socket?"}],
        max_tokens=16, seed=5, top_p=0.9, stop=["\n\n"], stream=True)]
    assert "".join(pieces) == chat.choices[0].message.content  # same seed, same text


def test_the_native_generate_route_streams_server_sent_events(url: str) -> None:
    reply = httpx.post(f"{url}/generate", json={"prompt": "Return the", "max_tokens": 6,
                                                "temperature": 0}, timeout=60)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line.removeprefix("data: ")) for line in reply.text.split("\n\n")
              if line.startswith("data: ")]
    # One event per step while the reader keeps up; tokens that waited for a reader that fell
    # behind come merged in one event (the engine's adaptive stream interval). Either way
    # each event's count is the running total of the tokens the events carried.
    counts = [e["completion_tokens"] for e in events]
    assert all(e["tokens"] >= 1 for e in events), events
    assert counts == list(itertools.accumulate(e["tokens"] for e in events)), events
    assert events[-1]["finish_reason"] in ("stop", "length") and counts[-1] <= 6


def test_bad_fields_get_422_naming_the_field(url: str) -> None:
    for field, value in (("max_tokens", 0), ("temperature", -1)):
        reply = httpx.post(f"{url}/v1/completions", json={**BODY, field: value}, timeout=30)
        assert reply.status_code == 422 and field in reply.text, reply.text
    too_long = httpx.post(f"{url}/v1/completions", json={**BODY, "max_tokens": 5000},
                          timeout=30)
    assert too_long.status_code == 400 and "max_tokens" in too_long.text


def _stream_all(url: str, n: int, max_tokens: int) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {**BODY, "max_tokens": max_tokens, "stream": True}
            return list(await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body)
                                               for _ in range(n))))

    return asyncio.run(run())


def test_a_full_engine_refuses_with_503_and_retry_after(url: str) -> None:
    replies = _stream_all(url, 6, 300)
    codes = sorted(r.status_code for r in replies)
    # Two running and one waiting at most: the rest are refused at once, never queued.
    assert codes.count(200) >= 3 and codes.count(503) >= 1, codes
    refused = [r for r in replies if r.status_code == 503]
    assert all(r.headers.get("retry-after") for r in refused)
    assert all(r.text.endswith("data: [DONE]\n\n") for r in replies if r.status_code == 200)


LONG = {"prompt": "Return the", "max_tokens": 480, "temperature": 0, "ignore_eos": True}


async def _events(reply: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in reply.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


async def _until(events: AsyncIterator[dict[str, Any]],
                 test: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first event that passes ``test``, or the last one (the stream's end)."""
    async for event in events:
        if test(event) or event["finish_reason"] is not None:
            return event
    raise AssertionError("the stream ended without a last event")


def test_a_client_that_disconnects_frees_its_slot(url: str) -> None:
    """Counted in engine steps, not seconds: A and B (480 tokens each, B sent after A's first
    token) fill both slots and B leaves. Each of A's chunks carries the engine's running
    count; only a cancelled B can leave A running alone before A's 480th token, since B
    could not end by itself before A did."""

    async def run() -> tuple[dict[str, Any], list[int]]:
        async with (httpx.AsyncClient(timeout=120) as client,
                    client.stream("POST", f"{url}/generate", json=LONG) as a):
            assert a.status_code == 200
            a_events = _events(a)
            await anext(a_events)
            async with client.stream("POST", f"{url}/generate", json=LONG) as b:
                assert b.status_code == 200
                await anext(_events(b))
                await _until(a_events, lambda e: e["running"] == 2)  # B is in A's batch
            alone = await _until(a_events, lambda e: e["running"] == 1)
            # A holds one slot; B's is free: one short request takes it, one waits.
            short = {"prompt": "Return the", "max_tokens": 4, "temperature": 0}
            replies = await asyncio.gather(*(client.post(f"{url}/generate", json=short)
                                             for _ in range(2)))
            return alone, [r.status_code for r in replies]

    alone, codes = asyncio.run(run())
    assert alone["finish_reason"] is None, f"B held its slot until A ended: {alone}"
    assert alone["completion_tokens"] < LONG["max_tokens"]
    assert codes == [200, 200]


def _finish_order(url: str, route: str) -> tuple[list[str], int]:
    """A long and then a short request to ``route``: the order in which they finish at the
    client, and how many sequences the engine still ran when the short one's last chunk
    left it. The short one is sent once the long one has its first token (its batch has
    begun)."""

    async def run() -> tuple[list[str], int]:
        done: list[str] = []
        last: dict[str, dict[str, Any]] = {}
        async with httpx.AsyncClient(timeout=120) as client:

            async def follow(name: str, body: dict[str, Any], begun: asyncio.Event) -> None:
                async with client.stream("POST", f"{url}{route}", json=body) as reply:
                    assert reply.status_code == 200, await reply.aread()
                    async for event in _events(reply):
                        begun.set()
                        if event["finish_reason"] is not None:
                            done.append(name)
                            last[name] = event

            long_begun, short_begun = asyncio.Event(), asyncio.Event()
            long = asyncio.create_task(follow("long", {**LONG, "max_tokens": 300}, long_begun))
            await long_begun.wait()
            short = {"prompt": "Return the", "max_tokens": 4, "temperature": 0,
                     "ignore_eos": True}
            await asyncio.gather(long, follow("short", short, short_begun))
        return done, int(last["short"]["running"])

    return asyncio.run(run())


def test_continuous_batching_lets_a_short_request_finish_before_a_long_one(url: str) -> None:
    # The engine's own view: when the short one finished, the long one was still running.
    assert _finish_order(url, "/generate") == (["short", "long"], 1)
    # The same test on the static schedule fails: the short request waits for the batch the
    # long one began, so it runs alone once the long one is done. (The client may still see
    # the short one end first: the long one's last chunks can trail it on a loaded machine.)
    order, running = _finish_order(url, "/generate-static")
    assert running == 0, order


def test_generation_metrics_are_exported(url: str) -> None:
    httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for name in ("ember_time_to_first_token_seconds_bucket",
                 "ember_inter_token_latency_seconds_bucket",
                 "ember_time_per_output_token_seconds_bucket",
                 "ember_generation_tokens_per_second_bucket", "ember_generation_tokens_total",
                 "ember_num_requests_running", "ember_num_requests_waiting"):
        assert name in text, name


def test_it_scales_to_zero_and_answers_cold_again(url: str) -> None:
    wait_for_scale_down(url, "SmallGen", to=0, timeout_s=60)
    reply = httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)
    assert reply.status_code == 200 and "x-ember-cold-start" in reply.headers
