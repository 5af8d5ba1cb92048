"""Structured output and logprobs on a real cluster through the official ``openai`` client:
schema-valid JSON from the byte model and from a transformers model, JSON objects, the 400
for a schema that cannot compile, and logprobs in both APIs' shapes, streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from ember.deployments.textgen import MODEL_NAME

from apps import structured, textgen
from serving import ServeApp
from support import char_llama

pytestmark = pytest.mark.cluster

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 10}}}}
SCHEMA_FORMAT: Any = {"type": "json_schema",
                      "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
CHAT: Any = [{"role": "user", "content": "Describe a person."}]


def _person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def test_a_transformers_model_gives_schema_valid_json(serve_app: ServeApp) -> None:
    """First in the module: both apps serve the same OpenAI routes on the session's port,
    so this one is served and deleted before the module's byte-model app is served."""
    char_llama(structured.MODEL_DIR)  # built here once, read by the replica
    with serve_app(structured.app, ready_timeout_s=240) as base:
        hf = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
        for seed in range(2):
            chat = hf.chat.completions.create(
                model=structured.MODEL_NAME, messages=CHAT, max_tokens=400, seed=seed,
                response_format=SCHEMA_FORMAT, logprobs=True)
            content = chat.choices[0].message.content or ""
            assert chat.choices[0].finish_reason == "stop", content
            _person(content)
            assert chat.choices[0].logprobs is not None
            tokens = [e.token for e in chat.choices[0].logprobs.content or []]
            assert "".join(tokens).startswith(content)  # one character per token


@pytest.fixture(scope="module")
def client(serve_app: ServeApp) -> Iterator[openai.OpenAI]:
    with serve_app(textgen.app, ready_timeout_s=120) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)


def test_json_schema_output_parses_and_validates_on_both_routes(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=400,
                                          temperature=0, response_format=SCHEMA_FORMAT)
    content = chat.choices[0].message.content or ""
    assert chat.choices[0].finish_reason == "stop", content
    _person(content)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=400, temperature=0, stream=True,
        response_format=SCHEMA_FORMAT))
    assert streamed == content  # greedy: the same tokens, streamed
    for seed in range(3):  # sampled, on the completions route
        done = client.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=400,
                                         seed=seed, extra_body={"response_format": SCHEMA_FORMAT})
        assert done.choices[0].finish_reason == "stop"
        _person(done.choices[0].text)


def test_json_object_output_is_an_object(client: openai.OpenAI) -> None:
    texts = []
    for seed in range(12):
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Give me a JSON object."}],
            max_tokens=64, seed=seed, response_format={"type": "json_object"})
        texts.append((chat.choices[0].message.content or "", chat.choices[0].finish_reason))
    assert all(text.startswith("{") for text, _ in texts), texts
    finished = [json.loads(text) for text, reason in texts if reason == "stop"]
    assert finished and all(isinstance(o, dict) for o in finished), texts


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}},
    {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "string", "pattern": "(((("}}},
    {"type": "yaml"}])
def test_a_format_that_cannot_be_served_is_a_400_naming_response_format(
        client: openai.OpenAI, fmt: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, response_format=fmt)
    assert caught.value.status_code == 400
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "response_format"


def test_chat_logprobs_have_openais_shape_streamed_or_not(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12,
                                          temperature=0, logprobs=True, top_logprobs=4)
    assert chat.choices[0].logprobs is not None and chat.usage is not None
    content = chat.choices[0].logprobs.content or []
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes is not None and len(entry.top_logprobs) == 4
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
    assert b"".join(bytes(e.bytes or []) for e in content).decode("utf-8", "replace") == (
        chat.choices[0].message.content)
    streamed = [e for c in client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=4, stream=True) if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completions_logprobs_have_the_legacy_shape_streamed_or_not(
        client: openai.OpenAI) -> None:
    done = client.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=12,
                                     temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert lp.token_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == done.choices[0].text  # byte tokens of ASCII text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(12)]
    assert all(len(d) <= 3 and lp.tokens[i] in d for i, d in enumerate(lp.top_logprobs))
    parts = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL_NAME, prompt="Return the", max_tokens=12, temperature=0, logprobs=3,
        stream=True) if c.choices]
    assert [t for p in parts if p for t in p.tokens or []] == lp.tokens
    assert [o for p in parts if p for o in p.text_offset or []] == lp.text_offset
