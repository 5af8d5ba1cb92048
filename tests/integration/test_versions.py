"""Versions of one deployment on a live cluster: the split, pins, sessions, bad specs."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from apps import versions
from harness import metric
from serving import ServeApp
from support import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(versions.app) as base:
        yield base


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


def test_a_body_that_is_not_json_is_refused_with_400(url: str) -> None:
    reply = httpx.put(f"{url}/-/traffic/Embed", content=b"{1: 90", timeout=10,
                      headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "MalformedJSON"


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


_scraped = metric


def test_shadowed_requests_are_compared_on_the_candidate_and_callers_see_stable(
    url: str,
) -> None:
    assert _set(url, {"1": 100}).status_code == 200
    wait_for(lambda: _every_edge_has(url, 0), 15, what="every edge back on stable")
    for bad, param in (({"to": "9", "percent": 20}, "to"), ({"to": "2", "percent": 150},
                                                             "percent")):
        reply = httpx.put(f"{url}/-/shadow/Embed", json=bad, timeout=10)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    reply = httpx.put(f"{url}/-/shadow/Embed", json={"to": "2", "percent": 100}, timeout=10)
    assert reply.status_code == 200
    wait_for(lambda: all(httpx.get(f"{url}/-/shadow/Embed", timeout=10).json()["shadow"]
                         ["percent"] == 100 for _ in range(10)), 15, what="every edge shadowing")
    before = _scraped(url, "ember_shadow_distance_count", deployment="Embed@2")
    before_sum = _scraped(url, "ember_shadow_distance_sum", deployment="Embed@2")
    for i in range(30):
        reply = httpx.post(f"{url}/score", json={"text": str(i)}, timeout=30)
        assert reply.status_code == 200 and reply.json() == [1.0, 0.0]
        assert reply.headers["x-ember-version"] == "1"
    # Every copy ran on version 2, answered 200 like the caller's, and was exactly 1.0 away.
    wait_for(lambda: _scraped(url, "ember_shadow_distance_count",
                              deployment="Embed@2") - before == 30, 15,
             what="30 shadow comparisons in the metrics")
    # The sum is its own scrape, possibly from the other edge, whose view of this edge's
    # counters is up to a publication (1 s) old: wait for it as for the count.
    wait_for(lambda: _scraped(url, "ember_shadow_distance_sum",
                              deployment="Embed@2") - before_sum == 30.0, 15,
             what="the 30 comparisons' distances (1.0 each) in the metrics")
    assert _scraped(url, "ember_shadow_requests_total", deployment="Embed@2", version="2",
                    outcome="status_differs") == 0
    httpx.put(f"{url}/-/shadow/Embed", json={"percent": 0}, timeout=10)


def test_the_cli_sets_and_reads_the_split_and_the_shadow(
    url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    from ember.cli import main

    assert main(["traffic", "Embed", "1=80", "2=20", "--url", url]) == 0
    # The other edge takes the change within a second; the read may reach either.
    wait_for(lambda: _every_edge_has(url, 20), 15, what="every edge on the new weights")
    assert main(["traffic", "Embed", "--url", url]) == 0
    assert main(["traffic", "Embed", "1=80", "2=21", "--url", url]) == 1  # refused: 101
    assert main(["shadow", "Embed", "--to", "2", "--percent", "5", "--url", url]) == 0
    assert main(["shadow", "Embed", "--off", "--url", url]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == ["Embed: v1 80%, v2 20%", "Embed: v1 80%, v2 20%",
                                    "Embed: 5% copied to v2", "Embed: no shadow traffic"]
    assert "add up to 101, not 100" in out.err
    assert _set(url, {"1": 100}).status_code == 200
    # The lease command shares the CLI's admin call: a version is a deployment to warm.
    assert main(["warm", "Embed@2", "--for", "60", "--url", url]) == 0
    assert main(["warm", "Embed@2", "--off", "--url", url]) == 0
    assert main(["warm", "Nope", "--url", url]) == 1
    warmed = capsys.readouterr().out.splitlines()
    assert warmed[0].startswith("Embed@2: floor 1 until ") and warmed[1] == (
        "Embed@2: lease ended")
