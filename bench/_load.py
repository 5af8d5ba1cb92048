"""Closed-loop HTTP load, and where the CPU went while it ran.

:func:`closed_loop` runs ``c`` clients (asyncio + httpx), each sending its next request when
its last one answered, for a bounded duration; elapsed time runs until the last answer.
:func:`cpu_snapshot` reads CPU seconds so far of this process, of its descendants grouped by
the part of the serving stack they are (:func:`process_group`: Serve's HTTP proxy, each
Serve deployment's replicas, Ember's edges among them, the rest of Ray), of each peer
server's processes, and of the whole host.

Run as a script it is a load client of its own process (``bench/throughput.py`` starts one
per run with :func:`client_run`): it imports, says ``ready``, waits for a line on stdin,
runs :func:`closed_loop` and prints the summary as one JSON line.

    python bench/_load.py --url URL --body ember|object --concurrency C --duration-s D
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import _harness as h
import httpx
import psutil

JSON_HEADERS = {"content-type": "application/json"}
HOST_OTHERS = "host: everything else"
LOAD_CLIENT = "load client (this process)"
SERVE_PROXY = "Ray Serve HTTP proxy"
RAY_REST = "Ray core and Serve controller"
REPLICA_TITLE = "ray::ServeReplica:"
WORDS = ("ember", "serves", "small", "models", "fast", "while", "the", "quick", "brown", "fox",
         "jumps", "over", "a", "lazy", "dog", "near", "quiet", "rivers", "under", "bright",
         "morning", "light")


def short_text(i: int) -> str:
    """A distinct short sentence (about 8-14 tokens) for item ``i``."""
    n = len(WORDS)
    return " ".join(WORDS[(i * 7 + j * 3) % n] for j in range(6 + i % 6)) + f" {i}"


TEXTS = [short_text(i) for i in range(512)]


def ember_text_body(i: int) -> bytes:
    """Ember ``/embed``'s body: one text, as a one-element array (answered by an array)."""
    return json.dumps([TEXTS[i % len(TEXTS)]]).encode()


def ember_single_body(i: int) -> bytes:
    """One text as a bare JSON string: a batch route takes it as one item, answers one object."""
    return json.dumps(TEXTS[i % len(TEXTS)]).encode()


def text_object_body(i: int) -> bytes:
    """The peers' body (bare FastAPI, LitServe, plain Ray Serve): ``{"text": ...}``."""
    return json.dumps({"text": TEXTS[i % len(TEXTS)]}).encode()


BODIES = {"ember": ember_single_body, "object": text_object_body}
#: (calls, items) of a server's forward passes so far; ``(0, 0)`` where it counts none.
Counts = Callable[[h.Deadline], tuple[int, int]]


@dataclass(frozen=True)
class LoadTarget:
    label: str
    key: str
    url: str
    body: Callable[[int], bytes]
    counts: Counts | None = None  # forward passes and items so far, where the server says
    #: The :func:`cpu_snapshot` groups of the server's own processes, charged to it.
    cpu_groups: tuple[str, ...] = ()


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


def replica_group(app: str, deployment: str) -> str:
    """The :func:`cpu_snapshot` group of the replicas of ``deployment`` in Serve app ``app``."""
    return f"replicas {app}:{deployment}"


def process_group(cmdline: str) -> str:
    """Which part of the serving stack a process of this benchmark's Ray cluster is.

    Ray titles a Serve replica's worker ``ray::ServeReplica:<app>:<deployment>`` (with
    ``.<method>`` while it runs one), so Ember's edges are ``<app>:ember-edge``; the HTTP
    proxy is ``ray::ProxyActor``. GCS, raylets, the Serve controller and idle workers are
    the rest of Ray, which every contender shares.
    """
    if "ray::ProxyActor" in cmdline:
        return SERVE_PROXY
    if REPLICA_TITLE in cmdline:
        title = cmdline.split(REPLICA_TITLE, 1)[1].split()[0]
        app, _, deployment = title.replace("#", ":").partition(":")
        return replica_group(app, deployment.split(".")[0])
    return RAY_REST


def cpu_snapshot(peers: dict[str, set[int]]) -> dict[str, float]:
    """CPU seconds so far: this process, its descendants by group (each of ``peers``, a
    group name to its PIDs, else :func:`process_group`), and the rest of the host."""
    def busy(t: Any) -> float:
        return float(t.user + t.system)

    me = psutil.Process()
    out = {LOAD_CLIENT: busy(me.cpu_times())}
    for proc in me.children(recursive=True):
        try:
            group = next((name for name, pids in peers.items() if proc.pid in pids), None)
            group = group or process_group(" ".join(proc.cmdline()))
            out[group] = out.get(group, 0.0) + busy(proc.cpu_times())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    host = psutil.cpu_times()
    out[HOST_OTHERS] = float(host.user + host.nice + host.system + getattr(host, "irq", 0.0)
                             + getattr(host, "softirq", 0.0)) - sum(out.values())
    return out


def http_counts(url: str) -> Counts:
    """Counts read from a stats route answering ``{"calls": n, "items": m}``."""
    def read(deadline: h.Deadline) -> tuple[int, int]:
        reply = httpx.get(url, timeout=deadline.timeout(30.0))
        reply.raise_for_status()
        return int(reply.json()["calls"]), int(reply.json()["items"])

    return read


# --- the load client as a process of its own ----------------------------------------------


class LoadClient:
    """A :func:`main` subprocess, imported and waiting: :meth:`run` starts its load.

    The imports happen before :meth:`run`, so the caller can read the server's CPU right
    before the load starts and right after it ends.
    """

    def __init__(self, url: str, body: str, concurrency: int, duration_s: float) -> None:
        argv = [sys.executable, __file__, "--url", url, "--body", body,
                "--concurrency", str(concurrency), "--duration-s", str(duration_s)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None  # pipes asked
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        if self.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"load client exited with {self.proc.wait()}")

    def run(self, timeout_s: float) -> dict[str, Any]:
        """Start the load; its :meth:`LoadResult.summary` once it ends."""
        self.stdin.write("go\n")
        self.stdin.flush()
        line = self.stdout.readline()
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        if not line:
            raise RuntimeError(f"load client exited with {self.proc.returncode}")
        summary: dict[str, Any] = json.loads(line)
        return summary


def main() -> int:
    parser = argparse.ArgumentParser(description="closed-loop HTTP load, one JSON line out")
    parser.add_argument("--url", required=True)
    parser.add_argument("--body", choices=sorted(BODIES), required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--duration-s", type=float, required=True)
    args = parser.parse_args()
    target = LoadTarget(args.url, args.body, args.url, BODIES[args.body])
    print("ready", flush=True)
    if not sys.stdin.readline():
        return 1
    result = closed_loop(target, args.concurrency, args.duration_s,
                         h.Deadline(args.duration_s + 300.0))
    print(json.dumps(result.summary()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
