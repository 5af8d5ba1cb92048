"""The README run command, started as a subprocess and talked to over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
EMBER = Path(sys.executable).with_name("ember")


@pytest.mark.slow
def test_ember_run_serves_scales_to_zero_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "EMBER_PORT": str(port), "EMBER_SCALEDOWN_AFTER_S": "2",
           "EMBER_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    log = (tmp_path / "run.log").open("w+")
    proc = subprocess.Popen([str(EMBER), "run", "examples/mlp_app.py:app"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: "Press Ctrl-C" in Path(log.name).read_text(), 180, what="startup")
        output = Path(log.name).read_text()
        assert f"{url}" in output and "curl" in output
        reply = httpx.post(f"{url}/mlp", json={"inputs": [[0.5] * 256]}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["outputs"][0]) == 16
        bad = httpx.post(f"{url}/mlp", json={"inputs": [[0.5] * 3]}, timeout=30)
        assert bad.status_code == 422
        oip = httpx.post(f"{url}/v2/models/mlp/infer", timeout=60, json={"inputs": [
            {"name": "INPUT", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}]})
        assert oip.status_code == 200, oip.text
        assert oip.json()["outputs"][0]["data"] == pytest.approx(reply.json()["outputs"][0],
                                                                 rel=1e-5)
        status = subprocess.run([str(EMBER), "status", "--url", url], capture_output=True,
                                text=True, timeout=60, check=True)
        assert "SeedMLP" in status.stdout
        wait_for(lambda: _running(url) == 0, 60, what="scale to zero")
        again = httpx.post(f"{url}/mlp", json={"inputs": [[0.5] * 256]}, timeout=120)
        assert again.json() == reply.json()  # the same weights after a cold start
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert code == 0, Path(log.name).read_text()[-3000:]
    assert "Shutting down" in Path(log.name).read_text()


def _running(url: str) -> int:
    rows = httpx.get(f"{url}/-/status", timeout=10).json()["deployments"]
    return int(rows[0]["replicas_running"]) + int(rows[0]["replicas_starting"])


def test_bad_target_is_a_clear_error() -> None:
    out = subprocess.run([str(EMBER), "run", "examples/mlp_app.py:nothing"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "has no attribute 'nothing'" in out.stderr
    time.sleep(0)  # nothing was started: the command fails before Ray
