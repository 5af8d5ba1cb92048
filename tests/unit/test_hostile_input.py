"""Hostile input: the strict JSON parser, compressed bodies and oversized headers."""

from __future__ import annotations

import asyncio
import gzip
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse
from starlette.types import Message, Scope

from ember.edge._strict_json import (
    ContentEncodingMiddleware,
    HeaderLimitMiddleware,
    HeadersTooLarge,
    JSONTooDeep,
    UnsupportedMediaType,
    content_encoding,
    nesting_depth,
    parse_json,
)
from ember.errors import ConfigError, MalformedJSON

DEEP = 100_000
MiB = 1 << 20

HOSTILE: dict[str, bytes] = {
    "100k nested arrays": b"[" * DEEP + b"]" * DEEP,
    "100k nested objects": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "100k unclosed brackets": b"[" * DEEP,
    "1 MiB of brackets": b"[" * MiB,
    "deep under a key": b'{"x": ' + b"[" * 65 + b"]" * 65 + b"}",
    "1e999": b'{"x": 1e999}',
    "-1e999": b"[-1e999]",
    "NaN": b'{"x": NaN}',
    "Infinity": b"[Infinity]",
    "-Infinity": b"[-Infinity]",
    "duplicate keys": b'{"role": "user", "role": "admin"}',
    "nested duplicate keys": b'[{"a": {"b": 1, "b": 1}}]',
    "invalid UTF-8": b'{"x": "\xff\xfe"}',
    "overlong UTF-8 slash": b'"\xc0\xaf"',
    "raw surrogate in UTF-8": b'"\xed\xa0\x80"',
    "unpaired surrogate escape": b'{"x": "\\ud800"}',
    "unpaired surrogate key": b'{"\\udfff": 1}',
    "UTF-8 BOM": b'\xef\xbb\xbf{"x": 1}',
    "5000-digit integer": b"1" * 5000,
    "empty body": b"",
    "trailing garbage": b'{"x": 1} {"y": 2}',
    "single quotes": b"{'x': 1}",
    "unterminated string of escaped quotes": b'"' + b'\\"' * (MiB // 2),
    "1 MiB of lone quotes and backslashes": b'"\\' * (MiB // 2),
}


@pytest.mark.parametrize("body", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_json_is_refused_fast(body: bytes) -> None:
    started = time.perf_counter()
    with pytest.raises(MalformedJSON) as info:
        parse_json(body)
    assert time.perf_counter() - started < 1.0
    assert info.value.status_code == 400
    assert str(info.value).startswith("malformed JSON: ")
    assert len(str(info.value)) < 200  # the caller's input is not echoed back whole


def test_messages_say_what_is_wrong() -> None:
    cases = {
        b"[" * 65 + b"]" * 65: "nesting deeper than 64 levels",
        b"[1e999]": "number 1e999 is out of range",
        b"[NaN]": "NaN is not a JSON number",
        b'{"a": 1, "a": 2}': "duplicate key 'a'",
        b'"\xff"': "not valid UTF-8 (byte 1)",
        b'"\\ud800"': "unpaired surrogate",
        b'{"x": }': "Expecting value at line 1 column 7",
        b"1" * 5000: "too long",
    }
    for body, phrase in cases.items():
        with pytest.raises(MalformedJSON, match=phrase.replace("(", r"\(").replace(")", r"\)")):
            parse_json(body)


def test_depth_is_checked_before_parsing() -> None:
    with pytest.raises(JSONTooDeep) as info:
        parse_json(b"[" * DEEP + b"]" * DEEP)
    assert isinstance(info.value, MalformedJSON) and info.value.fields["max_depth"] == 64
    assert parse_json(b"[" * 64 + b"]" * 64) == _nested(64)
    with pytest.raises(JSONTooDeep):
        parse_json(b"[" * 65 + b"]" * 65)
    assert parse_json(b"[[[1]]]", max_depth=3) == [[[1]]]
    with pytest.raises(JSONTooDeep, match="deeper than 2 levels"):
        parse_json(b"[[[1]]]", max_depth=2)
    with pytest.raises(ConfigError):
        parse_json(b"1", max_depth=0)


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_brackets_inside_strings_do_not_count() -> None:
    text = '["' + "[" * 1000 + '", {"k\\"[[[": "\\\\"}, "{{{"]'
    assert nesting_depth(text) == 2
    assert parse_json(text.encode())[2] == "{{{"


def test_ordinary_json_is_accepted() -> None:
    body = '{"text": "héllo 😀 \\ud83d\\ude00", "n": [1, -2, 3.5, 1e308, 1e-999], "ok": true}'
    value = parse_json(body.encode())
    assert value["text"] == "héllo 😀 😀"
    assert value["n"] == [1, -2, 3.5, 1e308, 0.0]
    assert parse_json(b" null ") is None
    assert parse_json(b'"[["') == "[["
    assert parse_json(b"1" * 4000) == int("1" * 4000)


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/embed")
    async def embed(request: Request) -> JSONResponse:
        return JSONResponse({"n": len(await request.body())})

    app.add_middleware(ContentEncodingMiddleware)
    app.add_middleware(HeaderLimitMiddleware)
    return app


async def _post(content: bytes = b"{}", headers: Any = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()),
                                 base_url="http://test") as client:
        return await client.post("/embed", content=content, headers=headers)


def test_gzip_body_is_refused_with_415_and_never_inflated() -> None:
    bomb = gzip.compress(b"\0" * (64 * MiB))  # 64 MiB of zeros in about 64 KiB
    # Warm up: the first error reply pays once for importing Ray's request context.
    asyncio.run(_post(b"", {"Content-Encoding": "gzip"}))
    started = time.perf_counter()
    reply = asyncio.run(_post(bomb, {"Content-Encoding": "gzip"}))
    assert time.perf_counter() - started < 1.0
    assert reply.status_code == 415
    assert reply.headers["accept-encoding"] == "identity"
    error = reply.json()["error"]
    assert error["type"] == "UnsupportedMediaType" and error["status"] == 415
    assert "'gzip'" in error["message"] and error["request_id"]


@pytest.mark.parametrize(("encoding", "status"), [
    ("identity", 200), ("IDENTITY", 200), ("", 200), ("gzip", 415), ("GZip", 415),
    ("deflate", 415), ("br", 415), ("zstd", 415), ("identity, gzip", 415), ("x" * 5000, 415),
])
def test_only_identity_passes(encoding: str, status: int) -> None:
    reply = asyncio.run(_post(b'{"a": 1}', {"Content-Encoding": encoding}))
    assert reply.status_code == status
    assert len(reply.content) < 1000


def test_compressed_body_is_not_read() -> None:
    read: list[Message] = []
    sent: list[Message] = []

    async def receive() -> Message:
        message = {"type": "http.request", "body": b"\x1f\x8b", "more_body": True}
        read.append(message)
        return message

    async def send(message: Message) -> None:
        sent.append(message)

    async def never(scope: Scope, receive: Any, send: Any) -> None:
        raise AssertionError("the app must not run")

    scope: Scope = {"type": "http", "method": "POST", "path": "/embed",
                    "headers": [(b"content-encoding", b"gzip")]}
    asyncio.run(ContentEncodingMiddleware(never)(scope, receive, send))
    assert sent[0]["status"] == 415 and read == []


def test_content_encoding_parsing() -> None:
    def scope(*values: bytes) -> Scope:
        return {"headers": [(b"content-encoding", v) for v in values]}

    assert content_encoding(scope()) is None
    assert content_encoding(scope(b"identity", b" Identity ")) is None
    assert content_encoding(scope(b"identity", b"gzip")) == "identity, gzip"


def test_70_kib_of_headers_is_431() -> None:
    headers = [(f"x-filler-{i}", "v" * 1024) for i in range(70)]
    reply = asyncio.run(_post(headers=headers))
    assert reply.status_code == 431
    error = reply.json()["error"]
    assert error["type"] == "HeadersTooLarge" and error["status"] == 431
    assert "limit of 65536 bytes" in error["message"]


def test_many_tiny_headers_count_too_and_normal_headers_pass() -> None:
    tiny = [("x", "") for _ in range(70 * 1024 // 5)]
    assert asyncio.run(_post(headers=tiny)).status_code == 431
    assert asyncio.run(_post(headers={"x-big": "v" * (60 * 1024)})).status_code == 200
    assert asyncio.run(_post(headers={"x-small": "1"})).status_code == 200


def test_error_classes() -> None:
    assert UnsupportedMediaType(encoding="'br'").status_code == 415
    assert HeadersTooLarge(size=2, limit=1).status_code == 431
    assert JSONTooDeep(max_depth=3).status_code == 400
    with pytest.raises(ConfigError):
        HeaderLimitMiddleware(_app(), max_header_bytes=0)
