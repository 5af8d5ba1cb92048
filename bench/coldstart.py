"""Cold start of the MiniLM flagship: Ember's four paths vs plain Ray Serve, in one run.

Variants (a)-(f) are described in ``bench/_minilm_apps.py``: (a) the pool with the model
preloaded (a warm hit in a shared process, reported beside the real paths), (b) the pool
constructing the model on demand, (c) the deployment's own replica in a pre-started worker
(the warm runtime), (d) its own replica in a fresh process, and plain Ray Serve from zero
with (e) default and (f) shrunk autoscaling timers. The Ember variants are served by Ember's
edges one at a time; (e) and (f) stay deployed behind Serve's proxy at ``/plain`` and
``/shrunk``, idle at zero, and are measured last, interleaved by round, with no Ember app
deployed.

Cold start: once the measured deployment has no replica in any state (``serve.status()``)
and, for Ember, its ingress also sees none (``GET /-/status``), wait a second and time one
``POST /embed`` with one text from send to 200; median over ``--trials``. For Ember the
``X-Ember-Cold-Start`` phases are recorded; for plain Ray Serve the replica's marks (process
start, constructor began with imports done, setup+warmup done). After a request served by
the pool, the deployment's own replica (which the request woke) is let start and scale back
to zero before the next trial. All variants must return the same vector.

Usage:
    .venv/bin/python bench/coldstart.py [--short] [--trials 5]
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import _harness as h
import _minilm_apps as m
import _serving
from ray import serve

PHASES = ("queue", "start", "import", "weights", "warmup", "route")


@dataclass
class Sample:
    """One cold request: client seconds, and where the time went."""

    total_s: float
    path: str | None = None  # Ember: pool, pool-warm or replica
    phases_s: dict[str, float] = field(default_factory=dict)  # Ember header, with "total"
    marks_s: dict[str, float] = field(default_factory=dict)  # plain: after the send


@dataclass
class Results:
    cold: dict[str, list[Sample]] = field(default_factory=dict)
    vectors: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    idle_rss_mb: list[float] = field(default_factory=list)


def ember_trial(v: m.EmberVariant, base_url: str, deadline: h.Deadline, res: Results) -> None:
    m.wait_ember_zero(v, base_url, deadline)
    reply, took, _ = m.cold_request(base_url + "/embed", deadline)
    path, phases = _serving.cold_header(reply)
    res.cold.setdefault(v.key, []).append(Sample(took, path, phases))
    res.vectors.setdefault(v.key, reply.json()[0]["embedding"])
    shown = " ".join(f"{k}={phases.get(k, 0.0) * 1000:.0f}" for k in PHASES)
    print(f"  cold ({v.key}) {v.label:<20} {took:7.3f}s  path={path} {shown} [ms]", flush=True)
    if path in ("pool", "pool-warm"):
        _serving.wait_woken(v.app, v.deployment, deadline)


def run_ember(v: m.EmberVariant, base_url: str, trials: int, deadline: h.Deadline,
              res: Results) -> None:
    """All trials of one Ember variant, deployed alone at ``/``."""
    print(f"Ember ({v.key}) {v.label}: deploying {v.app}", flush=True)
    app = v.build()
    fresh = _serving.fresh_process_replicas() if v.fresh_process else contextlib.nullcontext()
    try:
        with fresh:
            _serving.deploy_ember(app, deadline)
        for trial in range(trials):
            if v.redeploy_each_trial and trial:
                serve.delete(app.name)
                _serving.deploy_ember(app, deadline)
            ember_trial(v, base_url, deadline, res)
    finally:
        serve.delete(app.name)


def run_plain(base_url: str, trials: int, deadline: h.Deadline, res: Results) -> None:
    """Cold trials of (d) and (e), interleaved by round."""
    for trial in range(1, trials + 1):
        print(f"plain round {trial}/{trials}", flush=True)
        for v in m.PLAIN_VARIANTS:
            m.wait_plain_zero(deadline)
            url = f"{_serving.plain_url()}{v.prefix}/embed"
            reply, took, sent_wall = m.cold_request(url, deadline)
            sample = Sample(took, marks_s=_serving.marks_since(v.deployment, sent_wall))
            res.cold.setdefault(v.key, []).append(sample)
            res.vectors.setdefault(v.key, reply.json()[0]["embedding"])
            marks = " ".join(f"{k}={val:.2f}" for k, val in sample.marks_s.items())
            print(f"  cold ({v.key}) {v.label:<20} {took:7.3f}s  {marks} [s]", flush=True)


def cold_median(res: Results, key: str) -> float | None:
    return h.median_or_none([s.total_s for s in res.cold.get(key, [])])


def summary(res: Results) -> list[dict[str, Any]]:
    """One row per variant: median cold start and the peers' ratios to it."""
    d, e = cold_median(res, "e"), cold_median(res, "f")
    rows = []
    for key, label in m.LABELS.items():
        value = cold_median(res, key)
        rows.append({"key": key, "variant": label, "cold_start_median_s": value,
                     "trials": len(res.cold.get(key, [])),
                     "ray_default_over_it": h.ratio(d, value),
                     "ray_shrunk_over_it": h.ratio(e, value)})
    return rows


def phase_table(res: Results) -> dict[str, dict[str, float | None]]:
    """Median seconds per phase: Ember's header phases, plain replicas' marks."""
    table: dict[str, dict[str, float | None]] = {}
    for key, samples in res.cold.items():
        ember_key = key in {v.key for v in m.EMBER_VARIANTS}
        names = (*PHASES, "total") if ember_key else _serving.MARK_KEYS
        source = [s.phases_s if ember_key else s.marks_s for s in samples]
        table[key] = {n: h.median_or_none([p.get(n) for p in source]) for n in names}
        table[key]["client"] = cold_median(res, key)
    return table


def print_report(rows: list[dict[str, Any]], phases: dict[str, dict[str, float | None]],
                 res: Results) -> None:
    d_row, e_row = (next(r for r in rows if r["key"] == k) for k in ("e", "f"))
    lines = [["variant", "cold start median [s]", "Ray default / it", "Ray shrunk / it"]]
    for r in rows:
        value = r["cold_start_median_s"]
        lines.append([f"({r['key']}) {r['variant']}", h.fmt(value),
                      h.fmt_ratio(d_row["cold_start_median_s"], value, ".1f"),
                      h.fmt_ratio(e_row["cold_start_median_s"], value, ".1f")])
    print()
    h.print_table(lines)
    print("\nEmber phases (X-Ember-Cold-Start, medians, seconds):")
    lines = [["variant", *PHASES, "ingress total", "client total", "paths"]]
    for v in m.EMBER_VARIANTS:
        row = phases.get(v.key, {})
        paths = [str(s.path) for s in res.cold.get(v.key, [])]
        lines.append([f"({v.key}) {v.label}", *(h.fmt(row.get(p)) for p in PHASES),
                      h.fmt(row.get("total")), h.fmt(row.get("client")),
                      ",".join(sorted(set(paths)))])
    h.print_table(lines)
    print("\nPlain Ray Serve replica marks (seconds after the send; negative process start: "
          "a reused worker):")
    lines = [["variant", *_serving.MARK_KEYS, "client total"]]
    for p in m.PLAIN_VARIANTS:
        row = phases.get(p.key, {})
        lines.append([f"({p.key}) {p.label}", *(h.fmt(row.get(k)) for k in _serving.MARK_KEYS),
                      h.fmt(row.get("client"))])
    h.print_table(lines)


def same_model(res: Results) -> dict[str, float]:
    """Max abs difference of each variant's vector from (a)'s (same text)."""
    base = res.vectors.get("a")
    if base is None:
        return {}
    return {key: max(abs(x - y) for x, y in zip(base, vec, strict=True))
            for key, vec in res.vectors.items() if key != "a"}


def run(args: Any, deadline: h.Deadline, res: Results) -> None:
    blob = m.prepare_weights()
    base_url = m.start(args.port or h.free_port())
    print(f"serving at {base_url}; weights {blob}", flush=True)
    for v in m.EMBER_VARIANTS:
        h.section(f"({v.key}) {v.label}", res.errors,
                  functools.partial(run_ember, v, base_url, args.trials, deadline, res))
    res.idle_rss_mb = _serving.idle_worker_rss_mb()
    print(f"idle pre-started workers, RSS [MB]: {res.idle_rss_mb}", flush=True)
    h.section("plain Ray Serve", res.errors,
              lambda: run_plain(base_url, args.trials, deadline, res))


def main() -> int:
    parser = h.parser(__doc__, deadline_s=1500)
    parser.add_argument("--trials", type=int, help="cold starts per variant (5; short 1)")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    args = h.pick(parser.parse_args(), trials=(5, 1))
    _serving.clear_overrides()
    deadline = h.install_deadline(args.deadline_s)
    res = Results()
    try:
        run(args, deadline, res)
    except h.DeadlineExceeded as exc:
        res.errors.append(f"DeadlineExceeded: {exc}")
    finally:
        h.clear_deadline()
        _serving.shutdown()
    rows, phases, diffs = summary(res), phase_table(res), same_model(res)
    print_report(rows, phases, res)
    if any(d > 1e-4 for d in diffs.values()):
        res.errors.append(f"variants disagree with (a) on the same text: {diffs}")
    h.write_results("coldstart", {
        "model": "all-MiniLM-L6-v2 (ember.deployments.embeddings.MiniLM)",
        "complete": not res.errors, "errors": res.errors, "summary": rows,
        "phases_median_s": phases, "same_model_max_abs_diff_vs_a": diffs,
        "warm_hit": "(a) is served by a process that already built the model: a warm hit",
        "idle_warm_worker_rss_mb": res.idle_rss_mb,
        "config": {"trials": args.trials, "scaledown_s": _serving.SCALEDOWN_S,
                   "replica_num_cpus": _serving.REPLICA_CPUS, "quiet_s": m.QUIET_S,
                   "ember_variants": [asdict(v) for v in m.EMBER_VARIANTS],
                   "plain_default_autoscaling": _serving.plain_autoscaling(False),
                   "plain_shrunk_autoscaling": _serving.plain_autoscaling(True),
                   "logging": _serving.LOGGING},
        "raw": {m.LABELS[k]: [asdict(s) for s in v] for k, v in res.cold.items()},
    }, short=args.short)
    if res.errors:
        print("errors: " + "; ".join(res.errors), file=sys.stderr)
    return 0 if not res.errors else 1


if __name__ == "__main__":
    sys.exit(main())
