"""``ember run`` under a supervisor that signals it whenever it likes.

Each test starts the real command (``tests/e2e/sleeper_app.py``: requests that take as long as
they ask) and signals it by PID: during start-up, right after ``/readyz`` turns 200 with
requests in flight, a second time during the drain, and SIGKILL. A clean stop exits 0 and
prints no stack; nothing the run started outlives it.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from harness import EmberRun, ready
from support import wait_for

TARGET = "tests/e2e/sleeper_app.py:app"
IN_FLIGHT = 16


def _start(tmp_path: Path, **env: str) -> tuple[EmberRun, str]:
    run = EmberRun(TARGET, tmp_path, env=env)
    return run, run.url


async def _sleep_calls(client: httpx.AsyncClient, url: str, seconds: float,
                       count: int) -> list[asyncio.Future[httpx.Response]]:
    """``count`` requests of ``seconds`` each, sent now; returns once all are in flight."""
    calls: list[asyncio.Future[httpx.Response]] = [
        asyncio.ensure_future(client.post(f"{url}/sleep", json={"seconds": seconds}))
        for _ in range(count)]
    await asyncio.sleep(1.0)  # connected and at the replica: the requests are in flight
    return calls


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_during_startup_stops_cleanly_and_never_was_ready(tmp_path: Path) -> None:
    run, url = _start(tmp_path)
    try:
        # Ray's processes are up (the cluster is starting or deploying), Ember is not ready.
        wait_for(lambda: len(run.record()) >= 4, 240, what="Ray's processes to start")
        assert not ready(url)
        run.send(signal.SIGTERM)
        code = run.wait()
    finally:
        if run.proc.poll() is None:
            run.kill_session()
    assert code == 0, run.text()[-3000:]
    assert "Press Ctrl-C" not in run.text()  # it never said it was serving
    run.assert_no_stack()
    run.assert_nothing_left()


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_right_after_ready_drains_requests_in_flight(tmp_path: Path,
                                                             sig: signal.Signals) -> None:
    run, url = _start(tmp_path)
    try:
        wait_for(lambda: ready(url) or run.proc.poll() is not None, 300, interval_s=0.1,
                 what="/readyz 200")
        assert run.proc.poll() is None, run.text()[-3000:]
        # Ready means fully up: the command already said so (its handlers are in place).
        assert "Press Ctrl-C" in run.text()

        async def scenario() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                calls = await _sleep_calls(client, url, 4.0, IN_FLIGHT)
                run.send(sig)
                # The edges see the drain within a fraction of a second.
                deadline = time.monotonic() + 5
                readyz = await client.get(f"{url}/readyz")
                while readyz.status_code == 200 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    readyz = await client.get(f"{url}/readyz")
                late = await client.post(f"{url}/sleep", json={"seconds": 0})
                return list(await asyncio.gather(*calls)), readyz, late

        answers, readyz, late = asyncio.run(scenario())
        code = run.wait()
    finally:
        if run.proc.poll() is None:
            run.kill_session()
    assert [r.status_code for r in answers] == [200] * IN_FLIGHT, [r.text for r in answers]
    assert readyz.status_code == 503 and readyz.json()["phase"] == "draining"
    assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
    assert late.json()["error"]["type"] == "ShuttingDown"
    assert code == 0, run.text()[-3000:]
    run.assert_no_stack()
    run.assert_nothing_left()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_second_signal_stops_at_once_and_leaves_nothing(tmp_path: Path) -> None:
    run, url = _start(tmp_path, EMBER_WARM_RUNTIME="0")
    try:
        run.wait_ready(300)

        async def scenario() -> float:
            async with httpx.AsyncClient(timeout=120) as client:
                calls = await _sleep_calls(client, url, 50.0, 4)  # longer than the test waits
                run.send(signal.SIGTERM)
                await asyncio.sleep(1.0)
                run.send(signal.SIGINT)
                started = time.monotonic()
                await asyncio.to_thread(run.wait, 60)
                await asyncio.gather(*calls, return_exceptions=True)  # cut off, as they must be
                return time.monotonic() - started

        stopped_in_s = asyncio.run(scenario())
    finally:
        if run.proc.poll() is None:
            run.kill_session()
    assert run.proc.returncode == 4, run.text()[-3000:]
    assert stopped_in_s < 30, stopped_in_s  # not the 50 s the requests would have taken
    assert "SIGINT again: stopping now" in run.text()
    run.assert_no_stack()
    run.assert_nothing_left()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigkill_leaves_no_process_of_the_run(tmp_path: Path) -> None:
    run, url = _start(tmp_path, EMBER_WARM_RUNTIME="0")
    try:
        run.wait_ready(300)
        assert httpx.post(f"{url}/sleep", json={"seconds": 0}, timeout=60).status_code == 200
        time.sleep(1.5)  # the watchdog records a still tree every second
        run.send(signal.SIGKILL)
        run.wait(30)
        run.assert_nothing_left(30)
    finally:
        run.kill_session()
