"""Capacity from a latency target: ``ember plan --rps 500 --p99-ms 200``.

Works backwards from a service-level objective to a batch size, replicas and nodes, with the
per-call cost model of the seed article, measured by ``bench/batching_curve.py``: a call of
``b`` items costs ``T(b) = o + c*b`` milliseconds, so ``t(b) = o/b + c`` per item, and a busy
replica serves ``b / T(b)`` items per second (requests, at one item per request).

The latency model is the one a dynamically batched replica under steady load meets: a request
waits at most ``max_wait_ms`` for its batch to close, then for the batch already running
(``T(b)``), then for its own (``T(b)``)::

    p99 ~ max_wait_ms + 2 * T(b)

The largest ``b`` within the target gives the most throughput per replica; replicas then
cover the rate at a target utilisation (the headroom a burst needs while the autoscaler
reacts). A planning model, not a guarantee: check the answer with the Locust budgets.

The measured cold-start paths (``bench/coldstart.py``) say whether a request that finds no
replica can still meet the target: when no own-replica path fits, the deployment needs a
warm floor, or a preloaded pool to bridge its cold starts.

Pure functions of the parsed results; ``cli/serve.py`` reads the files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ember.errors import ConfigError


@dataclass(frozen=True)
class CostCurve:
    """``T(b) = overhead_ms + per_item_ms * b``, measured up to ``max_batch`` items."""

    overhead_ms: float
    per_item_ms: float
    max_batch: int

    def call_ms(self, batch: int) -> float:
        """``T(b)``: the milliseconds one call of ``batch`` items takes."""
        return self.overhead_ms + self.per_item_ms * batch

    def items_per_s(self, batch: int) -> float:
        """``b / T(b)``: what one busy replica serves, calling with ``batch`` items."""
        return 1000.0 * batch / self.call_ms(batch)


@dataclass(frozen=True)
class ColdPath:
    """One measured cold-start path: what a request at zero replicas meets."""

    key: str
    label: str
    seconds: float
    pool: bool  # served by the warm pool while the deployment's own replica starts


@dataclass(frozen=True)
class CapacityPlan:
    """What a rate and a p99 target need."""

    batch: int
    call_ms: float
    p99_ms: float  # the model's p99 at that batch size
    replica_items_per_s: float  # at full use; replicas are sized at ``utilization`` of it
    replicas: int
    replicas_per_node: int
    nodes: int
    utilization: float  # of each replica at the target rate
    cold_paths: tuple[tuple[ColdPath, bool], ...]  # each path and whether it fits the target
    warm_floor_needed: bool


def curve_from_results(results: Mapping[str, Any], curve: str) -> CostCurve:
    """The fit of ``curve`` in ``bench/results/batching_curve.json``.

    Raises:
        ConfigError: the file has no such curve, or its fit is malformed.

    Example:
        >>> data = {"fits": {"m": {"o_ms": 20.0, "c_ms_per_item": 5.0}},
        ...         "curves": [{"key": "m", "rows": [{"b": 1}, {"b": 64}]}]}
        >>> curve_from_results(data, "m")
        CostCurve(overhead_ms=20.0, per_item_ms=5.0, max_batch=64)
    """
    fits = results.get("fits", {})
    if curve not in fits:
        raise ConfigError(f"no fitted curve {curve!r} in the batching results; "
                          f"measured: {sorted(fits) or 'none'}")
    fit = fits[curve]
    rows = [r for c in results.get("curves", []) if c.get("key") == curve for r in c["rows"]]
    try:
        overhead, per_item = float(fit["o_ms"]), float(fit["c_ms_per_item"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"the fit of {curve!r} needs numbers o_ms and c_ms_per_item") from None
    if overhead < 0 or per_item <= 0:
        raise ConfigError(f"the fit of {curve!r} is not a cost curve: o={overhead} c={per_item}")
    return CostCurve(overhead, per_item, max((int(r["b"]) for r in rows), default=1))


def cold_paths_from_results(results: Mapping[str, Any]) -> list[ColdPath]:
    """Ember's cold-start paths in ``bench/results/coldstart.json``, fastest first.

    The plain Ray Serve baselines measured beside them are left out: they are not paths an
    Ember deployment takes.
    """
    variants = {v["key"]: v for v in results.get("config", {}).get("ember_variants", [])}
    paths = [
        ColdPath(row["key"], row["variant"], float(row["cold_start_median_s"]),
                 pool=int(variants[row["key"]].get("warm_pool", 0)) > 0)
        for row in results.get("summary", []) if row.get("key") in variants
    ]
    return sorted(paths, key=lambda p: p.seconds)


def largest_batch(curve: CostCurve, *, p99_ms: float, max_wait_ms: float) -> int:
    """The largest batch whose modelled p99 (``max_wait_ms + 2 T(b)``) fits ``p99_ms``,
    no larger than the curve was measured at.

    Raises:
        ConfigError: not even a batch of one fits.
    """
    per_call_ms = (p99_ms - max_wait_ms) / 2
    batch = math.floor((per_call_ms - curve.overhead_ms) / curve.per_item_ms + 1e-9)
    if batch < 1:
        raise ConfigError(
            f"a p99 of {p99_ms:g} ms is below what one replica can answer: a call of one item "
            f"takes {curve.call_ms(1):.1f} ms, and a request may wait for the call before it "
            f"and {max_wait_ms:g} ms for its batch ({max_wait_ms + 2 * curve.call_ms(1):.1f} ms)")
    return min(batch, curve.max_batch)


def plan_capacity(curve: CostCurve, *, rps: float, p99_ms: float, node_cpus: float,
                  replica_cpus: float, edge_cpus: float = 0.1, utilization: float = 0.7,
                  max_wait_ms: float = 0.0,
                  cold_paths: tuple[ColdPath, ...] | list[ColdPath] = ()) -> CapacityPlan:
    """Batch size, replicas and nodes that serve ``rps`` within ``p99_ms``.

    Args:
        node_cpus: CPUs of each node; each keeps ``edge_cpus`` for its edge.
        replica_cpus: CPUs a busy replica uses (the measured replica's torch threads).
        utilization: the share of a replica's full throughput the plan loads it to.

    Raises:
        ConfigError: the target is out of reach, or an argument is out of range.

    Example:
        >>> plan = plan_capacity(CostCurve(20, 5, 512), rps=500, p99_ms=200, node_cpus=4,
        ...                      replica_cpus=1, utilization=0.8)
        >>> plan.batch, plan.replicas, plan.nodes
        (16, 4, 2)
    """
    if rps <= 0 or p99_ms <= 0 or not 0 < utilization <= 1:
        raise ConfigError(f"need rps > 0, p99 > 0 and 0 < utilization <= 1, got rps={rps}, "
                          f"p99_ms={p99_ms}, utilization={utilization}")
    per_node = math.floor((node_cpus - edge_cpus) / replica_cpus + 1e-9)
    if per_node < 1:
        raise ConfigError(f"a node of {node_cpus:g} CPUs has no room for a replica of "
                          f"{replica_cpus:g} CPUs beside its edge ({edge_cpus:g} CPUs)")
    batch = largest_batch(curve, p99_ms=p99_ms, max_wait_ms=max_wait_ms)
    full = curve.items_per_s(batch)
    replicas = math.ceil(rps / (full * utilization) - 1e-9)
    fits = tuple((path, path.seconds * 1000 <= p99_ms) for path in cold_paths)
    return CapacityPlan(
        batch=batch, call_ms=curve.call_ms(batch),
        p99_ms=max_wait_ms + 2 * curve.call_ms(batch), replica_items_per_s=full,
        replicas=replicas, replicas_per_node=per_node, nodes=math.ceil(replicas / per_node),
        utilization=rps / (replicas * full), cold_paths=fits,
        warm_floor_needed=bool(fits) and not any(ok for path, ok in fits if not path.pool),
    )


def render_plan(plan: CapacityPlan, *, rps: float, p99_target_ms: float) -> str:
    """The plan as the lines ``ember plan --rps --p99-ms`` prints."""
    lines = [
        f"target: {rps:g} requests/s at p99 <= {p99_target_ms:g} ms",
        f"batch size: {plan.batch} (a call takes {plan.call_ms:.1f} ms; modelled p99 "
        f"{plan.p99_ms:.1f} ms)",
        f"per replica: {plan.replica_items_per_s:.1f} requests/s at full use, "
        f"{plan.utilization:.0%} used at the target",
        f"replicas: {plan.replicas}",
        f"nodes: {plan.nodes} ({plan.replicas_per_node} replica(s) per node)",
    ]
    for path, ok in plan.cold_paths:
        kind = "pool" if path.pool else "own replica"
        lines.append(f"cold start {path.label} ({kind}): {path.seconds * 1000:.0f} ms, "
                     f"{'fits' if ok else 'misses'} the p99")
    if plan.warm_floor_needed:
        lines.append(f"warm floor: needed: no own-replica cold start fits {p99_target_ms:g} ms; "
                     f"keep warm_floor >= 1, or {plan.replicas} if the full rate can arrive at "
                     "once (a preloaded pool only bridges the first requests)")
    elif plan.cold_paths:
        lines.append("warm floor: not needed: an own-replica cold start fits the p99")
    return "\n".join(lines)
