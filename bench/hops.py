"""Overhead per pipeline stage hop: MiniLM as a 3-stage Ember pipeline vs one deployment.

Servers (``bench/_batching_apps.py``): the flagship's three stages ``Tokenize -> Encode ->
Pool`` as an Ember pipeline (``POST /embed-pipeline``), against the same work in a single
deployment without batching (``POST /embed-unbatched``, the peer: no batch timer on either
side) and, for reference, the batched flagship (``POST /embed``, which at concurrency 1 also
waits its 5 ms batch timer). Warm latency at concurrency 1 (sequential requests, one short
text), after 20 untimed requests per server, servers interleaved by round. Per-hop
overhead = (pipeline - single) / 2 hops, on p50 and on the mean.

Usage:
    .venv/bin/python bench/hops.py [--short] [--hop-requests 100] [--hop-rounds 3]
"""

from __future__ import annotations

import sys
import time
from typing import Any

import _batching_apps as apps
import _harness as h
import _serving
import httpx

TARGETS = (("pipeline", "Ember pipeline, 3 stages", "/embed-pipeline"),
           ("unbatched", "Ember single, unbatched", "/embed-unbatched"),
           ("batched", "Ember single, batched", "/embed"))
WARMUP_REQUESTS = 20
HOPS = 2


def measure(base_url: str, args: Any, deadline: h.Deadline) -> dict[str, list[float]]:
    """Milliseconds per request of each target, interleaved by round."""
    latencies: dict[str, list[float]] = {key: [] for key, _, _ in TARGETS}
    with httpx.Client() as client:
        for _, _, path in TARGETS:
            for i in range(WARMUP_REQUESTS):
                apps.check_minilm(apps.post(client, base_url + path,
                                            apps.ember_text_body(i), deadline), 1)
        for rnd in range(args.hop_rounds):
            for key, _, path in TARGETS:
                for i in range(args.hop_requests):
                    body = apps.ember_text_body(rnd * args.hop_requests + i)
                    sent = time.perf_counter()
                    apps.post(client, base_url + path, body, deadline)
                    latencies[key].append((time.perf_counter() - sent) * 1000.0)
            print(f"  hop round {rnd + 1}/{args.hop_rounds} done", flush=True)
    return latencies


def summary(latencies: dict[str, list[float]]) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {key: {"label": label, "requests": len(latencies[key]),
                  **{f"{k}_ms": v for k, v in h.p50_p99(latencies[key]).items()}}
            for key, label, _ in TARGETS if latencies.get(key)}
    out: dict[str, Any] = {"latency": rows, "hops": HOPS}
    pipe = rows.get("pipeline")
    for ref in ("unbatched", "batched"):
        single = rows.get(ref)
        if pipe and single:
            out[f"per_hop_vs_{ref}"] = {
                "p50_ms": (pipe["p50_ms"] - single["p50_ms"]) / HOPS,
                "mean_ms": (pipe["mean_ms"] - single["mean_ms"]) / HOPS,
                "pipeline_over_single_p50": h.ratio(pipe["p50_ms"], single["p50_ms"]),
            }
    return out


def print_summary(doc: dict[str, Any]) -> None:
    single = doc["latency"].get("unbatched", {}).get("p50_ms")
    lines = [["server", "requests", "p50 ms", "p99 ms", "mean ms", "p50 / single unbatched"]]
    for row in doc["latency"].values():
        lines.append([row["label"], str(row["requests"]), h.fmt(row["p50_ms"], ".2f"),
                      h.fmt(row["p99_ms"], ".2f"), h.fmt(row["mean_ms"], ".2f"),
                      h.fmt_ratio(row["p50_ms"], single)])
    print("\nPipeline (Tokenize -> Encode -> Pool) vs single deployment, c=1, one short text")
    h.print_table(lines)
    for ref, what in (("unbatched", "single unbatched (primary)"),
                      ("batched", "single batched, incl. its 5 ms batch timer")):
        per = doc.get(f"per_hop_vs_{ref}")
        if per:
            print(f"per-hop overhead vs {what}: p50 {per['p50_ms']:.2f} ms, "
                  f"mean {per['mean_ms']:.2f} ms  ((pipeline - single) / {HOPS} hops)")


def run(args: Any, deadline: h.Deadline, doc: dict[str, Any]) -> None:
    base_url = apps.start(args.port or h.free_port(), ("batched", "unbatched", "pipeline"),
                          deadline)
    print(f"Ember at {base_url}", flush=True)
    doc.update(summary(measure(base_url, args, deadline)))
    print_summary(doc)


def main() -> int:
    parser = h.parser(__doc__, deadline_s=900)
    parser.add_argument("--hop-requests", type=int,
                        help="sequential requests per server and round (100; short 40)")
    parser.add_argument("--hop-rounds", type=int, help="rounds (3; short 1)")
    parser.add_argument("--port", type=int, default=0, help="Ember HTTP port (default: free)")
    args = h.pick(parser.parse_args(), hop_requests=(100, 40), hop_rounds=(3, 1))
    _serving.clear_overrides()
    doc: dict[str, Any] = {"model": "all-MiniLM-L6-v2"}
    errors: list[str] = []
    with h.deadline_run(args.deadline_s, errors, _serving.shutdown) as deadline:
        h.section("hops", errors, lambda: run(args, deadline, doc))
    doc.update(complete=not errors, errors=errors, config={
        "hop_requests": args.hop_requests, "hop_rounds": args.hop_rounds,
        "warmup_requests": WARMUP_REQUESTS, "stage_num_cpus": apps.STAGE_CPUS,
        "minilm_num_cpus": apps.MODEL_CPUS, "torch_threads": 1})
    h.write_results("hops", doc, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
