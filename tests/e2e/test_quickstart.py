"""README's Quickstart run line (``make run``), started as a subprocess and talked to."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import psutil
import pytest

from harness import ROOT, EmberRun
from support import wait_for


def _quickstart_run_line() -> str:
    block = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("```", 2)[1]
    return next(line for line in block.splitlines()[1:] if line.strip())


@pytest.mark.slow
def test_quickstart_run_line_serves_the_flagship_and_stops_on_sigterm(tmp_path: Path) -> None:
    run = MakeRun("", tmp_path, argv=_quickstart_run_line().split())
    url = run.url
    try:
        run.wait_ready(300)
        assert "curl" in run.text()
        reply = httpx.post(f"{url}/v1/embeddings", timeout=180,
                           json={"model": "all-MiniLM-L6-v2", "input": ["hello world"]})
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["data"][0]["embedding"]) == 384
        _only_replica_workers_hold_torch(run)
    finally:
        code = run.stop(150)
    assert code == 0, run.tail()
    assert "Shutting down" in run.text()


def _holds_torch(process: psutil.Process) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{process.pid}/maps").read_text()


def _is_light(process: psutil.Process) -> bool:
    return b"_EMBER_LIGHT_WORKER=1" in Path(f"/proc/{process.pid}/environ").read_bytes()


def _only_replica_workers_hold_torch(run: EmberRun) -> None:
    """The warm runtime's imports are in the workers that may become replicas (the idle ones),
    not in the edges (``control/warm_env.py``); the pool and the model's replica, created by
    Serve's controller, are not light (they took idle workers)."""
    def by_role() -> dict[str, list[tuple[bool, bool]]] | None:
        roles: dict[str, list[tuple[bool, bool]]] = {
            "edge": [], "idle": [], "pool": [], "model": []}
        for process in run.record().values():
            name = process.name()
            role = ("edge" if name.endswith(":ember-edge") else
                    "idle" if name == "ray::IDLE" else
                    "pool" if name.endswith(":ember-pool") else
                    "model" if name.endswith(":MiniLM") else None)
            if role is not None:
                roles[role].append((_holds_torch(process), _is_light(process)))
        return roles if all(roles.values()) else None  # each role seen at least once

    roles = wait_for(by_role, 60, what="the edges, the pool, the model and an idle worker")
    assert roles["edge"] == [(False, True)] * 2, roles
    assert (True, False) in roles["idle"], roles
    assert roles["pool"] == roles["model"] == [(True, False)], roles


class MakeRun(EmberRun):
    """``make run``: ember runs as make's child, so stop ember itself, as a supervisor would;
    make then exits with ember's status."""

    def send(self, sig: int = signal.SIGTERM) -> None:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if "ember" in " ".join(child.cmdline()):
                child.send_signal(sig)
