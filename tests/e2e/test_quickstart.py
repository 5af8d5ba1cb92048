"""README's Quickstart run line (``make run``), started as a subprocess and talked to."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest

from support import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]


def _quickstart_run_line() -> str:
    block = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("```", 2)[1]
    return next(line for line in block.splitlines()[1:] if line.strip())


@pytest.mark.slow
def test_quickstart_run_line_serves_the_flagship_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "EMBER_PORT": str(port), "EMBER_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    log_path = tmp_path / "run.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(_quickstart_run_line().split(), cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: "Press Ctrl-C" in log_path.read_text(), 300, what="startup")
        assert "curl" in log_path.read_text()
        reply = httpx.post(f"{url}/v1/embeddings", timeout=180,
                           json={"model": "all-MiniLM-L6-v2", "input": ["hello world"]})
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["data"][0]["embedding"]) == 384
    finally:
        # `make run` runs ember as its child: stop ember itself, as a supervisor would, and
        # make then exits with ember's status.
        for child in psutil.Process(proc.pid).children(recursive=True):
            if "ember" in " ".join(child.cmdline()):
                child.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=150)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert code == 0, log_path.read_text()[-3000:]
    assert "Shutting down" in log_path.read_text()
