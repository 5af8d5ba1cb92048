"""The README run command, started as a subprocess and talked to over HTTP."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from harness import EMBER, ROOT, ControllerLog, EmberRun, session_dir_of
from support import deployment_status, every_edge_sees, free_port, wait_for, wait_for_scale_down


@pytest.mark.slow
def test_ember_run_serves_scales_to_zero_and_stops_on_sigterm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = EmberRun("examples/mlp_app.py:app", tmp_path, env={"EMBER_SCALEDOWN_AFTER_S": "2"})
    url = run.url
    try:
        run.wait_ready(180)
        output = run.text()
        assert f"{url}" in output and "curl" in output
        # No --dashboard-port: no dashboard listens, so the banner names none (nor the
        # `serve status` line, which needs one), though Ray records an address for it.
        assert "RAY_ADDRESS=" in output and "ray status" in output, output
        assert "dashboard:" not in output and "serve status" not in output, output
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
        # No admin key was set: `ember run` made one, and `ember status` finds it.
        assert "Admin key" in output
        assert httpx.get(f"{url}/-/status", timeout=30).status_code == 401  # no admin key
        status = subprocess.run([str(EMBER), "status", "--url", url], capture_output=True,
                                text=True, timeout=60, check=True, env=run.env)
        assert "SeedMLP" in status.stdout
        assert "serve status" not in status.stdout and "dashboard: http" not in status.stdout
        key = (tmp_path / "cache" / "admin-key").read_text().strip()
        monkeypatch.setenv("EMBER_ADMIN_KEY", key)  # for the status polls below
        # See SeedMLP's own replica (a request at zero is served by the warm pool and starts
        # one), then see it gone: EMBER_SCALEDOWN_AFTER_S=2 takes it back to zero.
        wait_for_scale_down(url, "SeedMLP", to=0, timeout_s=90, wake=lambda: httpx.post(
            f"{url}/mlp", json={"inputs": [[0.5] * 256]}, timeout=120).raise_for_status())
        again = httpx.post(f"{url}/mlp", json={"inputs": [[0.5] * 256]}, timeout=120)
        assert "x-ember-cold-start" in again.headers  # it met zero replicas
        assert again.json() == reply.json()  # the same weights after a cold start
    finally:
        code = run.stop()
    assert code == 0, run.tail()
    assert "Shutting down" in run.text()


@pytest.mark.slow
def test_a_second_shell_reaches_the_embedded_cluster_with_the_line_ember_status_prints(
        tmp_path: Path) -> None:
    # No warm runtime or pool: this is about finding the cluster, not cold starts.
    dashboard = free_port()
    with EmberRun("examples/mlp_app.py:app", tmp_path,
                  extra_args=["--dashboard-port", str(dashboard)],
                  env={"EMBER_WARM_RUNTIME": "0", "EMBER_ADMIN_LOOPBACK": "1"}) as run:
        run.wait_ready(180)
        url, proc = run.url, run.proc
        status = subprocess.run([str(EMBER), "status", "--url", url], capture_output=True,
                                text=True, timeout=60, check=True, env=run.env).stdout
        gcs = re.search(r"Ray cluster \(GCS\): (127\.0\.0\.1:\d+)", status)
        assert gcs, status
        assert f"RAY_ADDRESS={gcs[1]} " in run.text()  # `ember run` printed it too
        lines = [line.strip() for line in status.splitlines()]
        ray_line = next(line for line in lines if line.endswith(" ray status"))
        serve_line = next(line for line in lines if line.endswith(" serve status"))
        # A second shell: a clean environment, the venv's CLIs on PATH, another directory.
        shell = {"PATH": f"{EMBER.parent}{os.pathsep}/usr/bin:/bin", "HOME": os.environ["HOME"]}
        ray_status = _shell(ray_line, shell, tmp_path)
        assert "Active:" in ray_status and "CPU" in ray_status, ray_status
        # The node `ember run` started, by its id, is the one `ray status` sees.
        node = _session_raylet_node_id(proc.pid)
        assert node in ray_status, ray_status
        serve_status = _shell(serve_line, shell, tmp_path)
        assert re.search(r"^  mlp:$", serve_status, re.MULTILINE), serve_status
        assert "SeedMLP" in serve_status and "HEALTHY" in serve_status, serve_status
        assert f"http://127.0.0.1:{dashboard}" in status


def _shell(line: str, env: dict[str, str], cwd: Path) -> str:
    out = subprocess.run(["bash", "-c", line], env=env, cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _session_raylet_node_id(session_id: int) -> str:
    """The node id of the raylet the command started."""
    for process in _session_members(session_id):
        with contextlib.suppress(psutil.Error):
            if process.name() == "raylet":
                flag = next(a for a in process.cmdline() if a.startswith("--node_id="))
                return str(flag.split("=", 1)[1])
    raise AssertionError("no raylet in the command's session")


def test_bad_target_is_a_clear_error(tmp_path: Path) -> None:
    ray_tmp = tmp_path / "ray"  # where a local Ray would write its session, if one started
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([str(EMBER), "run", "examples/mlp_app.py:nothing"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "has no attribute 'nothing'" in stderr
    # Nothing was started: no process of the command's session outlives it, and no Ray
    # session was ever created; the command failed before Ray.
    wait_for(lambda: not _session_members(proc.pid), 30,
             what="every process the command started to exit")
    assert not ray_tmp.exists(), sorted(p.name for p in ray_tmp.rglob("*"))[:20]


def _session_members(session_id: int) -> list[psutil.Process]:
    """Live processes of the session ``session_id`` (the command ran as its leader)."""
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(process.pid) == session_id and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
    return members


def _warm_idle_workers(session_id: int) -> list[psutil.Process]:
    """Idle Ray workers of the command's session that have torch loaded (the warm runtime)."""
    idle = []
    for process in _session_members(session_id):
        with contextlib.suppress(psutil.Error, OSError):
            if process.name() == "ray::IDLE" and "libtorch" in Path(
                    f"/proc/{process.pid}/maps").read_text():
                idle.append(process)
    return idle


def _phases(reply: httpx.Response) -> dict[str, str]:
    return dict(p.split("=", 1) for p in reply.headers["x-ember-cold-start"].split(";"))


#: Serve's control loop in the run below: long enough that a wait for it shows.
_LOOP_S = 3.0
_MLP_BODY = {"inputs": [[0.5] * 256]}


def _decided_and_serving(log: ControllerLog) -> tuple[tuple[float, str], tuple[float, str]]:
    """When the controller decided to scale SeedMLP up from zero, and saw the replica serve."""
    decided = wait_for(lambda: log.first("Upscaling Deployment(name='SeedMLP'", "from 0 to"),
                       30, what="the scale-up decision in the controller's log")
    serving = wait_for(lambda: log.first("started successfully", "deployment='SeedMLP'",
                                         after=decided[0]),
                       30, what="the replica's start in the controller's log")
    return decided, serving


def _serve_controller(session_id: int) -> psutil.Process | None:
    """Serve's controller among the command's processes (Ray titles it after its class; the
    kernel's name of a process keeps 15 characters, its command line the whole title)."""
    for process in _session_members(session_id):
        with contextlib.suppress(psutil.Error):
            if " ".join(process.cmdline()).startswith("ray::ServeController"):
                return process
    return None


def _cold_trial(run: EmberRun, session: Path, trial: int) -> None:
    """One request at zero, served by SeedMLP's own replica in a pre-started worker."""
    wait_for(lambda: _warm_idle_workers(run.proc.pid), 60, what="a pre-started worker")
    wait_for(lambda: every_edge_sees(run.url, "SeedMLP", 0), 90, what="SeedMLP at zero")
    log = ControllerLog(session)
    sent_at = time.time()
    reply = httpx.post(f"{run.url}/mlp", json=_MLP_BODY, timeout=120)
    assert reply.status_code == 200, reply.text
    phases = _phases(reply)
    # Its own replica (no pool), in a process that had imported everything before.
    assert (phases["path"], phases["start"], phases["import"]) == (
        "replica", "0", "0"), (trial, phases)
    decided, serving = _decided_and_serving(log)
    # The decision does not wait for Serve's step (up to 3 s here): the edge's report of
    # the request at zero runs the autoscaling at once (ember.ray_controller). Timed from
    # the send to the controller's own line, not by the header's queue phase, which also
    # holds the replica's creation and stretches when the machine is busy (1.8 s with the
    # integration tests beside this one); a decision at Serve's next step misses this two
    # times in three.
    assert decided[0] - sent_at < _LOOP_S / 3, (trial, decided[1], sent_at)
    # Serve would wait a whole loop between the two before creating the replica and
    # up to one each for its allocation and its constructor's end; Ember's
    # controller hooks act on each at once.
    assert serving[0] - decided[0] < _LOOP_S, (trial, decided[1], serving[1])
    # From the replica's ready to the edge's router having it: Serve notices the
    # constructor's end at its next step (up to 3 s here), Ember's hook at once.
    assert "route" in phases and int(phases["route"]) < 500, (trial, phases)
    # Back at zero before the next trial. A start this quick outruns the edges' polled
    # counts (read from the controller, here every 3 s): they may still say 0 with the
    # replica up, so wait for the controller to remove it.
    wait_for(lambda: log.first("Removing 1 replica from Deployment(name='SeedMLP'",
                               after=serving[0]), 60, what="SeedMLP's replica removed")


@pytest.mark.slow
def test_own_replica_from_zero_starts_in_a_pre_started_worker_without_waiting_for_serves_loop(
        tmp_path: Path) -> None:
    run = EmberRun("examples/mlp_app.py:app", tmp_path, unset=["EMBER_WARM_RUNTIME"],
                   env={"EMBER_SCALEDOWN_AFTER_S": "2", "EMBER_WARM_POOL": "0",
                        "EMBER_ADMIN_LOOPBACK": "1",
                        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": str(_LOOP_S)})
    try:
        run.wait_ready(180)
        session = session_dir_of(run.record().values())
        assert session is not None, "no process of the run names its Ray session"
        for trial in range(2):  # the second proves a used worker was replaced
            _cold_trial(run, session, trial)
        # Ray restarts a controller that dies; the new one runs Ember's policy again, which
        # puts the hooks back in that process (the third trial fails without them).
        wait_for(lambda: every_edge_sees(run.url, "SeedMLP", 0), 90, what="SeedMLP at zero")
        _restart_controller(run, session)
        _cold_trial(run, session, 2)
        # The worst moment: the controller dies while a request waits at zero for its
        # replica. The edge holds the request; once the new controller has recovered it
        # starts the replica and the request is answered, not lost. The wait is a few tenths
        # of a second and half the status reads reach the other edge, so a try may miss it:
        # up to six (three all missed it once in a full run).
        assert any(_answered_across_a_controller_death(run, session) for _ in range(6)), (
            "each request was answered before its controller died: nothing was tested")
    finally:
        run.stop()


def _answered_across_a_controller_death(run: EmberRun, session: Path) -> bool:
    """Kill the controller while a request waits at zero; the request must still be
    answered, right. False when the replica answered before the kill (the step came at
    once): the caller tries again."""
    wait_for(lambda: _warm_idle_workers(run.proc.pid), 60, what="a pre-started worker")
    wait_for(lambda: every_edge_sees(run.url, "SeedMLP", 0), 90, what="SeedMLP at zero")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, f"{run.url}/mlp", json=_MLP_BODY, timeout=180)
        wait_for(lambda: waiting.done() or deployment_status(run.url, "SeedMLP")["queued"],
                 30, interval_s=0.02, what="the request held at the edge")
        mid_start = not waiting.done()
        if mid_start:
            _restart_controller(run, session)
        reply = waiting.result(timeout=180)
    assert reply.status_code == 200, reply.text
    assert reply.json() == httpx.post(f"{run.url}/mlp", json=_MLP_BODY, timeout=60).json()
    return mid_start


def _restart_controller(run: EmberRun, session: Path) -> None:
    """SIGKILL Serve's controller by PID; return once Ray's restart of it has recovered."""
    killed = _serve_controller(run.proc.pid)
    assert killed is not None, "no Serve controller among the run's processes"
    killed.kill()
    restarted = wait_for(lambda: (c := _serve_controller(run.proc.pid)) is not None
                         and c.pid != killed.pid and c, 90, what="a new Serve controller")
    new_log = session / "logs" / "serve" / f"controller_{restarted.pid}.log"
    # A recovering controller holds every router's updates until a step finds no replica
    # recovering (Serve's pace: with this loop, a request then would wait up to 3 s for the
    # edge to learn of its replica, docs/limits.md).
    wait_for(lambda: new_log.exists() and "Finished recovering deployments"
             in new_log.read_text(), 90, what="the new controller's recovery")
