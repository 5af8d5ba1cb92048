"""Closed-loop HTTP load, and where the CPU went while it ran.

:func:`closed_loop` runs ``c`` clients (asyncio + httpx), each sending its next request when
its last one answered, for a bounded duration; elapsed time runs until the last answer.
:func:`cpu_snapshot` reads CPU seconds so far of this process, of its descendants grouped by
the part of the serving stack they are, of the peer's processes, and of the whole host.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import _harness as h
import httpx
import psutil

JSON_HEADERS = {"content-type": "application/json"}
HOST_OTHERS = "host: everything else"


@dataclass(frozen=True)
class LoadTarget:
    label: str
    key: str
    url: str
    body: Callable[[int], bytes]
    stats_url: str | None = None  # handler calls and items so far, where the server says


@dataclass
class LoadResult:
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed_s: float = 0.0
    first_error: str | None = None
    handler_calls: int = 0
    handler_items: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)  # by process group

    def summary(self) -> dict[str, Any]:
        lat, n = self.latencies_ms, len(self.latencies_ms)
        stats = h.p50_p99(lat)
        return {
            "requests": n, "errors": self.errors, "elapsed_s": self.elapsed_s,
            "throughput_rps": n / self.elapsed_s if self.elapsed_s > 0 else None,
            "p50_ms": stats["p50"], "p99_ms": stats["p99"], "mean_ms": stats["mean"],
            "first_error": self.first_error,
            "items_per_forward_call": (self.handler_items / self.handler_calls
                                       if self.handler_calls else None),
            "cpu_ms_per_request": {k: v * 1000.0 / n for k, v in self.cpu_s.items()}
            if n else {},
            "cores_busy": {k: v / self.elapsed_s for k, v in self.cpu_s.items()}
            if self.elapsed_s > 0 else {},
        }


async def _client_loop(client: httpx.AsyncClient, target: LoadTarget, stop_at: float,
                       counter: itertools.count[int], out: LoadResult) -> None:
    while time.perf_counter() < stop_at:
        body = target.body(next(counter))
        sent = time.perf_counter()
        try:
            reply = await client.post(target.url, content=body, headers=JSON_HEADERS)
            error = None if reply.status_code == 200 else (
                f"{reply.status_code}: {reply.text[:200]}")
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        if error is None:
            out.latencies_ms.append((time.perf_counter() - sent) * 1000.0)
        else:
            out.errors += 1
            out.first_error = out.first_error or error


def closed_loop(target: LoadTarget, concurrency: int, duration_s: float,
                deadline: h.Deadline, into: LoadResult | None = None) -> LoadResult:
    """``concurrency`` clients for ``duration_s`` (bounded by ``deadline``); adds to ``into``."""
    out = into if into is not None else LoadResult()
    budget = duration_s + deadline.timeout(180.0)

    async def run() -> None:
        limits = httpx.Limits(max_connections=concurrency,
                              max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=deadline.timeout(120.0)) as client:
            stop_at, counter = time.perf_counter() + duration_s, itertools.count()
            started = time.perf_counter()
            loops = (_client_loop(client, target, stop_at, counter, out)
                     for _ in range(concurrency))
            await asyncio.wait_for(asyncio.gather(*loops), timeout=budget)
            out.elapsed_s += time.perf_counter() - started

    try:
        asyncio.run(run())
    except TimeoutError:
        deadline.left()
        raise RuntimeError(f"{target.label} at c={concurrency} did not finish in time") from None
    return out


def process_group(cmdline: str, app_name: str) -> str:
    """Which part of the serving stack a process of this benchmark's Ray cluster is."""
    if "ProxyActor" in cmdline:
        return "Ray Serve HTTP proxy"
    if f"{app_name}:" in cmdline or f"{app_name}#" in cmdline:
        name = cmdline.split(app_name, 1)[1][1:].split()[0]
        return f"Ember {name.split('#')[0].split('.')[0]}"
    return "Ray core and Serve controller"


def cpu_snapshot(peer_pids: set[int], app_name: str) -> dict[str, float]:
    """CPU seconds so far: this process, its descendants by group, and the rest of the host."""
    def busy(t: Any) -> float:
        return float(t.user + t.system)

    me = psutil.Process()
    out = {"load client (this process)": busy(me.cpu_times())}
    for proc in me.children(recursive=True):
        try:
            group = ("LitServe (all its processes)" if proc.pid in peer_pids
                     else process_group(" ".join(proc.cmdline()), app_name))
            out[group] = out.get(group, 0.0) + busy(proc.cpu_times())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    host = psutil.cpu_times()
    out[HOST_OTHERS] = float(host.user + host.nice + host.system + getattr(host, "irq", 0.0)
                             + getattr(host, "softirq", 0.0)) - sum(out.values())
    return out


def handler_counts(url: str | None, deadline: h.Deadline) -> tuple[int, int]:
    """(handler calls, items) so far, from a deployment's stats route; zeros without one."""
    if url is None:
        return 0, 0
    reply = httpx.get(url, timeout=deadline.timeout(30.0))
    reply.raise_for_status()
    return int(reply.json()["calls"]), int(reply.json()["items"])
