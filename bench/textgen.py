"""Continuous batching against static batching and one request at a time, in one run.

The same engine, model and requests three ways: ``continuous`` (sequences join and leave the
batch at every step, ``max_num_seqs=16``), ``static`` (a batch of up to 16 starts when the
previous one is done and runs until its longest sequence ends, finished ones still computed)
and ``one at a time`` (``max_num_seqs=1``). 16 closed-loop clients (c=16) each send their
next request when the last one is answered; output lengths are drawn (seeded) from 8, 16,
32, 64, 128 and 256 tokens and forced (EOS ignored, as serving benchmarks do), prompts are
short lines of Python's docs. The engine runs in this process on one torch thread, as in a
``num_cpus=1`` replica, so the figures are the scheduler's, without HTTP.

Reported per mode: output tokens/s over the run, TTFT (request sent to first token) p50 and
p99, inter-token latency p50/p99; then the ratios the issue asks for. Continuous and static
run ``--rounds`` times, alternating, and the median round of each is reported (every round
is in the JSON).

Usage:
    .venv/bin/python bench/textgen.py [--short] [--requests 48] [--rounds 3] [--concurrency 16]
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from typing import Any

import _harness as h
import torch

from ember.deployments._textgen_engine import Engine, EngineConfig
from ember.deployments._textgen_sampling import SamplingParams
from ember.deployments.textgen import load_backend

LENGTHS = (8, 16, 32, 64, 128, 256)
PROMPTS = ("Return the", "The socket module", "If the file", "Copyright (c)",
           "This function", "A list of", "Raise ValueError", "class Path")
MODES: dict[str, dict[str, Any]] = {
    "continuous": {"max_num_seqs": 16, "mode": "continuous"},
    "static": {"max_num_seqs": 16, "mode": "static", "static_wait_s": 0.05},
    "one_at_a_time": {"max_num_seqs": 1, "mode": "continuous"},
}


def workload(requests: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(rng.choice(PROMPTS), rng.choice(LENGTHS)) for _ in range(requests)]


async def run_mode(name: str, work: list[tuple[str, int]], concurrency: int) -> dict[str, Any]:
    backend = load_backend()
    backend.eos_token_id = None  # forced lengths: every request makes exactly its tokens
    engine = Engine(backend, EngineConfig(max_waiting_seqs=len(work), **MODES[name]))
    queue = list(work)
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        while queue:
            prompt, length = queue.pop(0)
            sent = last = time.perf_counter()  # last: the previous token's arrival
            params = SamplingParams(max_tokens=length, temperature=0)
            async for chunk in engine.generate(backend.encode(prompt), params):
                now = time.perf_counter()
                if chunk.completion_tokens == 1:
                    ttft.append(now - sent)
                else:
                    itl.append(now - last)
                last = now
                tokens += len(chunk.token_ids)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    took = time.perf_counter() - started
    await engine.close()
    return {"name": name, "engine": MODES[name], "requests": len(work), "tokens": tokens,
            "seconds": took, "tokens_per_s": tokens / took, "steps": engine.steps,
            "ttft_s": h.p50_p99(ttft), "itl_s": h.p50_p99(itl)}


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median tokens/s (its TTFT and ITL come with it), all rounds kept."""
    ordered = sorted(rounds, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "rounds": rounds}


def report(results: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Print the table and the ratios the issue asks for; return the ratios."""
    rows = [["mode", "tokens/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms",
             "steps"]]
    for r in results.values():
        rows.append([r["name"], f"{r['tokens_per_s']:.0f}", h.fmt(r["ttft_s"]["p50"]),
                     h.fmt(r["ttft_s"]["p99"]), h.fmt(r["itl_s"]["p50"] * 1e3, ".2f"),
                     h.fmt(r["itl_s"]["p99"] * 1e3, ".2f"), str(r["steps"])])
    print()
    h.print_table(rows)
    tps = {k: v["tokens_per_s"] for k, v in results.items()}
    p99 = {k: v["ttft_s"]["p99"] for k, v in results.items()}
    ratios = {
        "continuous_over_static_tokens_per_s": h.ratio(tps.get("continuous"), tps.get("static")),
        "continuous_over_one_at_a_time_tokens_per_s": h.ratio(tps.get("continuous"),
                                                              tps.get("one_at_a_time")),
        "static_over_continuous_ttft_p99": h.ratio(p99.get("static"), p99.get("continuous")),
    }
    print()
    for key, value in ratios.items():
        print(f"{key}: {h.fmt(value, '.2f')}")
    return ratios


def main() -> int:
    parser = h.parser(__doc__, deadline_s=900)
    parser.add_argument("--requests", type=int, help="requests per mode and round (48; short 32)")
    parser.add_argument("--rounds", type=int, help="rounds of continuous and static (3; short 1)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = h.pick(parser.parse_args(), requests=(48, 32), rounds=(3, 1))
    torch.set_num_threads(1)
    work = workload(args.requests, args.seed)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in MODES}
    errors: list[str] = []
    # Continuous and static alternate, round after round, so a neighbour's burst of CPU on a
    # shared machine hits both; one at a time is slow and runs once.
    plan = [m for _ in range(args.rounds) for m in ("continuous", "static")] + ["one_at_a_time"]
    with h.deadline_run(args.deadline_s, errors):
        for i, name in enumerate(plan):
            def one(mode: str = name) -> None:
                r = asyncio.run(run_mode(mode, work, args.concurrency))
                rounds[mode].append(r)
                print(f"{mode}: {r['tokens_per_s']:.0f} tokens/s, ttft p99 "
                      f"{r['ttft_s']['p99']:.3f} s", flush=True)
            h.section(f"{name} #{i}", errors, one)
    results = {name: median_round(rs) for name, rs in rounds.items() if rs}
    ratios = report(results)
    h.write_results("textgen", {
        "complete": not errors, "errors": errors, "ratios": ratios,
        "config": {"requests": args.requests, "rounds": args.rounds,
                   "concurrency": args.concurrency,
                   "lengths": LENGTHS, "seed": args.seed, "torch_threads": 1},
        "modes": results,
    }, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
