"""Continuous batching against static and one at a time, end to end through Ember's HTTP path.

``bench/textgen.py`` compares the three schedules in one process (the engine's own figures);
this compares them as a caller meets them: HTTP to Ember's edge, one Ray hop to the replica,
tokens streamed back as server-sent events. Three deployments of the same model and engine
in one app differ only in their schedule (``MODES`` of ``bench/textgen.py``): each keeps one
warm replica of one torch thread, and only the one being measured has work. 16 closed-loop
clients stream from ``POST /gen-<mode>``; output lengths are drawn (seeded) from 8 to 256
tokens and forced with ``ignore_eos``, as serving benchmarks do. Continuous and static
alternate for ``--rounds`` rounds (median round reported); one at a time runs once.

Reported per mode: output tokens/s, time to first token (request sent to the first event
holding a token) p50/p99; then continuous over static and over one at a time.

Usage:
    .venv/bin/python bench/textgen_http.py [--short] [--requests 48] [--rounds 3]
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import _harness as h
import _serving
import httpx
from textgen import MODES, median_round, report, workload

import ember
from ember.deployments._textgen_engine import EngineConfig
from ember.deployments.textgen import Generator, load_backend
from ember.protocols import GenerateRequest

APP = "bench-textgen-http"


def _deployment(mode: str) -> type:
    engine = EngineConfig(max_waiting_seqs=256, name=mode, **MODES[mode])

    class Gen:
        def setup(self) -> None:
            import torch

            torch.set_num_threads(1)  # as bench/textgen.py: one thread per replica
            self.generator = Generator(load_backend(), engine)

        def warmup(self) -> None:
            self.generator.warmup()

        async def generate(self, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
            async for chunk in self.generator.stream(body):
                yield chunk

    Gen.__name__ = Gen.__qualname__ = f"Gen_{mode}"
    route = ember.route(f"/gen-{mode.replace('_', '-')}")
    Gen.generate = route(_serving.resolved_hints(Gen.generate))  # type: ignore[method-assign]
    return ember.deployment(name=f"Gen_{mode}", warm_floor=1, max_replicas=1, num_cpus=0.5,
                            max_ongoing_requests=96, max_queue=256,
                            request_timeout_s=600)(Gen)


def build_app() -> ember.App:
    return ember.App([_deployment(mode) for mode in MODES], name=APP, warm_pool=0)


async def run_mode(base_url: str, mode: str, work: list[tuple[str, int]],
                   concurrency: int) -> dict[str, Any]:
    url = f"{base_url}/gen-{mode.replace('_', '-')}"
    queue = list(work)
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            prompt, length = queue.pop(0)
            body = {"prompt": prompt, "max_tokens": length, "temperature": 0,
                    "ignore_eos": True}
            sent = last = time.perf_counter()
            first = True
            async with http.stream("POST", url, json=body) as reply:
                if reply.status_code != 200:
                    raise RuntimeError(f"{url} -> {reply.status_code}")
                async for line in reply.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    got = int(json.loads(line[6:]).get("tokens", 0))
                    if not got:
                        continue
                    now = time.perf_counter()
                    (ttft if first else itl).append(now - (sent if first else last))
                    first, last = False, now
                    tokens += got

    started = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    took = time.perf_counter() - started
    expected = sum(length for _, length in work)
    if tokens != expected:
        raise RuntimeError(f"{mode}: {tokens} tokens streamed, {expected} asked for")
    return {"name": mode, "engine": MODES[mode], "requests": len(work), "tokens": tokens,
            "seconds": took, "tokens_per_s": tokens / took, "steps": None,
            "ttft_s": h.p50_p99(ttft), "itl_s": h.p50_p99(itl)}


def main() -> int:
    parser = h.parser(__doc__, deadline_s=1200)
    parser.add_argument("--requests", type=int, help="requests per mode and round (48; short 32)")
    parser.add_argument("--rounds", type=int, help="rounds of continuous and static (3; short 1)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=0, help="Ember HTTP port (default: free)")
    args = h.pick(parser.parse_args(), requests=(48, 32), rounds=(3, 1))
    _serving.clear_overrides()
    work = workload(args.requests, args.seed)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in MODES}
    errors: list[str] = []
    plan = [m for _ in range(args.rounds) for m in ("continuous", "static")] + ["one_at_a_time"]
    with h.deadline_run(args.deadline_s, errors, _serving.shutdown) as deadline:
        base_url = _serving.start_serve(args.port or h.free_port())
        _serving.deploy_ember(build_app(), deadline)
        h.wait_until(lambda: h.http_ok(base_url + "/readyz"), "the app ready", deadline,
                     poll_s=0.5)
        for i, name in enumerate(plan):
            def one(mode: str = name) -> None:
                r = asyncio.run(run_mode(base_url, mode, work, args.concurrency))
                rounds[mode].append(r)
                print(f"{mode}: {r['tokens_per_s']:.0f} tokens/s, ttft p99 "
                      f"{r['ttft_s']['p99']:.3f} s", flush=True)
            h.section(f"{name} #{i}", errors, one)
    results = {name: median_round(rs) for name, rs in rounds.items() if rs}
    ratios = report(results)
    h.write_results("textgen_http", {
        "complete": not errors, "errors": errors, "ratios": ratios,
        "config": {"requests": args.requests, "rounds": args.rounds,
                   "concurrency": args.concurrency, "seed": args.seed, "torch_threads": 1,
                   "replica_num_cpus": 0.5, "path": "HTTP -> edge -> replica, SSE"},
        "modes": results,
    }, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
