"""``ember plan --rps --p99-ms``: replicas and nodes from a latency target and t(b)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ember.cli import main
from ember.cluster.capacity import (
    ColdPath,
    CostCurve,
    cold_paths_from_results,
    curve_from_results,
    largest_batch,
    plan_capacity,
)
from ember.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
#: T(b) = 20 + 5 b ms: a batch of 16 takes 100 ms and serves 160 items/s.
CURVE = CostCurve(overhead_ms=20.0, per_item_ms=5.0, max_batch=512)
POOL = ColdPath("a", "pool, preloaded", 0.06, pool=True)
OWN = ColdPath("c", "own replica, warm runtime", 0.5, pool=False)


def test_the_largest_batch_within_the_target_is_chosen() -> None:
    # Two calls fit in 200 ms: T(b) <= 100 -> b <= 16.
    plan = plan_capacity(CURVE, rps=500, p99_ms=200, node_cpus=4, replica_cpus=1,
                         utilization=0.8)
    assert (plan.batch, plan.call_ms, plan.p99_ms) == (16, 100.0, 200.0)
    assert plan.replica_items_per_s == 160.0
    # 500 / (160 * 0.8) = 3.9 -> 4 replicas; 3 per node of 4 CPUs (0.1 kept for the edge).
    assert (plan.replicas, plan.replicas_per_node, plan.nodes) == (4, 3, 2)
    assert plan.utilization == 500 / 640


def test_the_batch_wait_comes_out_of_the_target() -> None:
    # (200 - 10) / 2 = 95 ms per call -> b <= 15.
    assert largest_batch(CURVE, p99_ms=200, max_wait_ms=10) == 15
    plan = plan_capacity(CURVE, rps=500, p99_ms=200, node_cpus=4, replica_cpus=1,
                         utilization=0.8, max_wait_ms=10)
    assert plan.batch == 15
    assert plan.replicas == math.ceil(500 / (0.8 * 1000 * 15 / 95)) == 4


def test_the_batch_never_exceeds_what_was_measured() -> None:
    assert largest_batch(CostCurve(20.0, 5.0, 8), p99_ms=1000, max_wait_ms=0) == 8


def test_a_lower_target_costs_more_replicas() -> None:
    tight = plan_capacity(CURVE, rps=500, p99_ms=100, node_cpus=4, replica_cpus=1,
                          utilization=0.8)
    # T(b) <= 50 -> b = 6: 120 items/s per replica, 96 at 80% -> 6 replicas on 2 nodes.
    assert (tight.batch, tight.replicas, tight.nodes) == (6, 6, 2)


def test_an_unreachable_target_says_why() -> None:
    with pytest.raises(ConfigError, match=r"one item takes 25\.0 ms"):
        plan_capacity(CURVE, rps=10, p99_ms=40, node_cpus=4, replica_cpus=1)
    with pytest.raises(ConfigError, match="no room for a replica"):
        plan_capacity(CURVE, rps=10, p99_ms=200, node_cpus=1, replica_cpus=1)
    with pytest.raises(ConfigError, match="utilization"):
        plan_capacity(CURVE, rps=10, p99_ms=200, node_cpus=4, replica_cpus=1, utilization=0)


def test_a_cold_start_over_the_target_needs_a_warm_floor() -> None:
    plan = plan_capacity(CURVE, rps=500, p99_ms=200, node_cpus=4, replica_cpus=1,
                         cold_paths=[POOL, OWN])
    assert plan.cold_paths == ((POOL, True), (OWN, False))
    assert plan.warm_floor_needed
    relaxed = plan_capacity(CURVE, rps=500, p99_ms=600, node_cpus=4, replica_cpus=1,
                            cold_paths=[POOL, OWN])
    assert not relaxed.warm_floor_needed
    assert not plan_capacity(CURVE, rps=1, p99_ms=200, node_cpus=4,
                             replica_cpus=1).warm_floor_needed


def synthetic_results(tmp_path: Path) -> tuple[Path, Path]:
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({
        "fits": {"batched": {"o_ms": 20.0, "c_ms_per_item": 5.0}},
        "curves": [{"key": "batched", "rows": [{"b": 1}, {"b": 512}]}],
        "config": {"torch_threads": 1}, "host": {"cpus": 4}}))
    cold = tmp_path / "cold.json"
    cold.write_text(json.dumps({
        "summary": [{"key": "c", "variant": "own replica, warm runtime",
                     "cold_start_median_s": 0.5},
                    {"key": "a", "variant": "pool, preloaded", "cold_start_median_s": 0.06},
                    {"key": "e", "variant": "Ray Serve default", "cold_start_median_s": 8.6}],
        "config": {"ember_variants": [{"key": "a", "warm_pool": 1}, {"key": "c",
                                                                      "warm_pool": 0}]}}))
    return curve, cold


def test_results_are_read_from_the_files(tmp_path: Path) -> None:
    curve, cold = synthetic_results(tmp_path)
    assert curve_from_results(json.loads(curve.read_text()), "batched") == CURVE
    assert cold_paths_from_results(json.loads(cold.read_text())) == [POOL, OWN]
    with pytest.raises(ConfigError, match=r"no fitted curve 'mlp'.*batched"):
        curve_from_results(json.loads(curve.read_text()), "mlp")


def test_the_cli_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    curve, cold = synthetic_results(tmp_path)
    code = main(["plan", "--rps", "500", "--p99-ms", "200", "--from", str(curve),
                 "--coldstart", str(cold), "--utilization", "0.8", "--max-wait-ms", "0"])
    assert code == 0
    assert capsys.readouterr().out.splitlines() == [
        "target: 500 requests/s at p99 <= 200 ms",
        "batch size: 16 (a call takes 100.0 ms; modelled p99 200.0 ms)",
        "per replica: 160.0 requests/s at full use, 78% used at the target",
        "replicas: 4",
        "nodes: 2 (3 replica(s) per node)",
        "cold start pool, preloaded (pool): 60 ms, fits the p99",
        "cold start own replica, warm runtime (own replica): 500 ms, misses the p99",
        "warm floor: needed: no own-replica cold start fits 200 ms; keep warm_floor >= 1, or 4 "
        "if the full rate can arrive at once (a preloaded pool only bridges the first requests)",
    ]


def test_the_cli_reads_the_committed_measurements(capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads((ROOT / "bench" / "results" / "batching_curve.json").read_text())
    fit = data["fits"]["batched"]
    assert main(["plan", "--rps", "500", "--p99-ms", "200", "--max-wait-ms", "5"]) == 0
    out = capsys.readouterr().out
    batch = math.floor((97.5 - fit["o_ms"]) / fit["c_ms_per_item"])
    per_replica = 1000 * batch / (fit["o_ms"] + fit["c_ms_per_item"] * batch)
    assert f"batch size: {batch} " in out
    assert f"replicas: {math.ceil(500 / (0.7 * per_replica))}\n" in out
    assert "own replica, fresh process (own replica)" in out and "Ray Serve" not in out


def test_plan_needs_both_figures_to_work_offline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--rps", "500"]) == 2
    assert "both --rps and --p99-ms" in capsys.readouterr().err
