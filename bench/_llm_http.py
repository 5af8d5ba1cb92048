"""Ember over HTTP against the same engine in-process: the framework's cost on a real model.

``bench/llm.py`` calls :func:`measure` with the bench model's directory. The server is
``ember run ember.deployments.textgen:app`` as a user starts it, in its own process tree and
Ray cluster, with ``EMBER_TEXTGEN_MODEL`` naming the model (the replica's ``num_cpus=1`` gives
its torch one thread). The peer is the same ``Generator`` and ``ENGINE`` the replica builds,
driven from this process on one torch thread: what a caller would get with no HTTP, no edge
and no Ray hop. The load client is this process; the two sides alternate, so only one of them
computes at a time (the other's replica is idle).

* tokens/s at c=16: the seeded requests of ``llm.py`` streamed by 16 closed-loop clients
  (``/v1/completions``, ``stream``, ``ignore_eos``, greedy), output tokens over wall time;
* TTFT at c=1: request sent to the first token received, median of the same prompts one at
  a time; the HTTP path's median minus the in-process median is the added TTFT.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import _harness as h
import httpx

ENV_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER")
BIN = Path(sys.executable).parent
Work = list[tuple[str, int]]
#: One request's stream as (seconds to the first token, tokens received).
Stream = Callable[[str, int], AsyncIterator[int]]


def start_server(model_dir: Path, deadline: h.Deadline) -> tuple[h.ServerProcess, str]:
    """``ember run`` of the textgen app on a free loopback port, serving ``model_dir``."""
    port = h.free_port()
    env = {k: os.environ[k] for k in ENV_KEPT if k in os.environ}
    env.update(PYTHONPATH=str(h.ROOT / "src"), EMBER_TEXTGEN_MODEL=str(model_dir))
    argv = [str(BIN / "ember"), "run", "ember.deployments.textgen:app", "--port", str(port)]
    server = h.ServerProcess(argv, env, inherit_env=False, cwd=Path(tempfile.gettempdir()))
    return h.ready_or_stopped(server, f"http://{h.HOST}:{port}", "/readyz", deadline)


def http_stream(client: httpx.AsyncClient, url: str, model: str) -> Stream:
    async def stream(prompt: str, length: int) -> AsyncIterator[int]:
        body = {"model": model, "prompt": prompt, "max_tokens": length, "temperature": 0,
                "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", url + "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"/v1/completions -> {reply.status_code}: "
                                   f"{(await reply.aread())[:300]!r}")
            seen = 0
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):  # the last event: every token the request got
                    total = int(data["usage"]["completion_tokens"])
                    if total > seen:
                        yield total - seen
                    seen = total
                elif data.get("choices") and not seen:  # the first token's event
                    seen = 1
                    yield 1
    return stream


def engine_stream(generator: Any) -> Stream:
    from ember.protocols import GenerateRequest

    async def stream(prompt: str, length: int) -> AsyncIterator[int]:
        body = GenerateRequest(prompt=prompt, max_tokens=length, temperature=0,
                               ignore_eos=True)
        async for chunk in generator.stream(body):
            if chunk["tokens"]:
                yield int(chunk["tokens"])
    return stream


async def closed_loop(stream: Stream, work: Work, concurrency: int) -> dict[str, Any]:
    """``concurrency`` clients, each sending its next request when the last is answered."""
    queue, ttft, tokens = list(work), list[float](), 0

    async def client() -> None:
        nonlocal tokens
        while queue:
            prompt, length = queue.pop(0)
            sent, got = time.perf_counter(), 0
            async for n in stream(prompt, length):
                if not got:
                    ttft.append(time.perf_counter() - sent)
                got += n
            tokens += min(got, length)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    took = time.perf_counter() - started
    expected = sum(n for _, n in work)
    if tokens != expected:
        raise RuntimeError(f"{tokens} tokens received, {expected} asked for")
    return {"requests": len(work), "tokens": tokens, "seconds": took,
            "tokens_per_s": tokens / took, "ttft_s": h.p50_p99(ttft),
            "ttft_median_s": statistics.median(ttft)}


def measure(model_dir: Path, work: Work, rounds: int, deadline: h.Deadline,
            errors: list[str]) -> dict[str, Any]:
    """The ``http`` section of ``llm.json``: both sides, ``rounds`` alternating rounds."""
    import torch

    from ember.deployments.textgen import ENGINE, Generator, load_backend

    torch.set_num_threads(1)
    backend = load_backend(str(model_dir))
    Generator(backend, ENGINE).warmup()
    side: dict[str, dict[str, list[dict[str, Any]]]] = {
        k: {"c16": [], "c1": []} for k in ("http", "inprocess")}
    server, url = start_server(model_dir, deadline)
    try:
        async def run(kind: str) -> None:
            # A fresh engine each round: its schedule belongs to this round's event loop.
            generator = Generator(backend, ENGINE)
            async with httpx.AsyncClient(timeout=600) as client:
                stream = (http_stream(client, url, model_dir.name) if kind == "http"
                          else engine_stream(generator))
                side[kind]["c16"].append(await closed_loop(stream, work, 16))
                side[kind]["c1"].append(await closed_loop(stream, work[:8], 1))
            await generator.engine.close()

        # The first request builds the replica (a cold start): not part of any figure.
        asyncio.run(closed_loop_once(url, model_dir.name))
        for i in range(rounds):
            for kind in ("http", "inprocess"):
                h.section(f"http round {i} {kind}", errors, lambda k=kind: asyncio.run(run(k)))
                if side[kind]["c16"]:
                    last = side[kind]["c16"][-1]
                    print(f"{kind} c=16: {last['tokens_per_s']:.1f} tokens/s; c=1 TTFT "
                          f"{side[kind]['c1'][-1]['ttft_median_s'] * 1000:.1f} ms", flush=True)
    finally:
        server.interrupt()
    return summary(side)


async def closed_loop_once(url: str, model: str) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        await closed_loop(http_stream(client, url, model), [("warm up", 2)], 1)


def summary(side: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Medians over rounds, per-round ratios kept."""
    http, inproc = side["http"], side["inprocess"]
    tps = [a["tokens_per_s"] / b["tokens_per_s"]
           for a, b in zip(http["c16"], inproc["c16"], strict=False)]
    added = [(a["ttft_median_s"] - b["ttft_median_s"]) * 1000
             for a, b in zip(http["c1"], inproc["c1"], strict=False)]

    def med(kind: str, run: str, key: str) -> float | None:
        values = [r[key] for r in side[kind][run]]
        return statistics.median(values) if values else None

    return {"http_tps": med("http", "c16", "tokens_per_s"),
            "inprocess_tps": med("inprocess", "c16", "tokens_per_s"),
            "ttft_added_ms_c1": statistics.median(added) if added else None,
            "http_over_inprocess_tps": {"median": statistics.median(tps) if tps else None,
                                        "rounds": tps},
            "ttft_added_ms_rounds": added,
            "ttft_c1_ms": {"http": _ms(med("http", "c1", "ttft_median_s")),
                           "inprocess": _ms(med("inprocess", "c1", "ttft_median_s"))},
            "rounds": side, "server": "ember run ember.deployments.textgen:app",
            "route": "/v1/completions (stream, ignore_eos, temperature 0)"}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000
