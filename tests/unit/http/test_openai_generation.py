"""OpenAI completions and chat over a real engine, without Ray: shapes, errors, metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import torch
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest

from ember.deployments._textgen_backend import Backend, TinyLMBackend
from ember.deployments._textgen_engine import EngineConfig
from ember.deployments._tinylm import TinyLM, TinyLMConfig
from ember.deployments.textgen import Generator
from ember.edge._asgi import install_error_handlers
from ember.edge.protocols.openai_generation import priority_of
from ember.protocols import GenerateRequest, OpenAIGeneration

from slowgen import SlowBackend

MODEL = "tiny"


class EngineGateway:
    """The gateway an edge gives adapters, with the replica's generator in-process."""

    def __init__(self, generator: Generator) -> None:
        self.generator = generator
        self.registry = CollectorRegistry()

    async def call(self, deployment: str, attr: str, body: Any, request_id: str) -> Any:
        raise AssertionError("generation streams; it never calls")

    async def stream(self, deployment: str, attr: str, body: Any, request_id: str, *,
                     model_id: str | None = None) -> AsyncIterator[Any]:
        assert isinstance(body, GenerateRequest)  # what the replica's handler is annotated with
        async for chunk in self.generator.stream(body):
            yield chunk

    def ready(self) -> bool:
        return True


def build(step_s: float = 0, **limits: Any) -> tuple[FastAPI, EngineGateway]:
    """The routes over an in-process engine; ``step_s`` slows every model step on purpose."""
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(dim=32, n_layers=1, n_heads=2, max_len=256)).eval()
    backend: Backend = TinyLMBackend(model)
    if step_s:
        backend = SlowBackend(backend, step_s)
    gateway = EngineGateway(Generator(backend, EngineConfig(**limits)))
    api = FastAPI()
    install_error_handlers(api, lambda path, reason: None)
    OpenAIGeneration(deployment="TextGen", attr="generate", model=MODEL).install(api, gateway)
    return api, gateway


def client(api: FastAPI) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://t")
    # openai's stubs name their own vendored httpx's client; at run time any httpx client works.
    return openai.AsyncOpenAI(api_key="none", base_url="http://t/v1",
                              http_client=http)  # type: ignore[arg-type]


def test_completions_stream_and_not_with_the_official_client() -> None:
    async def scenario() -> None:
        api, gateway = build()
        oa = client(api)
        whole = await oa.completions.create(model=MODEL, prompt="Hello", max_tokens=12,
                                            temperature=0)
        assert whole.choices[0].finish_reason in ("length", "stop")
        assert whole.usage is not None and whole.usage.prompt_tokens == 6
        assert whole.usage.completion_tokens <= 12
        pieces, usage = [], None
        stream = await oa.completions.create(model=MODEL, prompt="Hello", max_tokens=12,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
            else:
                usage = chunk.usage
        assert "".join(pieces) == whole.choices[0].text  # greedy: the same text both ways
        assert usage is not None and usage.total_tokens == whole.usage.total_tokens
        await gateway.generator.engine.close()

    asyncio.run(scenario())


def test_chat_streams_a_role_then_content_and_ends_with_done() -> None:
    async def scenario() -> None:
        api, gateway = build()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api),
                                     base_url="http://t") as http:
            reply = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5, "stream": True, "seed": 3})
        events = [line.removeprefix("data: ") for line in reply.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert "usage" not in chunks[-1]  # not asked for
        await gateway.generator.engine.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(("field", "value", "status"), [
    ("max_tokens", 0, 422), ("temperature", -1, 422), ("top_p", 0, 422),
    ("max_tokens", 10_000, 400), ("stop", "x" * 257, 400), ("stop", ["ok", "y" * 1000], 400),
    ("stop", ["a", "b", "c", "d", "e"], 422)])
def test_bad_sampling_fields_are_refused_naming_the_field(field: str, value: object,
                                                          status: int) -> None:
    async def scenario() -> httpx.Response:
        api, gateway = build()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api),
                                     base_url="http://t") as http:
            reply = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": "x", field: value})
        await gateway.generator.engine.close()
        return reply

    reply = asyncio.run(scenario())
    assert reply.status_code == status
    assert field in reply.text
    if field == "stop":  # the limit is named, so the caller knows what to send
        limit = "at most 4 items" if isinstance(value, list) and len(value) > 4 \
            else "limit of 256"
        assert limit in reply.json()["error"]["message"]


def test_a_full_engine_answers_503_with_retry_after_before_streaming() -> None:
    async def scenario() -> list[httpx.Response]:
        api, gateway = build(max_num_seqs=1, max_waiting_seqs=1)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api),
                                     base_url="http://t", timeout=60) as http:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}
            replies = await asyncio.gather(*(http.post("/v1/completions", json=body)
                                             for _ in range(4)))
        await gateway.generator.engine.close()
        return list(replies)

    replies = asyncio.run(scenario())
    assert sorted(r.status_code for r in replies) == [200, 200, 503, 503]
    refused = [r for r in replies if r.status_code == 503]
    assert all(r.headers["retry-after"] == "1" and "limit 1" in r.text for r in refused)
    served = [r for r in replies if r.status_code == 200]
    assert all(r.text.endswith("data: [DONE]\n\n") for r in served)


def test_metrics_named_like_vllm_are_observed() -> None:
    async def scenario() -> bytes:
        api, gateway = build()
        await client(api).completions.create(model=MODEL, prompt="a", max_tokens=4,
                                             stream=False)
        await gateway.generator.engine.close()
        return generate_latest(gateway.registry)

    text = asyncio.run(scenario()).decode()
    for name in ("ember_time_to_first_token_seconds_count", "ember_inter_token_latency_seconds",
                 "ember_time_per_output_token_seconds", "ember_generation_tokens_per_second",
                 "ember_generation_tokens_total", "ember_num_requests_running",
                 "ember_num_requests_waiting"):
        assert name in text
    assert 'ember_time_to_first_token_seconds_count{model="tiny"} 1.0' in text


def test_an_unknown_model_is_a_404_in_openai_shape() -> None:
    async def scenario() -> None:
        api, gateway = build()
        with pytest.raises(openai.NotFoundError):
            await client(api).completions.create(model="gpt-9", prompt="a")
        await gateway.generator.engine.close()

    asyncio.run(scenario())


def events_of(reply: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in reply.text.split("\n\n")
            if line.startswith("data: {")]


def test_n_choices_come_indexed_with_usage_over_all_of_them() -> None:
    async def scenario() -> None:
        api, gateway = build(max_num_seqs=4)
        oa = client(api)
        whole = await oa.completions.create(model=MODEL, prompt="Hello", max_tokens=6,
                                            temperature=0, n=3, extra_body={"ignore_eos": True})
        assert [c.index for c in whole.choices] == [0, 1, 2]
        assert len({c.text for c in whole.choices}) == 1  # greedy: n equal choices
        assert whole.usage is not None
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (6, 18)
        assert whole.usage.total_tokens == 24
        stream = await oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2,
            seed=4, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        texts: dict[int, str] = {}
        roles: dict[int, str | None] = {}
        last = None
        async for chunk in stream:
            last = chunk
            for choice in chunk.choices:
                roles.setdefault(choice.index, choice.delta.role)
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        assert sorted(texts) == [0, 1] and roles == {0: "assistant", 1: "assistant"}
        assert last is not None and last.choices == [] and last.usage is not None
        assert last.usage.completion_tokens == 10
        await gateway.generator.engine.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(("header", "value"), [
    ("X-Ember-Priority", "11"), ("X-Ember-Priority", "urgent"), ("X-Ember-Priority", "1.5"),
    ("X-Ember-Timeout-S", "0"), ("X-Ember-Timeout-S", "-1"), ("X-Ember-Timeout-S", "soon"),
    ("X-Ember-Timeout-S", "inf")])
def test_a_bad_admission_header_is_a_400_naming_it(header: str, value: str) -> None:
    async def scenario() -> httpx.Response:
        api, gateway = build()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api),
                                     base_url="http://t") as http:
            reply = await http.post("/v1/completions", headers={header: value},
                                    json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        await gateway.generator.engine.close()
        return reply

    reply = asyncio.run(scenario())
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == header and header in reply.text


def test_max_tokens_defaults_and_its_limit_follow_openai() -> None:
    async def scenario() -> None:
        api, gateway = build()
        oa = client(api)
        chat = await oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
            extra_body={"ignore_eos": True})
        assert chat.usage is not None  # no max_tokens: the room left in the 256-token context
        assert chat.usage.total_tokens == 256 and chat.choices[0].finish_reason == "length"
        plain = await oa.completions.create(model=MODEL, prompt="hi", temperature=0,
                                            extra_body={"ignore_eos": True})
        assert plain.usage is not None and plain.usage.completion_tokens == 16
        with pytest.raises(openai.BadRequestError) as err:
            await oa.completions.create(model=MODEL, prompt="hi", max_tokens=254)
        body = err.value.body
        assert isinstance(body, dict) and body["param"] == "max_tokens"
        assert "limit of 256 tokens" in body["message"]
        await gateway.generator.engine.close()

    asyncio.run(scenario())


def test_a_deadline_stops_a_running_request_504_or_an_error_event() -> None:
    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        # 100 steps of 100 ms (10 s) unless stopped; 2 s for the first token, under load too.
        api, gateway = build(step_s=0.1)
        body = {"model": MODEL, "prompt": "x", "max_tokens": 100, "ignore_eos": True}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api),
                                     base_url="http://t", timeout=60) as http:
            whole = await http.post("/v1/completions", json=body,
                                    headers={"X-Ember-Timeout-S": "2"})
            streamed = await http.post("/v1/completions", json={**body, "stream": True},
                                       headers={"X-Ember-Timeout-S": "2"})
        await gateway.generator.engine.close()
        return whole, streamed

    whole, streamed = asyncio.run(scenario())
    assert whole.status_code == 504 and "while it ran" in whole.text, whole.text
    assert streamed.status_code == 200
    events = events_of(streamed)
    assert events[0]["choices"][0]["text"] is not None  # tokens came, then the error
    assert events[-1]["error"]["code"] == 504 and "[DONE]" not in streamed.text


class StuckGateway(EngineGateway):
    """A replica that never starts the request (a cold start longer than the deadline)."""

    async def stream(self, deployment: str, attr: str, body: Any,
                     request_id: str, *, model_id: str | None = None
                     ) -> AsyncIterator[Any]:
        await asyncio.sleep(3600)
        yield {}


def test_the_edge_answers_504_when_no_replica_starts_the_request_in_time() -> None:
    async def scenario() -> httpx.Response:
        _, gateway = build()
        api = FastAPI()
        install_error_handlers(api, lambda path, reason: None)
        OpenAIGeneration(deployment="TextGen", attr="generate", model=MODEL).install(
            api, StuckGateway(gateway.generator))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api),
                                     base_url="http://t", timeout=60) as http:
            # Bounded here too: without the edge's own deadline the request would hang.
            return await asyncio.wait_for(http.post(
                "/v1/completions", headers={"X-Ember-Timeout-S": "0.5"},
                json={"model": MODEL, "prompt": "x", "max_tokens": 2}), 30)

    reply = asyncio.run(scenario())
    assert reply.status_code == 504 and "before a replica started it" in reply.text


def test_the_priority_header_wins_over_the_body_field_and_the_field_is_checked() -> None:
    assert priority_of(None, 3) == 3 and priority_of(None, None) is None
    assert priority_of(" 7 ", -2) == 7 and priority_of("BATCH", 3) == "batch"

    async def scenario() -> httpx.Response:
        api, gateway = build()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api),
                                     base_url="http://t") as http:
            reply = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 2, "priority": 11})
        await gateway.generator.engine.close()
        return reply

    reply = asyncio.run(scenario())
    assert reply.status_code == 422 and "priority" in reply.text
