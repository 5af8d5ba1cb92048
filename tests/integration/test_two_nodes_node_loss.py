"""Losing a node under load, on two Ray nodes on this machine (see ``test_two_nodes.py``).

A module of its own, so that it has a cluster of its own: the test leaves node-b dead.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_two_nodes import _get, cluster, placed, stores  # noqa: F401 (fixtures)

import ember

from apps.two_nodes import survivor_app
from support import free_port, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_a_lost_node_fails_under_1pc_of_requests_and_its_replicas_come_back(
    cluster: Any, tmp_path: Path,  # noqa: F811 (the fixture imported above)
) -> None:
    """Kill node-b's raylet under Locust load: node-a's edge and replicas carry on (the
    scenario's budget: at most 1% of requests fail), and the lost replica is started again
    on node-a within 60 s."""
    url = ember.serve(survivor_app, port=free_port())
    wait_for(lambda: _get(f"{url}/readyz") == 200, 60, what="the survivor app")
    wait_for(lambda: placed("Where", survivor_app.name) == ["node-a", "node-b"], 60,
             what="a replica on each node")
    [node_b] = cluster.worker_nodes
    raylet = node_b.all_processes["raylet"][0].process.pid
    report = tmp_path / "nodeloss_budgets.json"
    command = [sys.executable, "-m", "locust", "-f", "loadtests/nodeloss.py", "--headless",
               "-H", url, "-u", "4", "-r", "4", "--path", "/where", "--kill-pid", str(raylet),
               "--kill-after-s", "10", "--run-time", "45s", "--only-summary",
               "--budget-report", str(report)]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as locust:
        wait_for(lambda: not _alive(raylet), 40, what="node-b's raylet killed under load")
        killed = time.monotonic()
        wait_for(lambda: placed("Where", survivor_app.name) == ["node-a", "node-a"], 60,
                 what="the lost replica back on node-a")
        back_s = time.monotonic() - killed
        output, _ = locust.communicate(timeout=120)
    budgets = json.loads(report.read_text())
    print(f"node lost: {budgets['budgets']}, replica back on node-a in {back_s:.1f} s")
    assert locust.returncode == 0 and budgets["passed"], output[-3000:]
    assert back_s < 60


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a killed child of this process lingers as a zombie)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
