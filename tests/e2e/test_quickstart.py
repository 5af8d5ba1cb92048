"""README's Quickstart run line (``make run``), started as a subprocess and talked to."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import psutil
import pytest

from harness import ROOT, EmberRun


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
    finally:
        code = run.stop(150)
    assert code == 0, run.tail()
    assert "Shutting down" in run.text()


class MakeRun(EmberRun):
    """``make run``: ember runs as make's child, so stop ember itself, as a supervisor would;
    make then exits with ember's status."""

    def send(self, sig: int = signal.SIGTERM) -> None:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if "ember" in " ".join(child.cmdline()):
                child.send_signal(sig)
