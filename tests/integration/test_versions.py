"""Versions of one deployment on a live cluster: the split, pins, sessions, bad specs."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from apps import versions
from serving import ServeApp
from support import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(versions.app) as base:
        yield base
        httpx.put(f"{base}/-/traffic/Embed", json={"1": 100}, timeout=10)


def _set(url: str, weights: dict[str, int]) -> httpx.Response:
    return httpx.put(f"{url}/-/traffic/Embed", json=weights, timeout=10)


def _every_edge_has(url: str, weight_of_2: int) -> bool:
    """Ten status reads in a row (spread over the edges) show version 2 at ``weight_of_2``."""
    for _ in range(10):
        rows = httpx.get(f"{url}/-/status", timeout=10).json()["deployments"]
        if next(r["weight"] for r in rows if r["deployment"] == "Embed@2") != weight_of_2:
            return False
    return True


def _versions_served(url: str, n: int, headers: dict[str, str] | None = None) -> Counter[str]:
    async def run() -> Counter[str]:
        limit = asyncio.Semaphore(32)

        async def one(client: httpx.AsyncClient, i: int) -> str:
            async with limit:
                reply = await client.post(f"{url}/embed", json={"text": str(i)},
                                          headers=headers)
            assert reply.status_code == 200
            assert reply.headers["x-ember-version"] == reply.json()["version"]
            return str(reply.json()["version"])

        async with httpx.AsyncClient(timeout=60) as client:
            return Counter(await asyncio.gather(*(one(client, i) for i in range(n))))

    return asyncio.run(run())


def test_the_first_version_listed_takes_all_traffic_until_told_otherwise(url: str) -> None:
    assert _versions_served(url, 50) == Counter({"1": 50})


@pytest.mark.parametrize(("weights", "param"), [
    ({"1": 90, "2": 5}, "body"), ({"1": 90, "3": 10}, "3"), ({"1": 110, "2": -10}, "2")])
def test_bad_weights_are_refused_and_change_nothing(url: str, weights: dict[str, int],
                                                    param: str) -> None:
    reply = _set(url, weights)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    assert httpx.get(f"{url}/-/traffic/Embed", timeout=10).json()["weights"] == {
        "1": 100, "2": 0}


def test_a_90_10_split_holds_within_3_points_over_2000_requests(url: str) -> None:
    assert _set(url, {"1": 90, "2": 10}).status_code == 200
    wait_for(lambda: _every_edge_has(url, 10), 15, what="every edge on the new weights")
    served = _versions_served(url, 2000)
    assert abs(served["2"] / 2000 - 0.10) <= 0.03, served


def test_a_pin_and_a_session_keep_their_version(url: str) -> None:
    assert _set(url, {"1": 50, "2": 50}).status_code == 200
    wait_for(lambda: _every_edge_has(url, 50), 15, what="every edge on the new weights")
    assert _versions_served(url, 40, {"X-Ember-Version": "2"}) == Counter({"2": 40})
    for session in ("alice", "bob", "carol", "dave"):
        assert len(_versions_served(url, 20, {"X-Ember-Session": session})) == 1
    unknown = httpx.post(f"{url}/embed", json={"text": "x"}, headers={"X-Ember-Version": "9"},
                         timeout=10)
    assert unknown.status_code == 400 and "has versions 1, 2" in unknown.text
