"""What shadowing 20% of requests costs the callers: their p50 with and without it.

Server: the flagship MiniLM as two versions of one deployment (``MiniLM@1`` stable,
``MiniLM@2`` candidate; the same class, each with one warm replica of 0.5 CPU, so no copy
meets a cold start). Callers send one short text per request to ``POST /embed`` in a closed
loop at concurrency 1 and 4; in alternating rounds the edge copies 0% and 20% of requests to
version 2 (``PUT /-/shadow/MiniLM``), and every answer still comes from version 1. The peer
is the same server with shadowing off, measured in the same run: the figure is the ratio of
the callers' p50 (and p99) with 20% shadowed to without.

The candidate here shares the callers' two cores; a copy's forward pass competes with
theirs, so this is the costly case. With the candidate on hardware of its own only the
edge's copy (its dispatch and comparison) would remain.

Usage:
    .venv/bin/python bench/shadow.py [--short] [--round-s 15] [--rounds 3]
"""

from __future__ import annotations

import sys
import time
from typing import Any

import _batching_apps as apps
import _harness as h
import _load
import _minilm_apps
import _serving
import httpx

import ember

APP = "bench-shadow"
SHADOW_PERCENT = 20
CONCURRENCY = (1, 4)
WARMUP_REQUESTS = 20


def build_app() -> ember.App:
    """Two versions of the flagship, one warm replica each, no warm pool."""
    versions = [_minilm_apps.ember_variant("MiniLM", version=label, warm_floor=1,
                                           max_replicas=1) for label in ("1", "2")]
    return ember.App(versions, name=APP, warm_pool=0)


def set_shadow(base_url: str, percent: int, deadline: h.Deadline) -> None:
    """Set the shadow share and wait until every edge answers with it."""
    body = {"to": "2", "percent": percent} if percent else {"percent": 0}
    reply = httpx.put(f"{base_url}/-/shadow/MiniLM", json=body, timeout=30)
    if reply.status_code != 200:
        raise RuntimeError(f"shadow refused: {reply.status_code} {reply.text[:200]}")

    def every_edge() -> bool:
        return all(httpx.get(f"{base_url}/-/shadow/MiniLM", timeout=10).json()["shadow"]
                   ["percent"] == percent for _ in range(10))

    h.wait_until(every_edge, f"every edge shadowing {percent}%", deadline, poll_s=0.5)


def measure(base_url: str, args: Any, deadline: h.Deadline) -> dict[str, Any]:
    target = _load.LoadTarget("MiniLM@1", "stable", f"{base_url}/embed", apps.ember_text_body)
    results: dict[str, dict[int, _load.LoadResult]] = {"off": {}, "shadow": {}}
    for rnd in range(args.rounds):
        for mode, percent in (("off", 0), ("shadow", SHADOW_PERCENT)):
            set_shadow(base_url, percent, deadline)
            for c in CONCURRENCY:
                into = results[mode].setdefault(c, _load.LoadResult())
                _load.closed_loop(target, c, args.round_s, deadline, into)
            print(f"  round {rnd + 1}/{args.rounds}: {mode} done", flush=True)
    set_shadow(base_url, 0, deadline)
    out: dict[str, Any] = {}
    for c in CONCURRENCY:
        off, shadow = results["off"][c].summary(), results["shadow"][c].summary()
        out[f"c{c}"] = {"off": off, "shadow_20": shadow,
                        "p50_ratio": h.ratio(shadow["p50_ms"], off["p50_ms"]),
                        "p99_ratio": h.ratio(shadow["p99_ms"], off["p99_ms"]),
                        "throughput_ratio": h.ratio(shadow["throughput_rps"],
                                                    off["throughput_rps"])}
    return out


def copies_compared(base_url: str) -> float:
    """Shadow comparisons the edges counted (all edges), to show copies really ran."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "ember_shadow_requests_total")


def print_summary(doc: dict[str, Any]) -> None:
    lines = [["concurrency", "p50 off ms", "p50 20% ms", "p50 ratio", "p99 ratio",
              "req/s ratio"]]
    for c in CONCURRENCY:
        row = doc["latency"][f"c{c}"]
        lines.append([str(c), h.fmt(row["off"]["p50_ms"], ".2f"),
                      h.fmt(row["shadow_20"]["p50_ms"], ".2f"), h.fmt(row["p50_ratio"], ".3f"),
                      h.fmt(row["p99_ratio"], ".3f"), h.fmt(row["throughput_ratio"], ".3f")])
    print(f"\nCallers' latency with {SHADOW_PERCENT}% of requests shadowed vs none "
          f"(MiniLM, same run); {doc['copies_compared']:.0f} copies compared")
    h.print_table(lines)


def run(args: Any, deadline: h.Deadline, doc: dict[str, Any]) -> None:
    base_url = _serving.start_serve(args.port or h.free_port(), preload=(_minilm_apps.__name__,))
    _serving.deploy_ember(build_app(), deadline)
    h.wait_until(lambda: h.http_ok(base_url + "/readyz"), "the app ready", deadline, poll_s=0.5)
    for version in ("1", "2"):  # both replicas warm before anything is timed
        with httpx.Client(headers={"X-Ember-Version": version}) as client:
            for i in range(WARMUP_REQUESTS):
                apps.post(client, f"{base_url}/embed", apps.ember_text_body(i), deadline)
    time.sleep(1.0)
    doc["latency"] = measure(base_url, args, deadline)
    doc["copies_compared"] = copies_compared(base_url)
    print_summary(doc)


def main() -> int:
    parser = h.parser(__doc__, deadline_s=900)
    parser.add_argument("--round-s", type=float, help="seconds per mode, concurrency and round "
                        "(15; short 5)")
    parser.add_argument("--rounds", type=int, help="rounds of off then 20%% (3; short 1)")
    parser.add_argument("--port", type=int, default=0, help="Ember HTTP port (default: free)")
    args = h.pick(parser.parse_args(), round_s=(15.0, 5.0), rounds=(3, 1))
    _serving.clear_overrides()
    doc: dict[str, Any] = {"model": "all-MiniLM-L6-v2", "shadow_percent": SHADOW_PERCENT}
    errors: list[str] = []
    with h.deadline_run(args.deadline_s, errors, _serving.shutdown) as deadline:
        h.section("shadow", errors, lambda: run(args, deadline, doc))
    doc.update(complete=not errors, errors=errors, config={
        "round_s": args.round_s, "rounds": args.rounds, "concurrency": list(CONCURRENCY),
        "replica_num_cpus": _serving.REPLICA_CPUS, "warmup_requests": WARMUP_REQUESTS})
    h.write_results("shadow", doc, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
