"""response_format and logprobs on OpenAI completions and chat, through the official client
over a real engine without Ray: schemas that parse and validate, 400s naming the field before
any replica is asked, and logprobs in both APIs' shapes, streamed and not."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from fastapi import FastAPI
from test_openai_generation import MODEL, EngineGateway, build, client

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
SCHEMA_FORMAT: Any = {"type": "json_schema",
                      "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
CHAT: Any = [{"role": "user", "content": "Who are you?"}]


def scenario(test: Callable[[openai.AsyncOpenAI, FastAPI, EngineGateway], Awaitable[None]]
             ) -> None:
    async def go() -> None:
        api, gateway = build()
        try:
            await test(client(api), api, gateway)
        finally:
            await gateway.generator.engine.close()

    asyncio.run(go())


def test_json_schema_output_parses_and_validates_on_both_routes_streamed_or_not() -> None:
    async def test(oa: openai.AsyncOpenAI, api: FastAPI, gateway: EngineGateway) -> None:
        for seed in range(3):
            chat = await oa.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=200, seed=seed,
                response_format=SCHEMA_FORMAT)
            assert chat.choices[0].finish_reason == "stop"
            content = chat.choices[0].message.content or ""
            jsonschema.validate(json.loads(content), PERSON)
            stream = await oa.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=200, seed=seed, stream=True,
                response_format=SCHEMA_FORMAT)
            assert "".join([c.choices[0].delta.content or "" async for c in stream]) == content
            done = await oa.completions.create(model=MODEL, prompt="x", max_tokens=200,
                                               seed=seed,
                                               extra_body={"response_format": SCHEMA_FORMAT})
            jsonschema.validate(json.loads(done.choices[0].text), PERSON)

    scenario(test)


def test_json_object_output_is_an_object() -> None:
    async def test(oa: openai.AsyncOpenAI, api: FastAPI, gateway: EngineGateway) -> None:
        finished = []
        for seed in range(6):
            chat = await oa.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=120, seed=seed,
                response_format={"type": "json_object"})
            content = chat.choices[0].message.content or ""
            assert content.startswith("{"), content
            if chat.choices[0].finish_reason == "stop":
                finished.append(json.loads(content))
        assert finished and all(isinstance(o, dict) for o in finished)

    scenario(test)


class CountingGateway(EngineGateway):
    def __init__(self, inner: EngineGateway) -> None:
        super().__init__(inner.generator)
        self.streams = 0

    async def stream(self, deployment: str, attr: str, body: Any,
                     request_id: str, *, model_id: str | None = None
                     ) -> AsyncIterator[Any]:
        self.streams += 1
        async for chunk in super().stream(deployment, attr, body, request_id):
            yield chunk


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}},
    {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "string", "pattern": "(((("}}},
    {"type": "json_schema"},
    {"type": "xml"}])
def test_a_format_that_cannot_be_served_is_a_400_naming_response_format_before_dispatch(
        fmt: dict[str, Any]) -> None:
    async def go() -> list[httpx.Response]:
        from ember.edge._asgi import install_error_handlers
        from ember.protocols import OpenAIGeneration

        _, inner = build()
        gateway = CountingGateway(inner)
        api = FastAPI()
        install_error_handlers(api, lambda path, reason: None)
        OpenAIGeneration(deployment="TextGen", attr="generate", model=MODEL).install(api,
                                                                                   gateway)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api),
                                     base_url="http://t") as http:
            replies = [await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": CHAT, "response_format": fmt}),
                await http.post("/v1/completions", json={
                    "model": MODEL, "prompt": "x", "response_format": fmt})]
        assert gateway.streams == 0 and gateway.generator.engine.steps == 0  # nothing touched
        await gateway.generator.engine.close()
        return replies

    for reply in asyncio.run(go()):
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "response_format"


def test_the_replica_refuses_a_bad_grammar_too_before_admission() -> None:
    """The native route reaches the replica without the edge's check: still a 400."""
    from ember.errors import BadRequest
    from ember.protocols import GenerateRequest

    async def go() -> None:
        _, gateway = build()
        body = GenerateRequest.model_validate({"prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}})
        with pytest.raises(BadRequest) as caught:
            await anext(gateway.generator.stream(body))
        assert caught.value.fields["param"] == "response_format"
        assert gateway.generator.engine.waiting == 0 and gateway.generator.engine.steps == 0
        await gateway.generator.engine.close()

    asyncio.run(go())


def _check_entry(entry: Any, top: int) -> None:
    assert entry.logprob <= 0 and bytes(entry.bytes or []).decode("utf-8", "backslashreplace") == (
        entry.token)
    assert len(entry.top_logprobs) == top
    assert [t.logprob for t in entry.top_logprobs] == sorted(
        [t.logprob for t in entry.top_logprobs], reverse=True)


def test_chat_logprobs_have_openais_shape_streamed_or_not() -> None:
    async def test(oa: openai.AsyncOpenAI, api: FastAPI, gateway: EngineGateway) -> None:
        chat = await oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                                temperature=0, logprobs=True, top_logprobs=3)
        choice = chat.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        content = choice.logprobs.content
        assert chat.usage is not None and len(content) == chat.usage.completion_tokens
        for entry in content:
            _check_entry(entry, 3)
            assert entry.top_logprobs[0].token == entry.token  # greedy: the best one
        joined = b"".join(bytes(e.bytes or []) for e in content)
        assert joined.decode("utf-8", "replace") == choice.message.content
        stream = await oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                                  temperature=0, logprobs=True,
                                                  top_logprobs=3, stream=True)
        streamed = [e async for c in stream if c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content or []]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob)
                                                           for e in content]
        plain = await oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
        assert plain.choices[0].logprobs is None  # not asked: not computed

    scenario(test)


def test_completions_logprobs_have_the_legacy_shape_streamed_or_not() -> None:
    async def test(oa: openai.AsyncOpenAI, api: FastAPI, gateway: EngineGateway) -> None:
        done = await oa.completions.create(model=MODEL, prompt="Hello", max_tokens=10,
                                           temperature=0, logprobs=2)
        lp = done.choices[0].logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
        assert lp.text_offset is not None
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(
            lp.text_offset) == 10
        assert all(isinstance(d, dict) and 1 <= len(d) <= 2 for d in lp.top_logprobs)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert all(v is not None and v <= 0 for v in lp.token_logprobs)
        stream = await oa.completions.create(model=MODEL, prompt="Hello", max_tokens=10,
                                             temperature=0, logprobs=2, stream=True)
        parts = [c.choices[0].logprobs async for c in stream]
        assert [t for p in parts if p for t in p.tokens or []] == lp.tokens
        assert [o for p in parts if p for o in p.text_offset or []] == lp.text_offset

    scenario(test)


@pytest.mark.parametrize(("route", "fields", "status", "param"), [
    ("/v1/chat/completions", {"top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, 422, "top_logprobs"),
    ("/v1/completions", {"logprobs": 21}, 422, "logprobs")])
def test_logprob_counts_outside_0_to_20_are_refused(route: str, fields: dict[str, Any],
                                                    status: int, param: str) -> None:
    async def go() -> httpx.Response:
        api, gateway = build()
        body = {"model": MODEL, "messages": CHAT, "prompt": "x", **fields}
        body.pop("prompt" if "chat" in route else "messages")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api),
                                     base_url="http://t") as http:
            reply = await http.post(route, json=body)
        await gateway.generator.engine.close()
        return reply

    reply = asyncio.run(go())
    assert reply.status_code == status and param in reply.text, reply.text
