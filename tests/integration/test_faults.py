"""Faults survived: a killed replica, a drain on scale-down, a sick replica, a failed start."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from apps import faults
from serving import ControllerWatch, ServeApp, cluster_log_lines
from support import deployment_status, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    faults.sick_flag().unlink(missing_ok=True)
    faults.started_marker().unlink(missing_ok=True)
    try:
        with serve_app(faults.app) as base:
            yield base
    finally:
        faults.sick_flag().unlink(missing_ok=True)


def _two_pids(url: str) -> set[int] | None:
    pids = {httpx.get(f"{url}/fragile/pid", timeout=10).json()["pid"] for _ in range(12)}
    return pids if len(pids) == 2 else None


def _journal(directory: Path) -> dict[str, set[int]]:
    """Which replica processes started each tagged request (see ``faults.TaggedWork``)."""
    started: dict[str, set[int]] = {}
    for entry in directory.iterdir():
        tag, pid = entry.name.split("@")
        started.setdefault(tag, set()).add(int(pid))
    return started


def test_killed_replica_loses_no_request_and_is_replaced(url: str, tmp_path: Path) -> None:
    pids = wait_for(lambda: _two_pids(url), 30, what="2 replicas")
    victim = sorted(pids)[0]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            calls = [asyncio.ensure_future(client.post(f"{url}/fragile", json={
                "seconds": 1.5, "tag": str(i), "journal": str(tmp_path)})) for i in range(10)]
            # Kill once the victim has started some of them (its journal says so).
            while not any(victim in pids for pids in _journal(tmp_path).values()):
                await asyncio.sleep(0.02)
            os.kill(victim, signal.SIGKILL)
            return await asyncio.gather(*calls)

    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * 10, [r.text for r in replies]
    started = _journal(tmp_path)
    lost = [i for i in range(10) if victim in started.get(str(i), set())]
    assert lost, f"no request was in flight on the killed replica {victim}: {started}"
    for i in lost:
        # Started on the victim, answered by another replica: it ran a second time there.
        assert replies[i].json()["pid"] != victim
        assert started[str(i)] - {victim}, f"request {i} never started again: {started}"
    # The retry is Ember's: its dispatcher logs one per request that lost its replica.
    lost_ids = {replies[i].headers["x-request-id"] for i in lost}
    wait_for(lambda: lost_ids <= _retried_request_ids(lost_ids), 30,
             what=f"the dispatcher's retry log lines for {sorted(lost_ids)}")
    wait_for(lambda: deployment_status(url, "Fragile")["replicas_running"] == 2, 30,
             what="a replacement replica")


def _retried_request_ids(candidates: set[str]) -> set[str]:
    lines = cluster_log_lines("replica of Fragile lost; retrying once")
    return {rid for rid in candidates if any(f"request {rid}:" in line for line in lines)}


def test_scale_down_drains_in_flight_requests(url: str) -> None:
    assert httpx.post(f"{url}/-/warm/Drainer", params={"for": "120", "floor": 2},
                      timeout=30).status_code == 200
    wait_for(lambda: deployment_status(url, "Drainer")["replicas_running"] == 2, 60,
             what="Drainer at 2")

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            # Long enough that the lease's end (read every second) and Drainer's quiet
            # window (0.5 s) both pass while every request is still running.
            calls = [asyncio.ensure_future(client.post(f"{url}/drain", json={"seconds": 6.0}))
                     for _ in range(10)]
            await asyncio.sleep(0.5)
            # Lease gone, demand is one replica's worth: Ember scales 2 -> 1 mid-flight.
            await client.delete(f"{url}/-/warm/Drainer")
            return await asyncio.gather(*calls)

    with ControllerWatch(faults.app.name, "Drainer", interval_s=0.1) as watch:
        replies = asyncio.run(run())
        wait_for(lambda: watch.samples[-1].count("RUNNING", "STOPPING") == 1, 60,
                 what="the stopping replica of Drainer to be gone")
    assert [r.status_code for r in replies] == [200] * 10, [r.text for r in replies]
    served = [faults.Served.model_validate(r.json()) for r in replies]
    assert len({s.pid for s in served}) == 2  # both replicas held requests
    stopping = watch.first("STOPPING")
    assert stopping is not None, "the controller never showed a replica of Drainer stopping"
    [victim] = stopping.pids("STOPPING")
    # The replica was being removed while requests it had started were still running,
    # and they still came back 200.
    drained = [s for s in served if s.pid == victim and s.started < stopping.at < s.finished]
    assert drained, (f"replica {victim} was seen stopping at {stopping.at:.2f}, after its "
                     f"requests ended: {[(s.started, s.finished) for s in served]}")
    assert victim not in watch.samples[-1].pids("RUNNING", "STOPPING")  # and then gone


def test_sick_replica_is_replaced(url: str) -> None:
    first = httpx.post(f"{url}/sickly", json={}, timeout=30).json()["pid"]
    faults.sick_flag().write_text("sick")
    try:
        # Failed health checks take the replica out of service...
        wait_for(lambda: deployment_status(url, "Sickly")["replicas_running"] == 0, 60,
                 what="the sick replica to be taken out")
    finally:
        faults.sick_flag().unlink(missing_ok=True)
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
    # The caller learns that it failed and the request id, not why: the constructor's
    # exception (file paths, URLs) is for the operator.
    error = reply.json()["error"]
    assert "failed to start" in error["message"] and error["request_id"]
    assert "weights are nowhere" not in reply.text and "FileNotFoundError" not in reply.text
    # Serve keeps retrying the constructor, so between failures the deployment reads
    # UPSCALING again: wait for a failed state, whose message names the cause.
    def failed() -> dict[str, Any] | None:
        status: dict[str, Any] = deployment_status(url, "Broken")
        return status if status["status"] in ("UNHEALTHY", "DEPLOY_FAILED") else None

    status = wait_for(failed, 60, what="Broken reported as failed")
    assert "weights are nowhere" in status["message"]  # shown by `ember status --json`


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
    wait_for(lambda: (s := deployment_status(url, "ScaleOrder"))["replicas_starting"] == 0
             and s["replicas_running"] == 1, 30, what="the starting replica to go")
    pids = {httpx.post(f"{url}/order", json={}, timeout=30).json()["pid"] for _ in range(5)}
    assert pids == {serving}  # the replica that was serving is the one that stayed
