"""bench/cpu_by_process.py: a command's CPU by kind of process, as docs/testing.md quotes it."""

from __future__ import annotations

import sys

from support import bench_module

cpu = bench_module("cpu_by_process")


def test_serve_replicas_and_edges_are_told_apart_by_ray_s_title() -> None:
    assert cpu.kind("ray::ServeReplica:features:Summer", "ray::ServeRepli") == "serve replica"
    assert cpu.kind("ray::ServeReplica:features:ember-edge", "ray::ServeRepli") == "ember edge"
    assert cpu.kind("ray::MapWorker(MapBatches(LocalMapper))", "ray::MapWorker") == "ray::MapWorker"
    assert cpu.kind("/venv/lib/ray/core/src/ray/gcs/gcs_server --log_dir=x", "gcs_server") == (
        "gcs_server")
    # A worker's command line names the raylet; it is a worker until Ray titles it.
    assert cpu.kind("python .../default_worker.py --raylet-name=/tmp/ray/raylet", "python") == (
        "default_worker")


def test_a_command_s_own_cpu_is_counted_and_its_exit_code_kept() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    report = cpu.measure([sys.executable, "-c", f"{burn}\nraise SystemExit(3)"], 0.1)
    assert report.returncode == 3
    mine = sum(row["cpu_s"] for row in report.by_kind if row["kind"] == "python")
    assert 0.4 <= mine <= 5, report.by_kind
    assert report.machine_busy_cpu_s >= mine - 0.2
