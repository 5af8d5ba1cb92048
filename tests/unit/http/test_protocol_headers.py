"""Protocol routes carry the cold-start header too (OpenAI embeddings here), no cluster."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
from serve_fakes import FakeHandle, as_handle, pool_of, replica_of

import ember
from ember.edge._asgi import COLD_START_HEADER
from ember.edge.auth import ApiKeys
from ember.edge.ingress import IngressState, build_fastapi
from ember.protocols import OpenAIEmbeddings


@ember.deployment(name="Vectors", warm_floor=0)
class Vectors:
    @ember.route()
    def embed(self, texts: list[str]) -> list[dict[str, Any]]:
        return [{"embedding": [float(len(t)), 0.0], "tokens": len(t)} for t in texts]


APP = ember.App([Vectors], name="proto", warm_pool=1, protocols=[
    OpenAIEmbeddings(deployment="Vectors", attr="embed", model="toy", dimensions=2)])


def _post(state: IngressState) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_fastapi(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await client.post("/v1/embeddings", json={"model": "toy", "input": "abc"})

    return asyncio.run(asyncio.wait_for(go(), 10))


def test_openai_route_at_zero_replicas_carries_the_cold_start_header() -> None:
    own, pool = FakeHandle(replica_of(Vectors)), FakeHandle(pool_of(Vectors))
    options = {s.name: s.options for s in APP.specs}
    state = IngressState(APP.name, list(APP.routes()), options, {"Vectors": as_handle(own)},
                         APP.timeouts(), APP.protocols, as_handle(pool),
                         frozenset(s.name for s in APP.pool_specs()), ApiKeys([]), None)
    state.tracker.pool_running = 1
    state.tracker.loads["Vectors"].running = 0
    cold = _post(state)
    assert cold.status_code == 200, cold.text
    assert cold.json()["data"][0]["embedding"] == [3.0, 0.0]
    assert re.fullmatch(r"total=\d+;path=pool;.*", cold.headers[COLD_START_HEADER])
    assert pool.count("ember_call") == 1

    state.tracker.loads["Vectors"].running = 1  # its own replica is up: a warm request
    warm = _post(state)
    assert warm.status_code == 200 and COLD_START_HEADER not in warm.headers
    assert own.count("ember_call") == 1


def test_a_json_body_without_content_type_is_read_as_json() -> None:
    # Triton's HTTP client sends its JSON without a Content-Type; Triton and KServe read it.
    own = FakeHandle(replica_of(Vectors))
    state = IngressState(APP.name, list(APP.routes()), {s.name: s.options for s in APP.specs},
                         {"Vectors": as_handle(own)}, APP.timeouts(), APP.protocols, None,
                         frozenset(), ApiKeys([]), None)
    state.tracker.loads["Vectors"].running = 1

    async def go(content_type: str | None) -> httpx.Response:
        transport = httpx.ASGITransport(app=build_fastapi(state))
        headers = {} if content_type is None else {"content-type": content_type}
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await client.post("/v1/embeddings", headers=headers,
                                     content=b'{"model": "toy", "input": ["ab"]}')

    for content_type in (None, "", "application/json"):
        reply = asyncio.run(go(content_type))
        assert reply.status_code == 200, (content_type, reply.text)
        assert reply.json()["data"][0]["embedding"] == [2.0, 0.0]
