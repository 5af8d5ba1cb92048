"""Per-call cost curves t(b) = o/b + c through Ember over HTTP: batched vs unbatched MiniLM.

Servers (``bench/_batching_apps.py``): the seed MLP over Open Inference v2
(``POST /v2/models/mlp/infer``, shape [b, 256] FP32), the MiniLM flagship with dynamic
batching (``POST /embed``) and the same without batching (``POST /embed-unbatched``, the
peer), b short texts. For b = 1, 2, 4 ... requests each carrying b items are sent one
after another (``--sweep-warmup`` untimed, then ``--sweep-reps`` timed; T(b) is their
median) and t(b) = T(b)/b. o and c are fitted by least squares of t(b) on 1/b (so
T(b) = o + c*b); R^2 is given for t(b) and for T(b). A request below the batch size also
waits the partial-batch timer (2 ms MLP, 5 ms MiniLM ``/embed``); MiniLM runs at most 64
texts per forward pass. A MiniLM sweep stops early when its next size would take over
``SWEEP_STEP_CAP_S``.

Usage:
    .venv/bin/python bench/batching_curve.py [--short] [--sweep-reps 5] [--minilm-max-batch 512]
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import _batching_apps as apps
import _harness as h
import _serving
import httpx

SIZES = tuple(2**i for i in range(10))  # 1 .. 512
SWEEP_STEP_CAP_S = 60.0


@dataclass
class Sweep:
    key: str
    label: str
    path: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    fit: dict[str, float] = field(default_factory=dict)
    note: str = ""


def fit_cost(sizes: list[int], totals_ms: list[float]) -> dict[str, float]:
    """Least squares of t(b) = o/b + c (t = T/b) on x = 1/b; R^2 in t and in T."""
    xs = [1.0 / b for b in sizes]
    ts = [t / b for t, b in zip(totals_ms, sizes, strict=True)]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    sxx = sum((x - mx) ** 2 for x in xs)
    o = sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True)) / sxx
    c = mt - o * mx

    def r2(actual: list[float], predicted: list[float]) -> float:
        mean = statistics.fmean(actual)
        ss_tot = sum((a - mean) ** 2 for a in actual)
        ss_res = sum((a - p) ** 2 for a, p in zip(actual, predicted, strict=True))
        return 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0

    return {"o_ms": o, "c_ms_per_item": c,
            "r2_t": r2(ts, [o / b + c for b in sizes]),
            "r2_T": r2(totals_ms, [o + c * b for b in sizes]),
            "items_per_s_limit": 1000.0 / c if c > 0 else float("inf")}


def too_slow(sweep: Sweep, args: Any, cap_s: float | None) -> bool:
    """Whether the next size (about twice the last T) would take over ``cap_s``."""
    if cap_s is None or not sweep.rows:
        return False
    expected = 2 * sweep.rows[-1]["T_ms"] / 1000.0 * (args.sweep_reps + args.sweep_warmup)
    if expected > cap_s:
        sweep.note = f"stopped before b={2 * sweep.rows[-1]['b']}: ~{expected:.0f}s expected"
        print(f"  {sweep.note}", flush=True)
    return bool(expected > cap_s)


def run_sweep(sweep: Sweep, base_url: str, sizes: tuple[int, ...],
              make: Callable[[int], bytes], check: Callable[[Any, int], None], args: Any,
              deadline: h.Deadline, cap_s: float | None) -> None:
    print(f"sweep {sweep.label}", flush=True)
    url = base_url + sweep.path
    with httpx.Client() as client:
        for b in sizes:
            if too_slow(sweep, args, cap_s):
                break
            body = make(b)
            for _ in range(args.sweep_warmup):
                check(apps.post(client, url, body, deadline), b)
            samples = []
            for _ in range(args.sweep_reps):
                sent = time.perf_counter()
                reply = apps.post(client, url, body, deadline)
                samples.append((time.perf_counter() - sent) * 1000.0)
                check(reply, b)
            total = statistics.median(samples)
            sweep.rows.append({"b": b, "T_ms": total, "t_ms_per_item": total / b,
                               "items_per_s": b / total * 1000.0, "samples_ms": samples})
            print(f"  b={b:<4} T={total:9.2f} ms  t={total / b:8.3f} ms/item", flush=True)
    if len(sweep.rows) >= 2:
        sweep.fit = fit_cost([r["b"] for r in sweep.rows], [r["T_ms"] for r in sweep.rows])


def print_sweeps(sweeps: list[Sweep]) -> None:
    """Batched vs unbatched MiniLM side by side, then each fit with its gain over b = 1."""
    by_key = {s.key: {r["b"]: r for r in s.rows} for s in sweeps}
    lines = [["b", "MLP t ms/item", "MiniLM batched t", "MiniLM unbatched t",
              "unbatched / batched"]]
    for b in SIZES:
        t = {k: by_key.get(k, {}).get(b, {}).get("t_ms_per_item") for k in by_key}
        if any(v is not None for v in t.values()):
            lines.append([str(b), h.fmt(t.get("mlp")), h.fmt(t.get("batched")),
                          h.fmt(t.get("unbatched")),
                          h.fmt_ratio(t.get("unbatched"), t.get("batched"))])
    print()
    h.print_table(lines)
    lines = [["curve", "o [ms]", "c [ms/item]", "R^2 t", "R^2 T", "items/s b=1",
              "items/s largest b", "gain"]]
    for s in sweeps:
        if s.fit:
            first, last = s.rows[0], s.rows[-1]
            lines.append([s.label, h.fmt(s.fit["o_ms"], ".2f"),
                          h.fmt(s.fit["c_ms_per_item"], ".4f"), h.fmt(s.fit["r2_t"], ".4f"),
                          h.fmt(s.fit["r2_T"], ".4f"), h.fmt(first["items_per_s"], ".1f"),
                          f"{last['items_per_s']:.1f} (b={last['b']})",
                          h.fmt_ratio(last["items_per_s"], first["items_per_s"], ".1f")])
    print()
    h.print_table(lines)
    for s in sweeps:
        if s.note:
            print(f"note ({s.label}): {s.note}")


def run(args: Any, deadline: h.Deadline, sweeps: list[Sweep], errors: list[str]) -> None:
    base_url = apps.start(args.port or h.free_port(), ("mlp", "batched", "unbatched"),
                          deadline)
    minilm = tuple(b for b in SIZES if b <= args.minilm_max_batch)
    plan = [
        (Sweep("mlp", "seed MLP 256->512->16, Ember OIP", "/v2/models/mlp/infer"), SIZES,
         apps.mlp_body, apps.check_mlp, None),
        (Sweep("batched", "MiniLM, Ember batched flagship", "/embed"), minilm,
         apps.minilm_body, apps.check_minilm, SWEEP_STEP_CAP_S),
        (Sweep("unbatched", "MiniLM, Ember unbatched", "/embed-unbatched"), minilm,
         apps.minilm_body, apps.check_minilm, SWEEP_STEP_CAP_S),
    ]
    for sweep, sizes, make, check, cap in plan:
        sweeps.append(sweep)
        h.section(sweep.label, errors, functools.partial(
            run_sweep, sweep, base_url, sizes, make, check, args, deadline, cap))


def main() -> int:
    parser = h.parser(__doc__, deadline_s=1200)
    parser.add_argument("--sweep-reps", type=int, help="timed requests per b (5; short 3)")
    parser.add_argument("--sweep-warmup", type=int, help="untimed requests per b (2; short 1)")
    parser.add_argument("--minilm-max-batch", type=int, help="largest MiniLM b (512; short 64)")
    parser.add_argument("--port", type=int, default=0, help="Ember HTTP port (default: free)")
    args = h.pick(parser.parse_args(), sweep_reps=(5, 3), sweep_warmup=(2, 1),
                  minilm_max_batch=(512, 64))
    _serving.clear_overrides()
    sweeps: list[Sweep] = []
    errors: list[str] = []
    with h.deadline_run(args.deadline_s, errors, _serving.shutdown) as deadline:
        h.section("start", errors, lambda: run(args, deadline, sweeps, errors))
    print_sweeps([s for s in sweeps if s.rows])
    h.write_results("batching_curve", {
        "complete": not errors, "errors": errors,
        "fits": {s.key: s.fit for s in sweeps},
        "config": {"sweep_reps": args.sweep_reps, "sweep_warmup": args.sweep_warmup,
                   "minilm_max_batch": args.minilm_max_batch,
                   "minilm_num_cpus": apps.MODEL_CPUS, "torch_threads": 1,
                   "step_cap_s": SWEEP_STEP_CAP_S},
        "curves": [asdict(s) for s in sweeps],
    }, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
