"""A batch handler takes one object as the whole body too, and answers one result."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from serve_fakes import FakeHandle, as_handle, replica_of

import ember
from ember.edge.auth import ApiKeys
from ember.edge.ingress import IngressState, build_fastapi


class Doc(BaseModel):
    text: str


class Size(BaseModel):
    chars: int


@ember.deployment(route="/lengths", batch=ember.Batch(max_size=8, max_wait_ms=1))
class Lengths:
    def __call__(self, texts: list[str]) -> list[int]:
        return [len(t) for t in texts]


@ember.deployment(route="/sizes", batch=ember.Batch(max_size=8, max_wait_ms=1))
class Sizes:
    def __call__(self, docs: list[Doc]) -> list[Size]:
        return [Size(chars=len(d.text)) for d in docs]


@ember.deployment(route="/rows", batch=ember.Batch(max_size=8, max_wait_ms=1))
class Rows:
    def __call__(self, rows: list[list[float]]) -> list[float]:
        return [sum(r) for r in rows]


APP = ember.App([Lengths, Sizes, Rows], name="single", warm_pool=0)


def _edge() -> tuple[IngressState, dict[str, FakeHandle]]:
    fakes = {s.name: FakeHandle(replica_of(s.cls)) for s in APP.specs}
    state = IngressState(APP.name, list(APP.routes()), {s.name: s.options for s in APP.specs},
                         {n: as_handle(f) for n, f in fakes.items()}, APP.timeouts(), (), None,
                         frozenset(), ApiKeys([]), None)
    for load in state.tracker.loads.values():
        load.running = 1
    return state, fakes


def _call(state: IngressState, method: str, path: str, body: Any = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_fastapi(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await client.request(method, path, json=body)

    return asyncio.run(asyncio.wait_for(go(), 10))


@pytest.mark.parametrize(("path", "one", "answer", "many", "answers"), [
    ("/lengths", "abc", 3, ["a", "bb"], [1, 2]),
    ("/sizes", {"text": "abcd"}, {"chars": 4}, [{"text": "a"}, {"text": "bb"}],
     [{"chars": 1}, {"chars": 2}]),
])
def test_one_object_is_one_item_and_an_array_is_several(path: str, one: Any, answer: Any,
                                                         many: Any, answers: Any) -> None:
    state, fakes = _edge()
    reply = _call(state, "POST", path, one)
    assert reply.status_code == 200, reply.text
    assert reply.json() == answer
    name = path.strip("/").capitalize()
    sent = fakes[name].ran[-1].args[-1]  # the replica saw a batch of exactly one item
    assert len(sent) == 1 and (sent[0] == one or sent[0].model_dump() == one)
    reply = _call(state, "POST", path, many)
    assert (reply.status_code, reply.json()) == (200, answers)


def test_an_array_item_type_keeps_the_array_form_only() -> None:
    # list[list[float]]: a bare array would be ambiguous, so only arrays of rows are taken.
    state, _ = _edge()
    assert _call(state, "POST", "/rows", [[1.0, 2.0], [3.0]]).json() == [3.0, 3.0]
    assert _call(state, "POST", "/rows", [1.0, 2.0]).status_code == 422


def test_openapi_shows_both_forms() -> None:
    state, _ = _edge()
    spec = _call(state, "GET", "/openapi.json").json()
    schema = spec["paths"]["/lengths"]["post"]["requestBody"]["content"]["application/json"]
    forms = {s.get("type") for s in schema["schema"]["anyOf"]}
    assert forms == {"array", "string"}
