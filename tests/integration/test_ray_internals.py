"""Each private part of Ray that Ember uses, exercised live against the installed Ray.

A Ray release that renames, drops or stops honouring one of them fails here; the last two
tests change Ray on purpose (in a subprocess) and see the embedded cluster refuse to start.
The cold-start fast path and the router's cold-start push run through Ray's own code in
tests/unit/test_ray_policy.py and tests/unit/http/test_router_view.py (so do the quiet idle
pushes, whose effect is counted here live, by the controller); the replica's gRPC bind
across a whole app in test_listeners.py; the preloading raylet in tests/e2e.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
from ray import serve

from ember import ray_internals
from ember.control import warm_runtime

from apps import internals
from support import wait_for

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


def test_the_local_cluster_advertises_and_binds_loopback(ray_cluster: None) -> None:
    # loopback_node_ip and init_node_ip: Ray honoured the switch and the node IP.
    host = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
    assert host == "127.0.0.1"
    nodes = [n for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
    assert {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
    raylet = next(p for p in psutil.Process().children(recursive=True) if p.name() == "raylet")
    ports = [c.laddr for c in raylet.net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN]
    assert ports and all(_loopback(a.ip) for a in ports), ports


def test_serve_reads_each_switch_in_the_replica_and_the_bind_is_narrowed(
        serve_port: int) -> None:
    # serve_env_switches: what Serve parsed in a replica is what Ember set; replica_grpc_bind:
    # the replica bound its gRPC server through the wrapper, on loopback only.
    name = f"probe-{uuid.uuid4().hex[:6]}"
    probe: Any = internals.Probe
    handle = serve.run(probe.bind(), name=name, route_prefix=None)
    try:
        # grpc_by_value: the edges' handle option makes Serve answer over gRPC.
        response = handle.options(**ray_internals.handle_by_value_options()).remote()
        report = response.result(timeout_s=60)
        assert type(response._replica_result).__name__ == "gRPCReplicaResult"
        # router_view: the router of the handle knows its one replica, and the request
        # reached it.
        assert ray_internals.router_running_replicas(handle) == 1
        assert ray_internals.response_assigned(response) is True
    finally:
        serve.delete(name)
    expected = {n: _parse(v) for n, v in report["env"].items() if v is not None}
    assert set(expected) == set(ray_internals.SERVE_ENV_SWITCHES), report["env"]
    assert {n: report["parsed"][n] for n in expected} == expected
    assert report["gc_frozen"] > 0  # RAY_SERVE_FREEZE_GC_ON_STARTUP took effect
    assert report["bind_wrapped"] is True
    controller = next(p for p in psutil.Process().children(recursive=True)
                      if p.name() == "ray::ServeController")
    # Serve's control loop runs at Ray's own period unless the operator set one.
    loop = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
    assert controller.environ().get(loop) == os.environ.get(loop)


def _handle_reports(app: str, deployment: str) -> float:
    """How many handle reports Serve's controller took in for ``deployment``: the count of
    its ``serve_autoscaling_handle_metrics_delay_ms`` histogram (one sample per report), from
    the node's metrics agent (Ray exports a process's metrics every few seconds)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    ports = [n["MetricsExportPort"] for n in ray.nodes()  # type: ignore[no-untyped-call]
             if n.get("Alive")]
    total = 0.0
    for port in ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        total += sum(s.value for family in text_string_to_metric_families(text)
                     for s in family.samples
                     if s.name == "ray_serve_autoscaling_handle_metrics_delay_ms_count"
                     and s.labels.get("application") == app
                     and s.labels.get("deployment") == deployment)
    return total


def test_serves_controller_hears_an_idle_deployments_handles_every_few_seconds(
        serve_app: Any) -> None:
    # Two edges, each with a handle to Quiet: reporting every 0.25 s tick, 16 s idle bring
    # the controller about 128 reports; a 4 s keep-alive brings it about 8.
    app = internals.quiet_app
    with serve_app(app) as url:
        import httpx

        assert httpx.post(f"{url}/quiet", json={"text": "hi"}, timeout=30).status_code == 200
        wait_for(lambda: _handle_reports(app.name, "Quiet") > 0, 60,
                 what="the controller's count of handle reports, exported")
        time.sleep(3)  # the request's samples leave the 1 s look-back window
        first = _handle_reports(app.name, "Quiet")
        time.sleep(16)
        heard = _handle_reports(app.name, "Quiet") - first
        # After the quiet spell the app still serves (a 200, within the request's timeout).
        assert httpx.post(f"{url}/quiet", json={"text": "again"}, timeout=30).status_code == 200
    # Above the floor too: handles that went silent would be dropped by the controller as
    # stale, and a request at zero would then wait for a report that never comes.
    assert 3 <= heard < 32, f"{heard:.0f} handle reports in 16 s of idle"


def test_the_raylet_prestarts_idle_workers_on_request(ray_cluster: None) -> None:
    # prestart_workers: the RPC is accepted and the raylet starts the workers it was asked for.
    before = warm_runtime.idle_workers()
    ray_internals.prestart_workers(1, keep_alive_s=30)
    wait_for(lambda: warm_runtime.idle_workers() > before, 60, what="a pre-started worker")


def test_the_refiller_sees_the_worker_an_actor_took_busy_until_it_quietens(
        ray_cluster: None) -> None:
    # The refill waits for the cold start that took an idle worker (warm_runtime._Taken):
    # the worker leaves the idle set under Ray's process names, and its CPU is counted.
    ray_internals.prestart_workers(1, keep_alive_s=30)
    wait_for(warm_runtime.idle_worker_processes, 60, what="an idle worker")
    taken = warm_runtime._Taken()
    idle = {p.pid for p in warm_runtime.idle_worker_processes()}
    assert not taken.busy(warm_runtime.idle_worker_processes())
    spinner: Any = ray.remote(num_cpus=0.1)(internals.Spinner).remote()
    try:
        assert ray.get(spinner.pid.remote(), timeout=60) in idle, "the actor got a new worker"
        spun = spinner.spin.remote(8.0)
        # Counted a second apart, as the refiller counts.
        wait_for(lambda: taken.busy(warm_runtime.idle_worker_processes()), 6, interval_s=1.0,
                 what="the spinning worker seen busy")
        ray.get(spun, timeout=60)
        wait_for(lambda: not taken.busy(warm_runtime.idle_worker_processes()), 15,
                 interval_s=1.0, what="the worker seen quiet once its actor rests")
    finally:
        ray.kill(spinner)


def test_the_key_value_store_keeps_the_semantics_callers_rely_on(ray_cluster: None) -> None:
    ns, key = f"ember-test-{uuid.uuid4().hex[:6]}", "a:1"
    assert ray_internals.kv_get(key, namespace=ns) is None
    assert ray_internals.kv_put(key, b"one", namespace=ns) is False  # new key
    assert ray_internals.kv_put(key, b"two", namespace=ns, overwrite=False) is True
    assert ray_internals.kv_get(key, namespace=ns) == b"one"  # not overwritten
    assert ray_internals.kv_put(key, b"two", namespace=ns) is True
    assert ray_internals.kv_get(key, namespace=ns) == b"two"
    ray_internals.kv_put("b:1", b"x", namespace=ns)
    assert sorted(ray_internals.kv_list("a:", namespace=ns)) == [b"a:1"]
    assert ray_internals.kv_get(key, namespace=ns + "-other") is None  # namespaces apart
    assert ray_internals.kv_delete(key, namespace=ns) == 1
    assert ray_internals.kv_get(key, namespace=ns) is None
    ray_internals.kv_delete("b:1", namespace=ns)


def test_a_ray_without_the_replica_bind_is_refused_before_anything_starts(
        short_tmp: Path) -> None:
    # Simulate a Ray release that moved Serve's gRPC bind: `ember run` must refuse, with the
    # reason, before a single Ray process exists.
    code = ("import ray.serve._private.replica as r; del r.add_port_to_grpc_server; "
            "import sys; from ember.cli import main; sys.exit(main(sys.argv[1:]))")
    out = _run(short_tmp, code, "run", "examples/mlp_app.py:app")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "refusing to start: replica_grpc_bind" in out.stderr
    assert "add_port_to_grpc_server is gone" in out.stderr
    assert not (short_tmp / "ray").exists()  # no Ray session was created


def test_a_ray_that_ignores_the_loopback_switch_is_shut_down_with_the_reason(
        short_tmp: Path) -> None:
    # Simulate a Ray release whose node-IP logic no longer reads the switch (the static check
    # cannot see it): the cluster comes up on the machine's address and is refused at once.
    code = ("from ember import ray_internals as ri; ri.set_driver_loopback_flag = lambda: None; "
            "from ember.cluster import runtime; import ray\n"
            "try:\n    runtime.start_ray(num_cpus=1, warm=False)\n"
            "except ri.RayInternalsChanged as e:\n"
            "    print('REFUSED', e, 'STILL UP' if ray.is_initialized() else 'DOWN')\n")
    out = _run(short_tmp, code)
    if "REFUSED" not in out.stdout and "gcs is on 127." in out.stderr:
        pytest.skip("this machine's only address is loopback")
    assert "REFUSED" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert "loopback_node_ip: the local cluster's gcs is on" in out.stdout
    assert out.stdout.rstrip().endswith("DOWN")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path: Ray's socket paths must fit 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="er-", dir="/tmp") as path:
        yield Path(path)


def _run(tmp_path: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "ray"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    for name in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:  # it did not refuse: stop it and all Ray started
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _parse(value: str) -> bool | float:
    return {"1": True, "0": False}.get(value, float(value) if value else 0.0)


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback

