"""The chaos scenario end to end: replicas, or edges, SIGKILLed under load; budgets met.

Starts its own ``ember run loadtests/chaos_apps.py:app`` (and so its own Ray), so it does
not use the session cluster's fixtures: the scenario kills replica processes by PID, which
must be processes of this server, and it needs the server on this machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support import free_port

ROOT = Path(__file__).resolve().parents[2]
RUN_TIME = {"replica": "30s", "edge": "45s"}
KILL_EVERY_S = {"replica": "10", "edge": "20"}


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else "(no log)"


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_ready(server: subprocess.Popen[bytes], log: Path, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"`ember run` exited with {server.returncode}:\n{_tail(log)}")
        if "Press Ctrl-C" in log.read_text(errors="replace") and _ready(url):
            return
        time.sleep(0.5)
    pytest.fail(f"`ember run` not ready in {timeout_s:g}s:\n{_tail(log)}")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", ["replica", "edge"])
def test_processes_killed_under_load_are_replaced_and_requests_succeed(
        tmp_path: Path, victim: str) -> None:
    # Two kills; each must be back to size within 15 s (the scenario's budgets). A replica
    # kill must leave >= 99% of all requests answered (they are retried on the other); an
    # edge kill drops what its connections carry, so it may fail at most one request per
    # user, and edges are killed every 20 s.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EMBER_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("RAY_ADDRESS", None)  # a local run: never join (and kill in) another cluster
    server_log = tmp_path / "server.log"
    with server_log.open("wb") as log:
        # Own session: if SIGTERM is not enough, the SIGKILL reaches Ray's children too.
        server = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "run", "loadtests/chaos_apps.py:app",
             "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    report = tmp_path / "chaos_budgets.json"
    try:
        _wait_ready(server, server_log, url, 150)
        done = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "loadtests/chaos.py", "--headless", "-H", url,
             "--only-summary", "-u", "6", "-r", "6", "--run-time", RUN_TIME[victim],
             "--kill-every-s", KILL_EVERY_S[victim], "--kill", victim,
             "--ready-timeout-s", "60", "--budget-report", str(report)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
        output = done.stdout[-4000:] + done.stderr[-4000:]
        assert done.returncode == 0, f"{output}\n--- server log ---\n{_tail(server_log)}"
        budgets = json.loads(report.read_text())
        assert budgets["passed"], budgets
        measured = {b["name"]: b["measured"] for b in budgets["budgets"]}
        assert measured[f"{victim} kills"] >= 2, budgets
        assert "[chaos] kill 2 at" in done.stdout, output
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)
    assert server.returncode == 0, _tail(server_log)
