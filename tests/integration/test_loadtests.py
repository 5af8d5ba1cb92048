"""The load tests of ``loadtests/``: the short run passes, and a missed budget fails.

The short run is also the chaos test: replicas, then edges, SIGKILLed twice each under load,
replaced within their budgets, with requests succeeding (>= 99% for replica kills, at most one
per user per kill for edge kills).

The short run starts its own ``ember run`` servers (and so its own Ray), so these tests
do not use the session cluster's fixtures. The budget tests run one scenario against a
stand-in for Ember's HTTP API, which answers at once: the budget mechanics are checked
in seconds, without Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("coldstart", "coldstart-own", "steady", "overload", "chaos", "edge-chaos",
             "rollout", "textgen", "coldstart-lm")


@pytest.mark.slow
@pytest.mark.timeout(840)
def test_short_run_passes_and_writes_the_report(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EMBER_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("RAY_ADDRESS", None)  # a local run: never join someone else's cluster
    out = tmp_path / "reports"
    done = subprocess.run([sys.executable, "loadtests/run.py", "--short", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=780)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    index = (out / "index.html").read_text()
    assert index.count("<svg") == 3 * len(SCENARIOS)
    for name in SCENARIOS:
        for suffix in (".html", "_stats.csv", "_stats_history.csv", "_requests.csv"):
            assert (out / f"{name}{suffix}").is_file(), f"{name}{suffix} missing"
        budgets = json.loads((out / f"{name}_budgets.json").read_text())
        assert budgets["passed"], budgets
    # The chaos scenarios killed twice each (two replicas, then two edges) and every kill was
    # recovered within its budget; their logs name each kill.
    for name, victim in (("chaos", "replica"), ("edge-chaos", "edge")):
        budgets = json.loads((out / f"{name}_budgets.json").read_text())
        measured = {b["name"]: b["measured"] for b in budgets["budgets"]}
        assert measured[f"{victim} kills"] >= 2, budgets
        assert "[chaos] kill 2 at" in (out / f"{name}.log").read_text(), name
    samples = (out / "replicas.csv").read_text().splitlines()
    assert len(samples) > 10
    assert any(",MiniLM,0," in row for row in samples)  # seen at zero before the burst


class FakeEmber(BaseHTTPRequestHandler):
    """Ember's status and embedding routes, answered at once with fixed values."""

    running = 1  # replicas MiniLM reports; class-level, set per test
    # Cold starts show in /-/status this long after the first POST (None: never), as an
    # edge's count reaches the edge answering /-/status only when it publishes.
    count_after_s: float | None = None
    first_post: float | None = None

    def do_GET(self) -> None:
        since = None if self.first_post is None else time.monotonic() - self.first_post
        counted = since is not None and self.count_after_s is not None \
            and since >= self.count_after_s
        row = {"deployment": "MiniLM", "replicas_running": self.running,
               "replicas_starting": 0, "ongoing": 0, "queued": 0, "floor": 0,
               "max_replicas": 2, "cold_starts": int(counted), "last_cold_start": None}
        self._send({"app": "fake", "ready": True, "deployments": [row]})

    def do_POST(self) -> None:
        if FakeEmber.first_post is None:
            FakeEmber.first_post = time.monotonic()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        texts = body["input"] if isinstance(body, dict) else body
        rows = [{"embedding": [0.5, 0.5], "tokens": 3} for _ in texts]
        self._send({"data": rows} if isinstance(body, dict) else rows)

    def _send(self, value: Any) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:  # keep pytest's output to the failures
        pass


@pytest.fixture
def fake_ember() -> Iterator[str]:
    FakeEmber.running, FakeEmber.count_after_s, FakeEmber.first_post = 1, None, None
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEmber)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def locust(scenario: str, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "locust", "-f", f"loadtests/{scenario}.py", "--headless",
               "-H", url, "--only-summary", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_missed_budget_fails_the_scenario(fake_ember: str, tmp_path: Path) -> None:
    short = ("-u", "2", "-r", "2", "--run-time", "3s")
    report = tmp_path / "budgets.json"
    missed = locust("steady", fake_ember, *short, "--budget-p95-ms", "0.001",
                    "--budget-report", str(report))
    assert missed.returncode == 1, missed.stdout + missed.stderr
    assert "MISSED p95 latency" in missed.stdout
    budgets = {b["name"]: b["passed"] for b in json.loads(report.read_text())["budgets"]}
    assert budgets == {"p95 latency": False, "p99 latency": True, "failure ratio": True}
    # The same run with the default budgets passes: the failure above is the budget's.
    met = locust("steady", fake_ember, *short)
    assert met.returncode == 0, met.stdout + met.stderr


@pytest.mark.slow
def test_coldstart_fails_clearly_if_the_deployment_never_reaches_zero(fake_ember: str) -> None:
    FakeEmber.running = 1
    done = locust("coldstart", fake_ember, "-u", "2", "--zero-wait-s", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "MiniLM never reached zero replicas in 1s" in done.stdout
    assert "embed [cold]" not in done.stdout  # no burst was sent to a warm deployment


@pytest.mark.slow
def test_coldstart_waits_for_the_count_to_reach_the_answering_edge(fake_ember: str) -> None:
    # Each edge publishes its counts about once a second: a status read right after the burst
    # may not show them yet. The scenario polls for the count (with a deadline) instead.
    FakeEmber.running, FakeEmber.count_after_s = 0, 3.0
    done = locust("coldstart", fake_ember, "-u", "2", "--zero-wait-s", "5",
                  "--warm-requests", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cold starts counted by Ember: 1" in done.stdout
