"""Offline batch jobs on the session's Ray cluster: formats, bad rows, kills, sharing.

The toy deployments are in ``apps/offline.py``; targets name them ``apps.offline:...``.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from apps.offline import Lengths, app, share_app
from harness import moto_s3, s3_options
from serving import ServeApp
from support import wait_for

pytest.importorskip("pyarrow", reason="Ray Data needs pyarrow")
pytest.importorskip("pandas", reason="Ray Data needs pandas")

import pyarrow as pa
import pyarrow.parquet as pq

from ember.cli.batch import main as batch_main
from ember.offline import ShareOptions, resolve_target, run_batch
from ember.offline._mapping import encode_result, plan_inputs
from ember.offline._reader import read_shard
from ember.offline._shards import discover, plan
from ember.offline._sink import OutputStore, ShardAssembler, done_shards

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _read_output(out: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for part in sorted(out.glob("part-*.parquet")):
        rows.extend(pq.read_table(part).to_pylist())
    return rows


def _errors(out: Path) -> list[dict[str, Any]]:
    path = out / "errors.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _assert_exactly_once(out: Path, total: int) -> list[dict[str, Any]]:
    rows = _read_output(out)
    indexes = [r["row_index"] for r in rows] + [e["row_index"] for e in _errors(out)]
    assert sorted(indexes) == list(range(total))
    return rows


def test_formats_bad_rows_and_one_setup_per_worker(ray_cluster: None, tmp_path: Path) -> None:
    data = tmp_path / "in"
    data.mkdir()
    _write_jsonl(data / "a.jsonl", [{"id": "j0", "text": "hello"}, "{not json", {"text": 7},
                                    {"id": "j3", "text": "boom"}, "", {"text": "x" * 300},
                                    {"text": "ok"}])
    with (data / "b.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerows([["id", "text"], ["c0", "two\nlines"], ["c1", "plain"]])
    pq.write_table(pa.table({"id": ["p0", "p1", "p2"], "text": ["a", "bb", "ccc"]}),
                   data / "c.parquet", row_group_size=2)
    out = tmp_path / "out"
    report = run_batch(app, input=str(data), output=str(out), attr="lengths", shard_rows=2,
                       batch_size=4, concurrency=2, max_item_bytes=200)
    assert (report.rows_total, report.rows_failed, report.shards_total) == (11, 4, 6)
    by_id = {r["id"]: r for r in _assert_exactly_once(out, 11)}
    assert by_id["j0"]["embedding"][0] == 5.0 and by_id["c0"]["embedding"][0] == 9.0
    assert by_id["p2"]["embedding"][0] == 3.0 and by_id["p2"]["row_index"] == 10
    assert by_id["5"]["row_index"] == 5  # no id field: the row index stands in
    reasons = {e["row_index"]: e["reason"] for e in _errors(out)}
    assert reasons == {1: "invalid_json", 2: "wrong_type", 3: "handler_error", 4: "too_large"}
    # Each worker built the class once: at most `concurrency` distinct setup processes.
    assert len({r["embedding"][1] for r in by_id.values()}) <= 2
    again = run_batch(app, input=str(data), output=str(out), attr="lengths", shard_rows=2,
                      max_item_bytes=200, resume=True)
    assert (again.shards_skipped, again.rows_processed) == (6, 0)


def test_pydantic_rows_through_the_cli(ray_cluster: None, tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "docs.jsonl", [
        {"id": 1, "text": "alpha", "weight": 2}, {"id": 2, "text": "b", "weight": "heavy"},
        {"id": 3, "text": "gamma"}])
    out = tmp_path / "out"
    code = batch_main(["batch", "apps.offline:app:Scorer", "-i", str(src), "-o", str(out),
                       "--no-progress", "--output-format", "jsonl"])
    assert code == 0
    rows = [json.loads(x) for x in (out / "part-00000.jsonl").read_text().splitlines()]
    assert rows == [{"id": "1", "row_index": 0, "score": 10.0, "tag": "a"},
                    {"id": "3", "row_index": 2, "score": 5.0, "tag": "g"}]
    [error] = _errors(out)
    assert (error["id"], error["reason"]) == ("2", "invalid_row")
    assert "weight" in error["message"]
    again = batch_main(["batch", "apps.offline:app:Scorer", "-i", str(src), "-o", str(out)])
    assert again == 2  # the output holds a job and --resume was not given


def test_a_killed_worker_is_replaced_and_rows_come_out_once(ray_cluster: None,
                                                             tmp_path: Path) -> None:
    marker = tmp_path / "killed"
    texts = [f"t{i}" for i in range(20)]
    texts[9] = f"die:{marker}"
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "out"
    report = run_batch(Lengths, input=str(src), output=str(out), attr="lengths", shard_rows=5,
                       batch_size=5)
    assert marker.exists()  # a worker really died mid-batch
    assert report.rows_failed == 0
    _assert_exactly_once(out, 20)


def test_resume_after_the_driver_is_killed(ray_cluster: None, tmp_path: Path) -> None:
    import ray

    shards, rows_per_shard = 8, 10
    src = _write_jsonl(tmp_path / "in.jsonl",
                       [{"text": f"row {i}"} for i in range(shards * rows_per_shard)])
    out = tmp_path / "out"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, "-m", "ember.cli.batch", "batch",
           "apps.offline:app:Lengths", "--attr", "slow", "-i", str(src), "-o", str(out),
           "--shard-rows", str(rows_per_shard), "--batch-size", "5", "--no-progress"]
    log = (tmp_path / "driver.log").open("w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 2 or proc.poll() is not None,
                 120, interval_s=0.05, what="two committed shards")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    done_at_kill = len(list(out.glob("part-*.parquet")))
    assert 2 <= done_at_kill < shards, (tmp_path / "driver.log").read_text()[-2000:]
    assert not (out / "_SUCCESS.json").exists()
    report = run_batch(app, input=str(src), output=str(out), deployment="Lengths", attr="slow",
                       shard_rows=rows_per_shard, batch_size=5, resume=True)
    assert report.shards_skipped >= done_at_kill
    assert report.rows_processed == (shards - report.shards_skipped) * rows_per_shard
    _assert_exactly_once(out, shards * rows_per_shard)
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]


@pytest.fixture()
def shared_url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(share_app) as base:
        yield base


def test_online_p95_stays_within_budget_beside_a_batch_job(shared_url: str,
                                                           tmp_path: Path) -> None:
    budget_s, total = 0.4, 120
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": f"doc {i}"} for i in range(total)])
    latencies: list[float] = []
    codes: list[int] = []
    processed: list[int] = []
    stop = threading.Event()

    def online() -> None:
        with httpx.Client(timeout=30) as client:
            while _items(client, shared_url) == 0 and not stop.wait(0.02):
                pass  # start once batch work is under way
            processed.append(_items(client, shared_url))
            for _ in range(25):
                started = time.monotonic()
                codes.append(client.post(f"{shared_url}/shared", json=["q"]).status_code)
                latencies.append(time.monotonic() - started)
                time.sleep(0.1)
            processed.append(_items(client, shared_url))

    client = threading.Thread(target=online)
    client.start()
    share = ShareOptions(url=shared_url, latency_budget_s=budget_s, poll_interval_s=0.05,
                         resume_after_s=0.05)
    try:
        report = run_batch(share_app, input=str(src), output=str(tmp_path / "out"),
                           share=share, batch_size=32)
    finally:
        stop.set()
        client.join(timeout=120)
    _assert_exactly_once(tmp_path / "out", total)
    assert report.rows_failed == 0 and codes == [200] * 25
    p95 = statistics.quantiles(latencies, n=20)[-1]
    print(f"online p95 {p95:.3f}s max {max(latencies):.3f}s; batch items during online:"
          f" {processed[1] - processed[0] - len(latencies)}; {report.elapsed_s:.1f}s")
    assert p95 <= budget_s, f"online p95 {p95:.3f}s over the {budget_s}s budget"
    # Batch work went on while online requests were served: it backfilled, not waited out.
    assert processed[1] - processed[0] - len(latencies) > 0


def _items(client: httpx.Client, url: str) -> int:
    return int(client.get(f"{url}/shared/items").json()["items"])


def test_bench_runs_against_a_toy_deployment(ray_cluster: None, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        offline_bench = importlib.import_module("offline_bench")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    results = tmp_path / "bench.json"
    code = offline_bench.main(["--target", "apps.offline:app", "--attr", "lengths",
                               "--rows", "60", "--online-items", "10", "--batch-size", "16",
                               "--concurrency", "1", "--price-per-hour", "1.0",
                               "--json", str(results)])
    assert code == 0
    report = json.loads(results.read_text())
    assert [m["items"] for m in report["measures"]] == [10, 60, 60, 60]
    assert report["ratio_items_per_s"] > 0
    assert "offline job / online b=1" in capsys.readouterr().out


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """moto's S3 server on loopback, and the fsspec options that reach it."""
    with moto_s3() as endpoint:
        yield s3_options(endpoint)


def test_shards_read_from_and_commit_to_object_storage(s3: dict[str, Any]) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", **s3)
    fs.mkdir("offline-in")
    fs.pipe_file("offline-in/docs/a.jsonl", b"".join(
        json.dumps({"id": f"s{i}", "text": "x" * i}).encode() + b"\n" for i in range(7)))
    manifest = plan(discover(["s3://offline-in/docs/"], None, s3), 3, 1000, s3, {})
    assert [(s.url, s.num_rows) for s in manifest.shards] == [("s3://offline-in/docs/a.jsonl", 3),
                                                              ("s3://offline-in/docs/a.jsonl", 3),
                                                              ("s3://offline-in/docs/a.jsonl", 1)]
    target = resolve_target(Lengths, attr="lengths")
    input_plan = plan_inputs(target.route, None, "id")
    store = OutputStore("s3://offline-in/out", s3)
    assembler = ShardAssembler(manifest.shards[:2], store, "parquet")
    for shard in manifest.shards[:2]:
        for block in read_shard(shard, input_plan, 1000, s3):
            rows = block.to_pylist()
            assembler.add(pa.Table.from_pylist([
                {"_shard": r["_shard"], "_row": r["_row"], "_id": r["_id"], "_reason": None,
                 "_message": None, "_result": encode_result({"n": r["_row"]})} for r in rows]))
    assert done_shards(store, manifest, "parquet") == {0, 1}
    table = pq.read_table("offline-in/out/part-00001.parquet", filesystem=fs).to_pylist()
    assert table == [{"id": f"s{i}", "row_index": i, "n": i} for i in (3, 4, 5)]
