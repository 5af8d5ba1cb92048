"""Readiness and the drain at the edge, over HTTP (httpx.ASGITransport); no cluster.

The phase the edge would read from Ray's KV store is set on its gate directly; the app is
``build_fastapi`` as the edge serves it, with fake handles (``serve_fakes``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from serve_fakes import FakeHandle, as_handle, replica_of
from starlette.types import Receive, Scope, Send

import ember
from ember.edge.auth import ApiKeys
from ember.edge.drain import (
    DRAINING,
    SERVING,
    STARTING,
    DrainGate,
    DrainMiddleware,
    drained,
)
from ember.edge.ingress import IngressState, build_fastapi


class Item(BaseModel):
    text: str


@ember.deployment(route="/echo")
class Echo:
    def __call__(self, body: Item) -> dict[str, str]:
        return {"echo": body.text}


APP = ember.App([Echo], name="drain", warm_pool=0)


def _state() -> tuple[IngressState, FakeHandle]:
    handle = FakeHandle(replica_of(Echo))
    options = {spec.name: spec.options.with_env_overrides() for spec in APP.specs}
    state = IngressState(APP.name, list(APP.routes()), options, {"Echo": as_handle(handle)},
                         APP.timeouts(), APP.protocols, None, frozenset(), ApiKeys([]), None)
    state.tracker.polled = True
    state.tracker.loads["Echo"].running = 1
    return state, handle


def _ask(state: IngressState, *requests: tuple[str, str]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_fastapi(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.request(method, path, json={"text": "hi"})
                    if method == "POST" else await client.request(method, path)
                    for method, path in requests]

    return asyncio.run(asyncio.wait_for(go(), 10))


@pytest.mark.parametrize(("phase", "status"), [(STARTING, 503), (SERVING, 200),
                                               (DRAINING, 503)])
def test_readyz_follows_the_serving_process(phase: str, status: int) -> None:
    state, _ = _state()
    state.gate.phase = phase
    readyz, healthz = _ask(state, ("GET", "/readyz"), ("GET", "/healthz"))
    assert (readyz.status_code, readyz.json()) == (status, {"ready": status == 200,
                                                             "phase": phase})
    assert healthz.status_code == 200  # alive all along: a liveness probe never kills a drain


def test_draining_edge_refuses_new_requests_with_retry_after_and_calls_nothing() -> None:
    state, handle = _state()
    state.gate.phase = DRAINING
    (reply,) = _ask(state, ("POST", "/echo"))
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["type"] == "ShuttingDown"
    assert handle.count("ember_call") == 0


def test_serving_edge_answers() -> None:
    state, handle = _state()
    (reply,) = _ask(state, ("POST", "/echo"))
    assert reply.status_code == 200 and reply.json() == {"echo": "hi"}
    assert handle.count("ember_call") == 1
    assert state.gate.in_flight == 0


def test_a_request_in_flight_when_the_drain_starts_finishes_and_is_counted() -> None:
    gate = DrainGate()
    release = asyncio.Event()
    seen: list[int] = []

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    async def go() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=DrainMiddleware(slow, gate=gate))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            first = asyncio.ensure_future(client.get("/work"))
            while gate.in_flight == 0:
                await asyncio.sleep(0.01)
            gate.phase = DRAINING
            late = await client.get("/work")
            seen.append(gate.in_flight)
            release.set()
            return await first, late

    first, late = asyncio.run(asyncio.wait_for(go(), 10))
    assert (first.status_code, first.text) == (200, "done")
    assert late.status_code == 503
    assert seen == [1] and gate.in_flight == 0


@pytest.mark.parametrize(("reports", "edges", "expected"), [
    ({}, 0, True),
    ({}, 2, False),  # no edge has seen the drain yet
    ({"a": {"in_flight": 0}}, 2, False),
    ({"a": {"in_flight": 0}, "b": {"in_flight": 3}}, 2, False),
    ({"a": {"in_flight": 0}, "b": {"in_flight": 0}}, 2, True),
    ({"a": {}}, 1, False),  # a damaged report is not a drained edge
])
def test_drained_needs_every_edge_at_zero(reports: dict[str, Any], edges: int,
                                          expected: bool) -> None:
    assert drained(reports, edges) is expected
