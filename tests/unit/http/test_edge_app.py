"""The ingress's FastAPI app over HTTP (httpx.ASGITransport), with fake handles; no cluster.

The app is built as the ingress builds it: ``IngressState`` from an ``ember.App`` as
``runtime.build_application`` passes it, then ``build_fastapi`` (all that
``EmberEdge`` serves), so every middleware runs in its real order.
Only Ray Serve's handles are faked (``serve_fakes``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from ray.serve.exceptions import BackPressureError
from serve_fakes import FakeHandle, as_handle, pool_of, replica_of

import ember
from ember.edge._asgi import COLD_START_HEADER
from ember.edge.auth import ApiKeys
from ember.edge.ingress import IngressState, build_fastapi

KEY = "ek-test-5b8d4f1a6c0e9b2d7f3a9c2e"
LIMIT = 64
ERROR_FIELDS = {"message", "type", "param", "code", "status", "request_id"}
_TEST_DEADLINE_S = 10.0


class Item(BaseModel):
    text: str
    n: int = 1


@ember.deployment(route="/echo", max_request_bytes=LIMIT, max_queue=4)
class Echo:
    def __call__(self, body: Item) -> dict[str, Any]:
        return {"echo": body.text, "n": body.n}


@ember.deployment(route="/broken")
class Broken:
    def __call__(self, body: Item) -> str:
        raise ValueError("shape mismatch")


APP = ember.App([Echo, Broken], name="edge", warm_pool=1)


class Edge:
    """The ingress app and the fake handles behind it."""

    def __init__(self, *, keys: ApiKeys | None = None, warm: bool = True) -> None:
        self.handles = {spec.name: FakeHandle(replica_of(spec.cls)) for spec in APP.specs}
        self.pool = FakeHandle(pool_of(Echo, Broken))
        # The arguments runtime.build_application binds to EmberEdge.
        options = {spec.name: spec.options.with_env_overrides() for spec in APP.specs}
        self.state = IngressState(
            APP.name, list(APP.routes()), options,
            {name: as_handle(h) for name, h in self.handles.items()}, APP.timeouts(),
            APP.protocols, as_handle(self.pool), frozenset(s.name for s in APP.pool_specs()),
            keys if keys is not None else ApiKeys([]), None)
        # What the replica poll would have read (no lifespan runs under ASGITransport).
        for load in self.state.tracker.loads.values():
            load.running = 1 if warm else 0
        self.state.tracker.pool_running = 1
        self.app: FastAPI = build_fastapi(self.state)

    def post(self, path: str = "/echo", **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, **kwargs)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        async def go() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.request(method, path, **kwargs)

        return asyncio.run(asyncio.wait_for(go(), _TEST_DEADLINE_S))

    def calls(self, name: str = "Echo") -> int:
        return self.handles[name].count("ember_call") + self.pool.count("ember_call")


def _error(reply: httpx.Response) -> dict[str, Any]:
    """The error object, checked against Ember's shape and the response's request id."""
    body = reply.json()
    assert list(body) == ["error"]
    error: dict[str, Any] = body["error"]
    assert set(error) >= ERROR_FIELDS
    assert error["code"] == error["status"] == reply.status_code
    assert error["request_id"] == reply.headers["x-request-id"]
    return error


def _json_of_size(size: int) -> bytes:
    """A valid Item body of exactly ``size`` bytes."""
    frame = b'{"text": ""}'
    return frame[:-2] + b"a" * (size - len(frame)) + frame[-2:]


def test_auth_on_refuses_requests_without_a_valid_key() -> None:
    edge = Edge(keys=ApiKeys([KEY]))
    missing = edge.post(json={"text": "hi"})
    wrong = edge.post(json={"text": "hi"}, headers={"Authorization": "Bearer ek-wrong-key-0"})
    assert (missing.status_code, wrong.status_code) == (401, 401)
    assert missing.headers["www-authenticate"] == "Bearer"
    assert _error(missing)["type"] == "Unauthorized"
    assert edge.calls() == 0

    served = edge.post(json={"text": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
    assert served.status_code == 200
    assert served.json() == {"echo": "hi", "n": 1}
    assert edge.calls() == 1


def test_no_body_is_read_before_auth_and_headers_are_checked_first() -> None:
    chunks_read: list[bytes] = []

    async def oversized() -> AsyncIterator[bytes]:
        for chunk in (b'{"text": "', b"a" * 4 * LIMIT, b'"}'):
            chunks_read.append(chunk)
            yield chunk

    edge = Edge(keys=ApiKeys([KEY]))
    gzip = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    # Auth answers before the body limit (413) and the encoding check (415) look at it.
    assert edge.post(content=oversized(), headers=gzip).status_code == 401
    assert chunks_read == []
    # The header limit answers before auth: a huge header block is never parsed for a key.
    filler = [(f"x-filler-{i}", "v" * 1024) for i in range(70)]
    assert edge.post(json={"text": "hi"}, headers=filler).status_code == 431


def test_auth_off_serves_without_a_key() -> None:
    assert Edge().post(json={"text": "hi"}).status_code == 200


def test_body_over_max_request_bytes_is_413() -> None:
    edge = Edge()
    at_limit = edge.post(content=_json_of_size(LIMIT),
                         headers={"Content-Type": "application/json"})
    over = edge.post(content=_json_of_size(LIMIT + 1),
                     headers={"Content-Type": "application/json"})
    assert at_limit.status_code == 200
    assert over.request.headers["content-length"] == str(LIMIT + 1)
    assert over.status_code == 413
    assert _error(over)["message"] == f"request body exceeds {LIMIT} bytes for /echo"
    assert edge.calls() == 1


def test_body_over_max_request_bytes_without_content_length_is_413() -> None:
    chunks_read: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        for index in range(1000):  # 8 KB if read whole; the guard stops after the limit
            chunks_read.append(index)
            yield b'{"text": "' if index == 0 else b"a" * 8

    edge = Edge()
    reply = edge.post(content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in reply.request.headers
    assert reply.status_code == 413
    assert _error(reply)["type"] == "PayloadTooLarge"
    assert len(chunks_read) < 20
    assert edge.calls() == 0


def test_gzip_body_is_415() -> None:
    edge = Edge()
    reply = edge.post(content=b"\x1f\x8b\x08\x00", headers={
        "Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert reply.status_code == 415
    assert reply.headers["accept-encoding"] == "identity"
    assert _error(reply)["type"] == "UnsupportedMediaType"
    assert edge.calls() == 0


def test_wrong_type_is_422_naming_the_field() -> None:
    edge = Edge()
    reply = edge.post(json={"text": "hi", "n": "many"})
    assert reply.status_code == 422
    error = _error(reply)
    assert error["type"] == "InvalidBody"
    assert [f["field"] for f in error["fields"]] == ["body.n"]
    assert error["message"].startswith("invalid body: body.n: ")
    assert edge.calls() == 0


def test_huge_headers_are_431() -> None:
    edge = Edge()
    headers = [(f"x-filler-{i}", "v" * 1024) for i in range(70)]
    reply = edge.post(json={"text": "hi"}, headers=headers)
    assert reply.status_code == 431
    assert _error(reply)["type"] == "HeadersTooLarge"
    assert edge.calls() == 0


@pytest.mark.parametrize(("body", "why"), [
    (b'{"text": "hi", "n": NaN}', "NaN is not a JSON number"),
    (b'{"text": "hi", "text": "admin"}', "duplicate key 'text'"),
    (b'{"text": "hi", "n": 1e999}', "number 1e999 is out of range"),
    (b'{"text": "hi"', "Expecting ',' delimiter"),
], ids=["NaN", "duplicate keys", "1e999", "truncated"])
def test_malformed_or_non_strict_json_is_400(body: bytes, why: str) -> None:
    edge = Edge()
    reply = edge.post(content=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400
    error = _error(reply)
    assert error["type"] == "MalformedJSON"
    assert why in error["message"]
    assert edge.calls() == 0


@pytest.mark.parametrize(("method", "path", "kwargs", "status"), [
    ("POST", "/echo", {"headers": {"Authorization": "Bearer nope"}}, 401),
    ("POST", "/echo", {"content": _json_of_size(LIMIT + 1)}, 413),
    ("GET", "/no-such-route", {}, 404),
    ("POST", "/echo", {"content": b"{"}, 400),
], ids=["401 from auth", "413 from the guard", "404 from routing", "400 from the parser"])
def test_error_shape(method: str, path: str, kwargs: dict[str, Any], status: int) -> None:
    edge = Edge(keys=ApiKeys([KEY]))
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "req-shape-1",
               **kwargs.pop("headers", {})}
    reply = edge.request(method, path, headers=headers, **kwargs)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == ERROR_FIELDS
    assert error == {**error, "code": status, "status": status, "param": None,
                     "request_id": "req-shape-1"}
    assert reply.headers["x-request-id"] == "req-shape-1"
    assert isinstance(error["type"], str) and isinstance(error["message"], str)


def test_user_code_error_is_500_with_the_request_id_in_the_message() -> None:
    edge = Edge()
    reply = edge.post("/broken", json={"text": "hi"})
    assert reply.status_code == 500
    error = _error(reply)
    assert set(error) == ERROR_FIELDS
    assert error["type"] == "UserCodeError"
    request_id = reply.headers["x-request-id"]
    assert error["message"] == f"deployment 'Broken' raised ValueError; request id {request_id}"


def test_full_queue_is_503_with_retry_after() -> None:
    edge = Edge()
    edge.handles["Echo"].refuse = BackPressureError(4, 4)
    load = edge.state.tracker.loads["Echo"]
    with ExitStack() as others:  # 1 replica takes 4 (the derived limit); 8 wait in all
        for _ in range(7):
            others.enter_context(edge.state.tracker.track("Echo"))
        reply = edge.post(json={"text": "hi"})
        assert load.queued == 3
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "1"
    error = _error(reply)
    assert error["message"] == (
        "deployment 'Echo' has 4 queued requests (limit 4); retry shortly")
    assert edge.handles["Echo"].ran == []


def test_cold_start_header_only_on_a_request_that_met_zero_replicas() -> None:
    edge = Edge(warm=False)
    cold = edge.post(json={"text": "first"})
    assert cold.status_code == 200
    assert cold.json() == {"echo": "first", "n": 1}
    assert edge.pool.count("ember_call") == 1
    assert re.fullmatch(r"total=\d+;path=pool;queue=0;start=0;import=0;weights=118;warmup=21",
                        cold.headers[COLD_START_HEADER])

    edge.state.tracker.loads["Echo"].running = 1  # the poll saw Echo's own replica come up
    warm = edge.post(json={"text": "second"})
    assert warm.status_code == 200
    assert COLD_START_HEADER not in warm.headers
    assert (edge.pool.count("ember_call"), edge.handles["Echo"].count("ember_call")) == (1, 1)
