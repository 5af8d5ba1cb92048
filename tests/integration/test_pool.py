"""The warm pool answers at zero replicas while the deployment's own replica starts."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator

import httpx
import pytest

from apps import pool
from harness import metric
from serving import ControllerWatch, ServeApp, read_deployment
from support import deployment_status, every_edge_sees, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(pool.app) as base:
        yield base


#: The pool served it: building the model for the request, or holding it already (warm hit).
POOL_PATHS = {"pool", "pool-warm"}


def _phases(header: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in header.split(";"))


def _ask_at_zero(url: str, deployment: str, path: str, question: str) -> httpx.Response:
    """One request sent while ``deployment`` has no replica at all, as every edge sees it."""
    wait_for(lambda: every_edge_sees(url, deployment, 0), 30, what=f"{deployment} at zero")
    return httpx.post(f"{url}{path}", json={"question": question}, timeout=60)


def test_cold_request_is_served_by_the_pool_then_by_the_own_replica(url: str) -> None:
    first = _ask_at_zero(url, "SlowStart", "/slow-start", "abc")
    assert first.status_code == 200 and first.json()["answer"] == "cba"
    phases = _phases(first.headers["x-ember-cold-start"])
    assert phases["path"] == "pool"
    assert int(phases["weights"]) >= 250  # the pool ran setup() for this request
    assert int(phases["start"]) == 0 and int(phases["import"]) == 0
    # The request also woke the deployment: its own replica comes up and takes over.
    wait_for(lambda: deployment_status(url, "SlowStart")["replicas_running"] == 1, 60,
             what="the deployment's own replica")
    later = wait_for(lambda: _served_by_other(url, first.json()["pid"]), 30,
                     what="traffic to move to the deployment's replica")
    assert "x-ember-cold-start" not in later.headers
    status = deployment_status(url, "SlowStart")
    assert status["last_cold_start"]["path"] == "pool"


def _served_by_other(url: str, pool_pid: int) -> httpx.Response | None:
    reply = httpx.post(f"{url}/slow-start", json={"question": "x"}, timeout=30)
    return reply if reply.json()["pid"] != pool_pid else None


def test_preloaded_deployment_runs_no_setup_on_its_first_request(url: str) -> None:
    reply = _ask_at_zero(url, "Preloaded", "/preloaded", "hi")
    assert reply.json()["answer"] == "HI"
    phases = _phases(reply.headers["x-ember-cold-start"])
    # The pool held the constructed model before the request: a warm hit, labelled so.
    assert phases["path"] == "pool-warm" and phases["weights"] == "0"


def test_cold_start_phases_are_exported(url: str) -> None:
    reply = _ask_at_zero(url, "SlowStart", "/slow-start", "xyz")
    assert _phases(reply.headers["x-ember-cold-start"])["path"] in POOL_PATHS

    def weights_phases() -> float:
        """Pool-path weights phases of SlowStart counted in one scrape, over every edge."""
        return metric(url, "ember_cold_start_phase_seconds_count", deployment="SlowStart",
                      path="pool", phase="weights")

    # The edge that answered publishes its metrics within about a second.
    wait_for(weights_phases, 15, what="the pool's weights phase in a scrape")


def _concurrently(url: str, path: str, n: int, seconds: float) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=90) as client:
            return await asyncio.gather(*(client.post(f"{url}{path}", json={"seconds": seconds})
                                          for _ in range(n)))

    return asyncio.run(run())


def _path(reply: httpx.Response) -> str:
    return _phases(reply.headers.get("x-ember-cold-start", "path=none"))["path"]


def test_a_request_sent_as_the_last_replica_goes_is_served_by_the_pool(url: str) -> None:
    wake = _ask_at_zero(url, "SlowStart", "/slow-start", "wake")
    assert wake.status_code == 200
    wait_for(lambda: read_deployment(pool.app.name, "SlowStart").count("RUNNING") == 1, 60,
             what="SlowStart's own replica")
    # Quiet now: the policy removes the replica after 2 s. Send the moment it goes, while
    # the edges' once-a-second poll may still count it.
    wait_for(lambda: read_deployment(pool.app.name, "SlowStart").count("RUNNING") == 0, 30,
             interval_s=0.02, what="the last replica to go")
    sent = time.monotonic()
    reply = httpx.post(f"{url}/slow-start", json={"question": "race"}, timeout=60)
    waited = time.monotonic() - sent
    assert reply.status_code == 200 and reply.json()["answer"] == "ecar"
    assert _path(reply) in POOL_PATHS, (
        f"answered in {waited:.2f} s without the pool: it waited for a fresh replica")


def test_what_the_pool_serves_counts_in_the_deployments_demand(url: str) -> None:
    n, options = 8, pool.app.spec("Busy").options
    promised = min(math.ceil(n / options.target_queue_depth), options.max_replicas)
    wait_for(lambda: every_edge_sees(url, "Busy", 0), 30, what="Busy at zero")
    with ControllerWatch(pool.app.name, "Busy") as watch:
        replies = _concurrently(url, "/busy", n, seconds=3.0)
    assert [r.status_code for r in replies] == [200] * n
    assert {_path(r) for r in replies} <= POOL_PATHS, "the burst should fit the pool's cap"
    first_running = watch.first("RUNNING")
    before = [s for s in watch.samples if first_running is None or s.at < first_running.at]
    asked = max(s.target for s in before)
    # Without counting them the controller sees one wake-up ping: one replica.
    assert asked == promised == 4, (
        f"while the pool served {n} requests, the controller asked for {asked} replica(s)")


def test_past_the_pools_cap_requests_wait_for_the_own_replica(url: str) -> None:
    wait_for(lambda: every_edge_sees(url, "Capped", 0), 30, what="Capped at zero")
    replies = _concurrently(url, "/capped", 6, seconds=1.0)
    assert [r.status_code for r in replies] == [200] * 6  # held, never lost
    paths = sorted(_path(r) for r in replies)
    pool_served = sum(path in POOL_PATHS for path in paths)
    # One pool replica takes Capped's max_ongoing_requests (2) at once; the others waited.
    assert 1 <= pool_served <= 2, paths
    assert paths.count("replica") == 6 - pool_served, paths


def test_a_failing_preload_marks_its_deployment_and_the_app_stays_ready(url: str) -> None:
    status = httpx.get(f"{url}/-/status", timeout=10).json()
    assert status["ready"] is True
    row = deployment_status(url, "BrokenPreload")
    assert row["pool_failure"] == "warm pool preload failed: OSError: weights not found"
    assert "weights not found" in row["message"]
    # The other preloaded deployment is still served by the pool without a setup.
    reply = _ask_at_zero(url, "Preloaded", "/preloaded", "ok")
    assert reply.status_code == 200 and _path(reply) == "pool-warm"
