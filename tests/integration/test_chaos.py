"""The chaos scenario end to end: replicas, or edges, SIGKILLed under load; budgets met.

Starts its own ``ember run loadtests/chaos_apps.py:app`` (and so its own Ray), so it does
not use the session cluster's fixtures: the scenario kills replica processes by PID, which
must be processes of this server, and it needs the server on this machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT, EmberRun

RUN_TIME = {"replica": "30s", "edge": "45s"}
KILL_EVERY_S = {"replica": "10", "edge": "20"}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", ["replica", "edge"])
def test_processes_killed_under_load_are_replaced_and_requests_succeed(
        tmp_path: Path, victim: str) -> None:
    # Two kills; each must be back to size within 15 s (the scenario's budgets). A replica
    # kill must leave >= 99% of all requests answered (they are retried on the other); an
    # edge kill drops what its connections carry, so it may fail at most one request per
    # user, and edges are killed every 20 s.
    server = EmberRun("loadtests/chaos_apps.py:app", tmp_path, log_name="server.log")
    url, env = server.url, server.env
    report = tmp_path / "chaos_budgets.json"
    try:
        server.wait_ready(150, http=True)
        done = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "loadtests/chaos.py", "--headless", "-H", url,
             "--only-summary", "-u", "6", "-r", "6", "--run-time", RUN_TIME[victim],
             "--kill-every-s", KILL_EVERY_S[victim], "--kill", victim,
             "--ready-timeout-s", "60", "--budget-report", str(report)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
        output = done.stdout[-4000:] + done.stderr[-4000:]
        assert done.returncode == 0, f"{output}\n--- server log ---\n{server.tail()}"
        budgets = json.loads(report.read_text())
        assert budgets["passed"], budgets
        measured = {b["name"]: b["measured"] for b in budgets["budgets"]}
        assert measured[f"{victim} kills"] >= 2, budgets
        assert "[chaos] kill 2 at" in done.stdout, output
    finally:
        code = server.stop(60, fail_on_hang=False)
    assert code == 0, server.tail()
