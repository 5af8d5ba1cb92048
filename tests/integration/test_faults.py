"""Faults survived: a killed replica, a drain on scale-down, a sick replica, a failed start."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

import ember

import fault_apps
from support import deployment_status, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def url(serve_port: int) -> Iterator[str]:
    from ray import serve

    fault_apps.SICK_FLAG.unlink(missing_ok=True)
    fault_apps.STARTED_MARKER.unlink(missing_ok=True)
    base = ember.serve(fault_apps.app, port=serve_port)
    wait_for(lambda: httpx.get(f"{base}/readyz", timeout=5).status_code == 200, 90, what="ready")
    yield base
    serve.delete(fault_apps.app.name)
    fault_apps.SICK_FLAG.unlink(missing_ok=True)


def _burst(url: str, path: str, n: int, seconds: float) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{url}{path}", json={"seconds": seconds})
                                          for _ in range(n)))

    return asyncio.run(run())


def _two_pids(url: str) -> set[int] | None:
    pids = {httpx.get(f"{url}/fragile/pid", timeout=10).json()["pid"] for _ in range(12)}
    return pids if len(pids) == 2 else None


def test_killed_replica_loses_no_request_and_is_replaced(url: str) -> None:
    pids = wait_for(lambda: _two_pids(url), 30, what="2 replicas")
    victim = sorted(pids)[0]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            calls = [asyncio.ensure_future(client.post(f"{url}/fragile", json={"seconds": 1.5}))
                     for _ in range(10)]
            await asyncio.sleep(0.5)  # requests are in flight on both replicas
            os.kill(victim, signal.SIGKILL)
            return await asyncio.gather(*calls)

    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * 10, [r.text for r in replies]
    assert all(r.json()["pid"] != victim for r in replies)
    started = time.monotonic()
    wait_for(lambda: deployment_status(url, "Fragile")["replicas_running"] == 2, 30,
             what="a replacement replica")
    assert time.monotonic() - started < 30


def test_scale_down_drains_in_flight_requests(url: str) -> None:
    assert httpx.post(f"{url}/-/warm/Drainer", params={"for": "120", "floor": 2},
                      timeout=30).status_code == 200
    wait_for(lambda: deployment_status(url, "Drainer")["replicas_running"] == 2, 60,
             what="Drainer at 2")

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            calls = [asyncio.ensure_future(client.post(f"{url}/drain", json={"seconds": 2.0}))
                     for _ in range(10)]
            await asyncio.sleep(0.3)
            # Lease gone, demand is one replica's worth: Ember scales 2 -> 1 mid-flight.
            await client.delete(f"{url}/-/warm/Drainer")
            return await asyncio.gather(*calls)

    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * 10
    assert len({r.json()["pid"] for r in replies}) == 2  # both replicas held requests
    wait_for(lambda: deployment_status(url, "Drainer")["replicas_running"] <= 1, 60,
             what="the scale-down")


def test_sick_replica_is_replaced(url: str) -> None:
    first = httpx.post(f"{url}/sickly", json={}, timeout=30).json()["pid"]
    fault_apps.SICK_FLAG.write_text("sick")
    try:
        # Failed health checks take the replica out of service...
        wait_for(lambda: deployment_status(url, "Sickly")["replicas_running"] == 0, 60,
                 what="the sick replica to be taken out")
    finally:
        fault_apps.SICK_FLAG.unlink(missing_ok=True)
    # ...and a replacement that passes its checks serves again.
    second = wait_for(lambda: _sickly_pid(url), 90, what="a healthy replacement")
    assert second != first


def _sickly_pid(url: str) -> int | None:
    try:
        reply = httpx.post(f"{url}/sickly", json={}, timeout=10)
    except httpx.TimeoutException:
        return None
    return int(reply.json()["pid"]) if reply.status_code == 200 else None


def test_deployment_that_cannot_start_answers_503_not_a_hang(url: str) -> None:
    started = time.monotonic()
    reply = httpx.post(f"{url}/broken", json={}, timeout=120)
    assert reply.status_code == 503, reply.text
    assert time.monotonic() - started < 60
    assert reply.headers.get("retry-after")
    status = deployment_status(url, "Broken")
    assert status["status"] in ("UNHEALTHY", "DEPLOY_FAILED")
    assert status["message"]  # Ray Serve's reason, shown by `ember status --json`


def test_slow_setup_is_not_mistaken_for_a_failed_health_check(url: str) -> None:
    started = time.monotonic()
    reply = httpx.post(f"{url}/slow-setup", json={}, timeout=120)
    assert reply.status_code == 200, reply.text
    assert time.monotonic() - started >= 4  # it waited for setup(), it was not routed early
    assert deployment_status(url, "SlowSetup")["status"] not in ("UNHEALTHY", "DEPLOY_FAILED")


def test_scale_down_removes_a_starting_replica_before_a_serving_one(url: str) -> None:
    serving = httpx.post(f"{url}/order", json={}, timeout=60).json()["pid"]
    assert httpx.post(f"{url}/-/warm/ScaleOrder", params={"for": "60", "floor": 2},
                      timeout=30).status_code == 200
    wait_for(lambda: deployment_status(url, "ScaleOrder")["replicas_starting"] == 1, 30,
             what="a second replica starting")
    assert httpx.delete(f"{url}/-/warm/ScaleOrder", timeout=30).status_code == 200
    wait_for(lambda: deployment_status(url, "ScaleOrder")["replicas_starting"] == 0, 30,
             what="the starting replica to go")
    time.sleep(1)
    status = deployment_status(url, "ScaleOrder")
    assert status["replicas_running"] == 1
    pids = {httpx.post(f"{url}/order", json={}, timeout=30).json()["pid"] for _ in range(5)}
    assert pids == {serving}  # the replica that was serving is the one that stayed
