"""MiniLM throughput at concurrency 1 and 32: Ember batched and unbatched vs LitServe batched.

Servers (``bench/_batching_apps.py``, ``bench/_litserve_peer.py``; one replica or worker each,
one torch thread each, all on 127.0.0.1): Ember's flagship with dynamic batching
(``POST /embed``), Ember without batching (``POST /embed-unbatched``) and LitServe with
batching on (``POST /predict``). Load: closed loop, one text per request, ``--rounds``
rounds of ``--duration-s`` per server and concurrency, servers interleaved within a round,
after ``--warmup-s`` of untimed load. Reported: req/s, p50/p99, texts per forward pass of
the batched flagship, and CPU milliseconds per request of each process group (the load
client, Ray Serve's proxy, Ember's ingress, each replica, the rest of Ray, LitServe, the rest
of the host); idle servers are not stopped, so each one's background cost shows in the
others' columns. Targets at c=32: batched >= 4x unbatched, Ember batched >= LitServe. All
three must return the same vector for the same text (max abs diff <= 1e-4).

Usage:
    .venv/bin/python bench/throughput.py [--short] [--duration-s 10] [--rounds 2]
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import _batching_apps as apps
import _harness as h
import _litserve_peer as lit
import _load
import _serving
import httpx

CONCURRENCY = (1, 32)
MAX_ABS_DIFF = 1e-4


def same_model(base_url: str, lit_url: str, deadline: h.Deadline) -> dict[str, float]:
    """Max abs difference of each server's vector for one text from ``/embed``'s."""
    body = json.dumps([apps.TEXTS[3]]).encode()
    with httpx.Client() as client:
        ref = apps.post(client, base_url + "/embed", body, deadline)[0]["embedding"]
        others = {
            "/embed-unbatched": apps.post(client, base_url + "/embed-unbatched", body,
                                          deadline)[0]["embedding"],
            "litserve /predict": apps.post(client, lit_url + "/predict", lit.text_body(3),
                                           deadline)["embedding"],
        }
    return {k: max(abs(a - b) for a, b in zip(ref, v, strict=True)) for k, v in others.items()}


def measure_round(target: _load.LoadTarget, c: int, args: Any, deadline: h.Deadline,
                  res: _load.LoadResult, peer_pids: set[int]) -> None:
    """One timed run of ``target`` at ``c``, with its handler counts and CPU by group."""
    calls, items = _load.handler_counts(target.stats_url, deadline)
    cpu = _load.cpu_snapshot(peer_pids, apps.APP_NAME)
    _load.closed_loop(target, c, args.duration_s, deadline, res)
    cpu_after = _load.cpu_snapshot(peer_pids, apps.APP_NAME)
    calls_after, items_after = _load.handler_counts(target.stats_url, deadline)
    res.handler_calls += calls_after - calls
    res.handler_items += items_after - items
    for group, seconds in cpu_after.items():
        res.cpu_s[group] = res.cpu_s.get(group, 0.0) + seconds - cpu.get(group, 0.0)


def run_load(targets: list[_load.LoadTarget], args: Any, deadline: h.Deadline,
             peer_pids: set[int]) -> dict[str, dict[str, Any]]:
    results = {t.key: {c: _load.LoadResult() for c in CONCURRENCY} for t in targets}
    for c in CONCURRENCY:
        for target in targets:
            _load.closed_loop(target, c, args.warmup_s, deadline)
        for rnd in range(1, args.rounds + 1):
            for target in targets:
                res = results[target.key][c]
                measure_round(target, c, args, deadline, res, peer_pids)
                print(f"  c={c:<3} round {rnd}/{args.rounds} {target.label:<18} "
                      f"{len(res.latencies_ms):6d} ok {res.errors} errors", flush=True)
    return {k: {str(c): r.summary() for c, r in per.items()} for k, per in results.items()}


def ratios(tp: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    def rps(key: str) -> float | None:
        value: float | None = tp.get(key, {}).get("32", {}).get("throughput_rps")
        return value

    out = []
    for name, num, den, target in (
            ("Ember batched / Ember unbatched, c=32", "batched", "unbatched", 4.0),
            ("Ember batched / LitServe batched, c=32", "batched", "litserve", 1.0),
            ("Ember unbatched / LitServe batched, c=32", "unbatched", "litserve", None)):
        value = h.ratio(rps(num), rps(den))
        met = None if value is None or target is None else value >= target
        out.append({"ratio": name, "value": value,
                    "target": "-" if target is None else f">= {target:g}x",
                    "met": met})
    return out


def print_report(targets: list[_load.LoadTarget], tp: dict[str, dict[str, Any]],
                 ratio_rows: list[dict[str, Any]]) -> None:
    lines = [["server", "c", "requests", "errors", "req/s", "p50 ms", "p99 ms",
              "texts/forward", "req/s vs LitServe"]]
    for c in map(str, CONCURRENCY):
        lit_rps = tp.get("litserve", {}).get(c, {}).get("throughput_rps")
        for t in targets:
            row = tp.get(t.key, {}).get(c)
            if row is not None:
                lines.append([t.label, c, str(row["requests"]), str(row["errors"]),
                              h.fmt(row["throughput_rps"], ".1f"), h.fmt(row["p50_ms"], ".1f"),
                              h.fmt(row["p99_ms"], ".1f"),
                              h.fmt(row["items_per_forward_call"], ".2f"),
                              h.fmt_ratio(row["throughput_rps"], lit_rps)])
    print("\nMiniLM, one text per request: throughput and latency")
    h.print_table(lines)
    rows = [tp.get(t.key, {}).get("32", {}) for t in targets]
    groups = sorted({g for row in rows for g in row.get("cpu_ms_per_request", {})},
                    key=lambda g: (g == _load.HOST_OTHERS, g))
    print("\nCPU per request [ms] by process, c=32")
    h.print_table([["process", *(t.label for t in targets)]] + [
        [g, *(h.fmt(row.get("cpu_ms_per_request", {}).get(g), ".2f") for row in rows)]
        for g in groups])
    print()
    h.print_table([["ratio", "value", "target", "met"]] + [
        [r["ratio"], h.fmt(r["value"], ".2f"), r["target"], str(r["met"])]
        for r in ratio_rows])


def run(args: Any, deadline: h.Deadline, doc: dict[str, Any]) -> None:
    server, lit_url = lit.start(deadline)  # started first: its start-up is then not timed
    try:
        base_url = apps.start(args.port or h.free_port(), ("batched", "unbatched"), deadline)
        doc["same_model_max_abs_diff_vs_embed"] = diffs = same_model(base_url, lit_url,
                                                                     deadline)
        if any(v > MAX_ABS_DIFF for v in diffs.values()):
            raise RuntimeError(f"servers disagree with /embed on the same text: {diffs}")
        targets = [
            _load.LoadTarget("Ember batched", "batched", base_url + "/embed",
                             apps.ember_text_body, base_url + "/embed/stats"),
            _load.LoadTarget("Ember unbatched", "unbatched", base_url + "/embed-unbatched",
                             apps.ember_text_body),
            _load.LoadTarget("LitServe batched", "litserve", lit_url + "/predict",
                             lit.text_body),
        ]
        print(f"Ember at {base_url}, LitServe at {lit_url}", flush=True)
        doc["throughput"] = run_load(targets, args, deadline, {p.pid for p in server.tree()})
        doc["ratios"] = ratios(doc["throughput"])
        print_report(targets, doc["throughput"], doc["ratios"])
    finally:
        server.stop()


def main() -> int:
    parser = h.parser(__doc__, deadline_s=900)
    parser.add_argument("--duration-s", type=float, help="seconds per server, c and round "
                        "(10; short 4)")
    parser.add_argument("--rounds", type=int, help="rounds (2; short 1)")
    parser.add_argument("--warmup-s", type=float, help="untimed load per server and c (3; 1)")
    parser.add_argument("--port", type=int, default=0, help="Ember HTTP port (default: free)")
    args = h.pick(parser.parse_args(), duration_s=(10.0, 4.0), rounds=(2, 1),
                  warmup_s=(3.0, 1.0))
    _serving.clear_overrides()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    doc: dict[str, Any] = {"model": "all-MiniLM-L6-v2"}
    errors: list[str] = []
    with h.deadline_run(args.deadline_s, errors, _serving.shutdown) as deadline:
        h.section("throughput", errors, lambda: run(args, deadline, doc))
    doc.update(complete=not errors, errors=errors, config={
        "duration_s": args.duration_s, "rounds": args.rounds, "warmup_s": args.warmup_s,
        "concurrency": list(CONCURRENCY), "minilm_num_cpus": apps.MODEL_CPUS,
        "torch_threads": 1, "litserve": lit.CONFIG, "logging": _serving.LOGGING})
    h.write_results("throughput", doc, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
