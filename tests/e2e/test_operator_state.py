"""What the operator sets survives ``ember run`` restarting, after SIGTERM and after SIGKILL.

One app with three versions of ``Embed`` (``tests/integration/apps/rollouts.py``), one state
directory, four runs in a row:

1. traffic 80/20, a shadow, a lease; a GET right after each 200 PUT, many times over new
   connections (so over both edges), must show what was just written; and the time from a
   200 to every edge routing by the new weights is measured;
2. after SIGTERM: all of it read back, and about 20% of requests served by version 2;
3. after SIGKILL of ``ember run`` by its PID: the same; then a rollout starts and holds
   its first step;
4. after SIGKILL again: the rollout goes on from that step (``ember status`` says it was
   resumed) and never moves to 100% of either version.

Set ``STATE_RESULTS`` to a file to keep the measured figures as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness import EMBER, ROOT, EmberRun, versions_served
from support import free_port, tail, wait_for

TARGET = "tests/integration/apps/rollouts.py:app"
START_S = 240.0


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    port = free_port()
    # The admin routes (/-/traffic, /-/status, ...) from loopback without a key.
    env = {**os.environ, "EMBER_PORT": str(port), "EMBER_WARM_RUNTIME": "0",
           "EMBER_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1",
           "EMBER_ADMIN_LOOPBACK": "1"}
    env.pop("RAY_ADDRESS", None)  # a local run: never join someone else's cluster
    return env


class Runs:
    """``ember run`` of the test app, again and again, on one state directory."""

    def __init__(self, env: dict[str, str], tmp_path: Path) -> None:
        self.env, self.tmp_path = env, tmp_path
        self.url = f"http://127.0.0.1:{env['EMBER_PORT']}"
        self.state_dir = tmp_path / "state"
        self.current: EmberRun | None = None
        self.count = 0

    def start(self) -> EmberRun:
        self.count += 1
        run = EmberRun(TARGET, self.tmp_path, full_env=self.env, log_name=f"run{self.count}.log",
                       extra_args=["--state-dir", str(self.state_dir)])
        self.current = run
        run.wait_ready(START_S)
        return run

    def stop(self) -> None:
        if self.current is not None and self.current.proc.poll() is None:
            self.current.stop()
        if self.current is not None:
            # Whatever of the cluster outlived ``ember run`` must not hold the port.
            self.current.kill()


@pytest.fixture
def runs(env: dict[str, str], tmp_path: Path) -> Iterator[Runs]:
    runs = Runs(env, tmp_path)
    try:
        yield runs
    finally:
        runs.stop()


def _client() -> httpx.Client:
    # No keep-alive: every request a new connection, which the kernel gives either edge.
    return httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0))


def _put(client: httpx.Client, url: str, path: str, body: Any) -> dict[str, Any]:
    reply = client.put(f"{url}{path}", json=body)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def _get(client: httpx.Client, url: str, path: str) -> dict[str, Any]:
    reply = client.get(f"{url}{path}")
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def _edges_seen(client: httpx.Client, url: str) -> set[int]:
    pids = set()
    for _ in range(20):
        pids.add(int(_get(client, url, "/-/status")["edges"]["pid"]))
    return pids


def _running(client: httpx.Client, url: str, name: str) -> int:
    rows = _get(client, url, "/-/status")["deployments"]
    return int(next(r for r in rows if r["deployment"] == name)["replicas_running"])


def _switch_s(client: httpx.Client, url: str, to: str, weights: dict[str, int]) -> float:
    """Seconds from a PUT's 200 until the last request any edge still sent elsewhere."""
    _put(client, url, "/-/traffic/Embed", weights)
    answered = time.monotonic()
    last_old = 0.0
    while time.monotonic() - answered < 2.5:
        sent = time.monotonic()
        reply = client.post(f"{url}/embed", json={"text": "switch"})
        assert reply.status_code == 200, reply.text
        if reply.headers["X-Ember-Version"] != to:
            last_old = sent - answered
    return last_old


def _read_after_write(client: httpx.Client, url: str, rounds: int) -> int:
    """PUT alternating weights; after each 200, GETs over new connections must show them."""
    reads = 0
    for i in range(rounds):
        weights = {"1": 70 + (i % 2) * 10, "2": 30 - (i % 2) * 10, "3": 0}
        _put(client, url, "/-/traffic/Embed", weights)
        for _ in range(4):
            assert _get(client, url, "/-/traffic/Embed")["weights"] == weights, f"round {i}"
            reads += 1
    return reads


def _status_text(url: str, env: dict[str, str]) -> str:
    done = subprocess.run([str(EMBER), "status", "--url", url], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _settings_are_back(client: httpx.Client, runs: Runs) -> None:
    url = runs.url
    assert _get(client, url, "/-/traffic/Embed")["weights"] == {"1": 80, "2": 20, "3": 0}
    assert _get(client, url, "/-/shadow/Embed")["shadow"] == {"to": "3", "percent": 10}
    # The lease on version 3 (floor 0 in code) holds a replica up in the new cluster.
    wait_for(lambda: _running(client, url, "Embed@3") >= 1, 120, what="the leased replica")
    seen = versions_served(client, url, 400)
    share = seen.get("2", 0) / 400
    assert 0.12 <= share <= 0.28 and "3" not in seen, seen


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_traffic_shadow_lease_and_rollout_survive_sigterm_and_sigkill(
        runs: Runs, env: dict[str, str]) -> None:
    url = runs.url
    figures: dict[str, Any] = {}
    with _client() as client:
        runs.start()
        figures["edges"] = len(_edges_seen(client, url))
        assert figures["edges"] >= 2, "the GETs below must reach both edges"
        # Version 2 warm before it takes traffic: the switch time is the store's, not a start.
        assert client.post(f"{url}/-/warm/Embed@2?for=1800&floor=1").status_code == 200
        wait_for(lambda: _running(client, url, "Embed@2") >= 1, 120, what="version 2 up")
        figures["read_after_write_gets"] = _read_after_write(client, url, 40)
        switches = [_switch_s(client, url, to, w) for to, w in
                    [("2", {"1": 0, "2": 100}), ("1", {"1": 100, "2": 0})] * 4]
        figures["switch_s"] = switches
        assert max(switches) < 1.0, switches
        _put(client, url, "/-/traffic/Embed", {"1": 80, "2": 20})
        _put(client, url, "/-/shadow/Embed", {"to": "3", "percent": 10})
        assert client.post(f"{url}/-/warm/Embed@3?for=1800&floor=1").status_code == 200

        first = runs.current
        assert first is not None and first.stop() == 0, tail(first.log) if first else ""
        runs.start()  # after SIGTERM
        _settings_are_back(client, runs)

        assert runs.current is not None
        runs.current.kill()  # SIGKILL by PID: nothing of the run had a chance to save
        runs.start()
        _settings_are_back(client, runs)

        body = {"to": "2", "steps": [10, 50, 100], "every_s": 3600}
        _put(client, url, "/-/rollout/Embed", body)
        wait_for(lambda: _get(client, url, "/-/rollout/Embed")["phase"] == "holding", 120,
                 what="the rollout's first step")
        assert _get(client, url, "/-/traffic/Embed")["weights"] == {"1": 90, "2": 10, "3": 0}

        assert runs.current is not None
        runs.current.kill()
        runs.start()
        _rollout_went_on(client, runs, env)
    _keep(figures)


def _rollout_went_on(client: httpx.Client, runs: Runs, env: dict[str, str]) -> None:
    url = runs.url
    def resumed() -> str | None:
        text = _status_text(url, env)
        return text if "resumed" in text else None

    text = wait_for(resumed, 60, what="`ember status` to say the rollout was resumed")
    assert "step 1/3 (10%)" in text, text
    rollout = _get(client, url, "/-/rollout/Embed")
    assert (rollout["state"], rollout["step"], rollout["share"]) == ("running", 0, 10)
    assert rollout["resumed"] == 1
    deadline = time.monotonic() + 20
    total: dict[str, int] = {}
    while time.monotonic() < deadline:  # a while of traffic: it never jumps to 100%
        assert _get(client, url, "/-/traffic/Embed")["weights"] == {"1": 90, "2": 10, "3": 0}
        for version, n in versions_served(client, url, 50).items():
            total[version] = total.get(version, 0) + n
    share = total.get("2", 0) / sum(total.values())
    assert 0.03 <= share <= 0.2, total


def _keep(figures: dict[str, Any]) -> None:
    where = os.environ.get("STATE_RESULTS")
    figures = {
        "what": "switch_s: seconds from a 200 PUT of new weights (100/0 <-> 0/100) to the last "
                "request any edge still sent to the old version, requests one after another, "
                "each on a new connection; read_after_write_gets: GETs right after a 200 PUT, "
                "all of which showed the new weights",
        "command": "STATE_RESULTS=bench/results/operator_state.json "
                   "python -m pytest tests/e2e/test_operator_state.py -s",
        "max_switch_s": max(figures["switch_s"]), **figures,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(figures))
    if where:
        Path(where).write_text(json.dumps(figures, indent=2) + "\n")
