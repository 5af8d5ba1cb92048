"""Ember's prefix router against Ray Serve's default router, on the same workload, in one run.

Two apps are served side by side on one local cluster, each with two replicas of the same
small Llama (seeded random weights, one token per character, built once under
``~/.cache/ember-bench``) running Ember's generation engine with its prefix cache; they
differ only in the deployment's ``router``: ``"prefix"`` (Ember's, ``prefix_max_queue_gap``
8) or Ray Serve's default power of two choices. Each round sends both apps the same
requests over HTTP through Ember's edge: a few fresh shared prefixes (600 characters, so
600 tokens; a conversation's system prompt) each followed by a short question of its own,
in a seeded shuffled order, from ``--concurrency`` closed-loop clients, 2 output tokens
each. The apps take turns going first.

Reported per contender: the prefix cache hit rate (prompt tokens the replica found cached,
over all prompt tokens, as the engine reports them per request) and the share of requests
that hit at all, and TTFT (request sent to the first streamed chunk) p50, p99 and mean; then
the ratios of the TTFTs (prefix router over default) and the hit rates side by side. With
most requests hits under either router, the p50 is a hit's TTFT under both; the misses the
prefix router saves show in the mean.

Usage:
    [EMBER_BENCH_PREFIX_MODEL=6m] .venv/bin/python bench/prefix_routing.py [--short]
        [--rounds 3] [--prefixes 4] [--per-prefix 6] [--concurrency 4]

The 27M-parameter model (default) writes ``prefix_routing[.short].json``; the 6M one,
``prefix_routing_6m[.short].json``; ``EMBER_BENCH_PREFIX_GAP=N`` (default 8) sets the
router's ``prefix_max_queue_gap`` and adds ``_gapN`` to the name.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import statistics
import sys
import time
from typing import Any

import _harness as h
import _prefix_apps as apps  # Ray workers import it by name: bench/ is on their path too
import _serving
import httpx
from llm import ALPHABET, build_model

PREFIX_CHARS = 600
CONTENDERS = ("ember_prefix_router", "ray_default_router")


def workload(round_no: int, prefixes: int, per_prefix: int, seed: int) -> list[str]:
    """Fresh prefixes for this round, each with questions of its own, shuffled."""
    rng = random.Random(seed * 1000 + round_no)
    heads = ["".join(rng.choice(ALPHABET) for _ in range(PREFIX_CHARS)) for _ in range(prefixes)]
    prompts = [f"{head} Q{n}: {rng.randrange(10**6)}?" for head in heads
               for n in range(per_prefix)]
    rng.shuffle(prompts)
    return prompts


async def one(client: httpx.AsyncClient, url: str, prompt: str) -> dict[str, Any]:
    """Stream one request; TTFT and what the engine says it found cached."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    sent = time.perf_counter()
    first: dict[str, Any] | None = None
    async with client.stream("POST", f"{url}/gen", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():  # read to the end: the request is done then
            if first is None and line.startswith("data: "):
                chunk = json.loads(line[6:])
                first = {"ttft_s": time.perf_counter() - sent,
                         "prompt_tokens": chunk["prompt_tokens"],
                         "cached_tokens": chunk["cached_tokens"]}
    if first is not None:
        return first
    raise RuntimeError(f"no chunk for a request to {url}")


async def run_round(url: str, prompts: list[str], concurrency: int) -> list[dict[str, Any]]:
    queue, out = list(prompts), []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            out.append(await one(client, url, queue.pop(0)))

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return out


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    ttft = [r["ttft_s"] for r in results]
    return {"requests": len(results), "token_hit_rate": cached / prompt if prompt else None,
            "request_hit_rate": sum(r["cached_tokens"] > 0 for r in results) / len(results),
            "ttft_s": h.p50_p99(ttft), "ttft_mean_s": statistics.fmean(ttft)}


def measure(args: Any, urls: dict[str, str], deadline: h.Deadline) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    every: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    for r in range(args.rounds):
        prompts = workload(r, args.prefixes, args.per_prefix, args.seed)
        order = CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]
        for name in order:
            deadline.left()
            results = asyncio.run(run_round(urls[name], prompts, args.concurrency))
            every[name] += results
            rounds[name].append(summary(results))
            s = rounds[name][-1]
            print(f"round {r} {name}: hit rate {s['token_hit_rate']:.2f}, TTFT p50 "
                  f"{s['ttft_s']['p50']:.3f} s", flush=True)
    return {"rounds": rounds, "overall": {c: summary(every[c]) for c in CONTENDERS}}


def ratios(measured: dict[str, Any]) -> dict[str, Any]:
    ours, peer = (measured["rounds"][c] for c in CONTENDERS)
    per_round = [h.ratio(a["ttft_s"]["p50"], b["ttft_s"]["p50"]) for a, b in zip(ours, peer,
                                                                                 strict=True)]
    o, p = (measured["overall"][c] for c in CONTENDERS)
    return {"ttft_mean_prefix_over_default": h.ratio(o["ttft_mean_s"], p["ttft_mean_s"]),
            "ttft_p50_prefix_over_default": {
                "overall": h.ratio(o["ttft_s"]["p50"], p["ttft_s"]["p50"]),
                "median_round": statistics.median([x for x in per_round if x is not None]),
                "rounds": per_round},
            "token_hit_rate": {"prefix": o["token_hit_rate"], "default": p["token_hit_rate"]},
            "request_hit_rate": {"prefix": o["request_hit_rate"],
                                 "default": p["request_hit_rate"]}}


def main() -> int:
    cli = h.parser(__doc__, deadline_s=600)
    for flag in ("rounds", "prefixes", "per_prefix", "concurrency"):
        cli.add_argument(f"--{flag.replace('_', '-')}", type=int)
    cli.add_argument("--seed", type=int, default=0)
    cli.add_argument("--model", choices=sorted(apps.MODELS), default=apps.MODEL,
                     help="set through EMBER_BENCH_PREFIX_MODEL, which the replicas read")
    args = h.pick(cli.parse_args(), rounds=(5, 3), prefixes=(6, 4), per_prefix=(8, 6),
                  concurrency=(4, 4))
    if args.model != apps.MODEL:
        raise SystemExit(f"run with EMBER_BENCH_PREFIX_MODEL={args.model}: the replicas read it")
    build_model(apps.MODEL_DIR, **apps.SIZES)
    errors: list[str] = []
    data: dict[str, Any] = {"config": {**vars(args), "prefix_chars": PREFIX_CHARS,
                                       "prefix_max_queue_gap": apps.GAP,
                                       "model": apps.SIZES, "max_tokens": 2}}
    with h.deadline_run(args.deadline_s, errors, _serving.shutdown) as deadline:
        import ember

        _serving.start_serve(h.free_port())
        urls = {CONTENDERS[0]: ember.serve(apps.prefix_app, port=h.free_port()),
                CONTENDERS[1]: ember.serve(apps.default_app, port=h.free_port())}
        for url in urls.values():
            h.wait_until(functools.partial(h.http_ok, f"{url}/readyz"), "app ready", deadline)

        def run() -> None:
            data.update(measure(args, urls, deadline))
            data["ratios"] = ratios(data)

        h.section("measure", errors, run)
    if "ratios" in data:
        o, p = (data["overall"][c] for c in CONTENDERS)
        h.print_table([["contender", "token hit rate", "request hit rate", "TTFT p50", "p99",
                        "mean"],
                       *[[c, h.fmt(s["token_hit_rate"], ".2f"), h.fmt(s["request_hit_rate"],
                          ".2f"), h.fmt(s["ttft_s"]["p50"]), h.fmt(s["ttft_s"]["p99"]),
                          h.fmt(s["ttft_mean_s"])]
                         for c, s in ((CONTENDERS[0], o), (CONTENDERS[1], p))]])
        print("TTFT prefix/default: p50", h.fmt_ratio(o["ttft_s"]["p50"], p["ttft_s"]["p50"]),
              "mean", h.fmt_ratio(o["ttft_mean_s"], p["ttft_mean_s"]), flush=True)
    data["errors"] = errors
    name = "prefix_routing" if args.model == "27m" else f"prefix_routing_{args.model}"
    name += "" if apps.GAP == 8 else f"_gap{apps.GAP}"
    h.write_results(name, data, short=args.short)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
