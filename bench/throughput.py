"""The request path under load: MiniLM on bare FastAPI, LitServe, plain Ray Serve and Ember.

Contenders (one process or replica of the model each, one torch thread, the same model code,
all on 127.0.0.1; the three batching ones at most 32 texts per forward pass and a 5 ms wait):

1. bare FastAPI (``bench/_fastapi_peer.py``): uvicorn, a plain ``def`` endpoint in FastAPI's
   thread pool, one forward pass per request, no batching.
2. LitServe (``bench/_litserve_peer.py``): ``max_batch_size=32``, ``batch_timeout=0.005``.
3. plain Ray Serve (``bench/_rayserve_peer.py``): ``@serve.ingress(FastAPI)``,
   ``@serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)``, one replica,
   ``max_ongoing_requests=32``, behind Serve's HTTP proxy in the same Ray cluster as Ember.
4. Ember (``bench/_batching_apps.py``, ``batched``): the flagship with
   ``ember.Batch(max_size=32, max_wait_ms=5)``, behind Ember's edges.
5. Ember without batching (``unbatched``), for information only: no target reads it.

Every request carries one text. The peers take ``{"text": ...}``; Ember's batch routes take a
bare JSON string as one item (``"..."``), the closest body to it: one text in, one
``{"embedding", "tokens"}`` object out, as from every peer (a one-element array would be
answered by an array). All contenders must return the same vector for the same text (max abs
diff <= 1e-4), checked before any load.

Load: closed loop at concurrency 1 and 32, ``--rounds`` rounds of ``--duration-s`` per
contender and concurrency, contenders interleaved within a round, after ``--warmup-s`` of
untimed load each. Reported per contender: c=1 p50; c=32 req/s, p50 and p99; the mean batch
at c=32 (texts per forward pass, counted by each server's own handler); and the server CPU
per request at c=32: CPU time of the contender's own processes over its own runs, divided by
its requests (Ember: its edges + the model replica; plain Ray Serve: Serve's proxy + its
replica; LitServe and FastAPI: their process trees). The load client, the rest of Ray (GCS,
raylet, Serve's controller), which every Ray contender shares, and the rest of the host are
reported beside them, uncharged. Idle contenders keep running, so their background cost
shows in the others' uncharged columns.

    contender       | c=1 p50 ms | c=32 req/s | c=32 p50 ms | c=32 p99 ms | batch c=32 | CPU ms/req
    ----------------+------------+------------+-------------+-------------+------------+-----------
    bare FastAPI    | ...        | ...        | ...         | ...         | 1.00       | ...
    LitServe        | ...
    plain Ray Serve | ...
    Ember           | ...

Targets (``doc["ratios"]``, each with ``met``): Ember / plain Ray Serve c=32 req/s >= 1.0;
Ember / LitServe c=32 req/s >= 0.8 (stretch); Ember / plain Ray Serve c=1 p50 <= 1.0; Ember
/ plain Ray Serve CPU per request <= 1.0; Ember / plain Ray Serve mean batch at c=32 >= 1.0.

Usage:
    .venv/bin/python bench/throughput.py [--short] [--duration-s 10] [--rounds 2]
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import _batching_apps as apps
import _fastapi_peer as bare
import _harness as h
import _litserve_peer as lit
import _load
import _rayserve_peer as plain
import _serving
import httpx

from ember.edge.edge import EDGE_DEPLOYMENT

CONCURRENCY = (1, 32)
MAX_ABS_DIFF = 1e-4
REFERENCE = "ember"
FASTAPI_GROUP = "bare FastAPI (its process)"
LITSERVE_GROUP = "LitServe (all its processes)"
EMBER_EDGES = _load.replica_group(apps.APP_NAME, EDGE_DEPLOYMENT)
#: (label, numerator, denominator, figure, comparison, target); "c32_rps" etc. of contenders().
RATIOS = (
    ("Ember / plain Ray Serve, c=32 req/s", "ember", "rayserve", "c32_rps", ">=", 1.0),
    ("Ember / LitServe, c=32 req/s (stretch)", "ember", "litserve", "c32_rps", ">=", 0.8),
    ("Ember / plain Ray Serve, c=1 p50", "ember", "rayserve", "c1_p50_ms", "<=", 1.0),
    ("Ember / plain Ray Serve, server CPU per request", "ember", "rayserve",
     "c32_server_cpu_ms_per_request", "<=", 1.0),
    ("Ember / plain Ray Serve, mean batch at c=32", "ember", "rayserve", "c32_mean_batch",
     ">=", 1.0),
)


def targets(base_url: str, lit_url: str, lit_stats: Path, fastapi_url: str,
            rayserve_url: str) -> list[_load.LoadTarget]:
    """The contenders in the order each round runs them, with their counts and processes."""
    replica = _load.replica_group
    return [
        _load.LoadTarget("bare FastAPI", "fastapi", fastapi_url + "/embed",
                         apps.text_object_body, _load.http_counts(fastapi_url + "/stats"),
                         (FASTAPI_GROUP,)),
        _load.LoadTarget("LitServe", "litserve", lit_url + "/predict", apps.text_object_body,
                         lambda _: lit.read_counts(lit_stats), (LITSERVE_GROUP,)),
        _load.LoadTarget("plain Ray Serve", "rayserve", rayserve_url + "/embed",
                         apps.text_object_body, _load.http_counts(rayserve_url + "/stats"),
                         (_load.SERVE_PROXY, replica(plain.APP_NAME, plain.DEPLOYMENT))),
        _load.LoadTarget("Ember", "ember", base_url + "/embed", apps.ember_single_body,
                         _load.http_counts(base_url + "/embed/stats"),
                         (EMBER_EDGES, replica(apps.APP_NAME, "MiniLMBatched"))),
        _load.LoadTarget("Ember unbatched (info)", "ember_unbatched",
                         base_url + "/embed-unbatched", apps.ember_single_body, None,
                         (EMBER_EDGES, replica(apps.APP_NAME, "MiniLMUnbatched"))),
    ]


def same_model(contenders: list[_load.LoadTarget], deadline: h.Deadline) -> dict[str, float]:
    """Max abs difference of each contender's vector for one text from Ember's."""
    with httpx.Client() as client:
        vectors = {t.key: apps.post(client, t.url, t.body(3), deadline)["embedding"]
                   for t in contenders}
    ref = vectors[REFERENCE]
    return {key: max(abs(a - b) for a, b in zip(ref, v, strict=True))
            for key, v in vectors.items() if key != REFERENCE}


def measure_round(target: _load.LoadTarget, c: int, args: Any, deadline: h.Deadline,
                  res: _load.LoadResult, peers: dict[str, set[int]]) -> None:
    """One timed run of ``target`` at ``c``, with its forward-pass counts and CPU by group."""
    calls, items = target.counts(deadline) if target.counts else (0, 0)
    cpu = _load.cpu_snapshot(peers)
    _load.closed_loop(target, c, args.duration_s, deadline, res)
    cpu_after = _load.cpu_snapshot(peers)
    calls_after, items_after = target.counts(deadline) if target.counts else (0, 0)
    res.handler_calls += calls_after - calls
    res.handler_items += items_after - items
    for group, seconds in cpu_after.items():
        res.cpu_s[group] = res.cpu_s.get(group, 0.0) + seconds - cpu.get(group, 0.0)


def run_load(contenders: list[_load.LoadTarget], args: Any, deadline: h.Deadline,
             peers: dict[str, set[int]]) -> dict[str, dict[str, Any]]:
    results = {t.key: {c: _load.LoadResult() for c in CONCURRENCY} for t in contenders}
    for c in CONCURRENCY:
        for target in contenders:
            _load.closed_loop(target, c, args.warmup_s, deadline)
        for rnd in range(1, args.rounds + 1):
            for target in contenders:
                res = results[target.key][c]
                measure_round(target, c, args, deadline, res, peers)
                print(f"  c={c:<3} round {rnd}/{args.rounds} {target.label:<22} "
                      f"{len(res.latencies_ms):6d} ok {res.errors} errors", flush=True)
    return {k: {str(c): r.summary() for c, r in per.items()} for k, per in results.items()}


def contenders_summary(contenders: list[_load.LoadTarget],
                       tp: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per contender: the figures the table and the ratios read, and what CPU was charged."""
    out = {}
    for t in contenders:
        one, many = tp[t.key]["1"], tp[t.key]["32"]
        cpu = many["cpu_ms_per_request"]
        out[t.key] = {
            "label": t.label, "c1_p50_ms": one["p50_ms"], "c32_rps": many["throughput_rps"],
            "c32_p50_ms": many["p50_ms"], "c32_p99_ms": many["p99_ms"],
            "c32_mean_batch": many["items_per_forward_call"],
            "c32_server_cpu_ms_per_request": (sum(cpu.get(g, 0.0) for g in t.cpu_groups)
                                              if cpu else None),
            "server_processes": list(t.cpu_groups),
            "errors": one["errors"] + many["errors"],
            "first_error": one["first_error"] or many["first_error"]}
    return out


def ratios(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name, num, den, figure, op, target in RATIOS:
        value = h.ratio(rows[num][figure], rows[den][figure])
        met = value is not None and (value >= target if op == ">=" else value <= target)
        out.append({"ratio": name, "figure": figure, "value": value,
                    "target": f"{op} {target:g}", "met": met})
    return out


def print_report(contenders: list[_load.LoadTarget], tp: dict[str, dict[str, Any]],
                 rows: dict[str, dict[str, Any]], ratio_rows: list[dict[str, Any]]) -> None:
    print("\nMiniLM, one text per request (batching: at most 32 texts, 5 ms wait)")
    h.print_table([["contender", "c=1 p50 ms", "c=32 req/s", "c=32 p50 ms", "c=32 p99 ms",
                    "batch c=32", "CPU ms/req c=32", "errors"]] + [
        [r["label"], h.fmt(r["c1_p50_ms"], ".1f"), h.fmt(r["c32_rps"], ".1f"),
         h.fmt(r["c32_p50_ms"], ".1f"), h.fmt(r["c32_p99_ms"], ".1f"),
         h.fmt(r["c32_mean_batch"], ".2f"), h.fmt(r["c32_server_cpu_ms_per_request"], ".2f"),
         str(r["errors"])] for r in rows.values()])
    cpu = [tp[t.key]["32"]["cpu_ms_per_request"] for t in contenders]
    groups = sorted({g for row in cpu for g in row}, key=lambda g: (g == _load.HOST_OTHERS, g))
    print("\nCPU per request [ms] by process group, c=32 (* charged to the contender)")
    h.print_table([["process group", *(t.label for t in contenders)]] + [
        [g, *(h.fmt(row.get(g), ".2f") + ("*" if g in t.cpu_groups else "")
              for t, row in zip(contenders, cpu, strict=True))] for g in groups])
    print()
    h.print_table([["ratio", "value", "target", "met"]] + [
        [r["ratio"], h.fmt(r["value"], ".2f"), r["target"], str(r["met"])]
        for r in ratio_rows])


def start_all(args: Any, deadline: h.Deadline, stack: contextlib.ExitStack,
              lit_stats: Path) -> tuple[list[_load.LoadTarget], dict[str, set[int]]]:
    """Every contender up and answering; the load targets and the peers' PIDs by group."""
    # The subprocesses first, so that they load their models while Ray starts.
    lit_server, lit_url = lit.start(deadline, lit_stats)
    stack.callback(lit_server.stop)
    fastapi_server, fastapi_url = bare.start(deadline)
    stack.callback(fastapi_server.stop)
    base_url = apps.start(args.port or h.free_port(), ("batched", "unbatched"), deadline,
                          batch=apps.THROUGHPUT_BATCH)
    rayserve_url = plain.start(apps.MODEL_CPUS, deadline)
    print(f"Ember at {base_url}, plain Ray Serve at {rayserve_url}, LitServe at {lit_url}, "
          f"bare FastAPI at {fastapi_url}", flush=True)
    peers = {LITSERVE_GROUP: {p.pid for p in lit_server.tree()},
             FASTAPI_GROUP: {p.pid for p in fastapi_server.tree()}}
    return targets(base_url, lit_url, lit_stats, fastapi_url, rayserve_url), peers


def run(args: Any, deadline: h.Deadline, doc: dict[str, Any]) -> None:
    with contextlib.ExitStack() as stack:
        lit_stats = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "litserve.json"
        contenders, peers = start_all(args, deadline, stack, lit_stats)
        doc["same_model_max_abs_diff_vs_ember"] = diffs = same_model(contenders, deadline)
        if any(v > MAX_ABS_DIFF for v in diffs.values()):
            raise RuntimeError(f"contenders disagree with Ember on the same text: {diffs}")
        doc["throughput"] = tp = run_load(contenders, args, deadline, peers)
        doc["contenders"] = rows = contenders_summary(contenders, tp)
        doc["ratios"] = ratio_rows = ratios(rows)
        print_report(contenders, tp, rows, ratio_rows)


def main() -> int:
    parser = h.parser(__doc__, deadline_s=900)
    parser.add_argument("--duration-s", type=float, help="seconds per contender, c and round "
                        "(10; short 4)")
    parser.add_argument("--rounds", type=int, help="rounds (2; short 1)")
    parser.add_argument("--warmup-s", type=float, help="untimed load per contender and c "
                        "(3; 1)")
    parser.add_argument("--port", type=int, default=0, help="Ember HTTP port (default: free)")
    args = h.pick(parser.parse_args(), duration_s=(10.0, 4.0), rounds=(2, 1),
                  warmup_s=(3.0, 1.0))
    _serving.clear_overrides()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    doc: dict[str, Any] = {"model": "all-MiniLM-L6-v2"}
    errors: list[str] = []
    with h.deadline_run(args.deadline_s, errors, _serving.shutdown) as deadline:
        h.section("throughput", errors, lambda: run(args, deadline, doc))
    batch = apps.THROUGHPUT_BATCH
    doc.update(complete=not errors, errors=errors, config={
        "duration_s": args.duration_s, "rounds": args.rounds, "warmup_s": args.warmup_s,
        "concurrency": list(CONCURRENCY), "minilm_num_cpus": apps.MODEL_CPUS,
        "torch_threads": 1, "ember_batch": {"max_size": batch.max_size,
                                            "max_wait_ms": batch.max_wait_ms},
        "litserve": lit.CONFIG, "rayserve": plain.CONFIG, "logging": _serving.LOGGING})
    h.write_results("throughput", doc, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
