"""A burst of concurrent requests at zero replicas: Ember with and without the pool vs Ray Serve.

``--burst`` (32) concurrent ``POST /embed`` requests, one text each, sent at once to a
MiniLM deployment with no replica in any state (variants in ``bench/_minilm_apps.py``):
(a) Ember's flagship as shipped (warm pool of 1, ``preload=True``), (c) Ember without the
pool (its own replicas start) and, as the peer, (e) plain Ray Serve with its autoscaling
timers shrunk to the fastest. Every request is timed from its own send; all must answer
200. Reported: non-200 count, p50 and max latency, and which path (``X-Ember-Cold-Start``)
served each. ``--rounds`` bursts per variant, each from zero; figures over all of them.

Usage:
    .venv/bin/python bench/burst.py [--short] [--burst 32] [--rounds 2]
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import _harness as h
import _minilm_apps as m
import _serving
import httpx
from ray import serve


@dataclass
class Burst:
    statuses: list[int] = field(default_factory=list)  # 0: no answer
    latencies_s: list[float] = field(default_factory=list)
    paths: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        stats = h.p50_p99(self.latencies_s)
        return {"requests": len(self.statuses),
                "non_200": sum(1 for s in self.statuses if s != 200),
                "p50_s": stats["p50"],
                "max_s": max(self.latencies_s) if self.latencies_s else None,
                "paths": self.paths}


def burst(url: str, n: int, deadline: h.Deadline, out: Burst) -> None:
    """``n`` concurrent POSTs, each timed from its send; no answer counts as status 0."""
    timeout = deadline.timeout()

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, float, str | None]:
        sent = time.perf_counter()
        try:
            reply = await client.post(url, json=[f"{m.TEXT} ({i})"])
        except httpx.HTTPError:
            return 0, time.perf_counter() - sent, None
        path, _ = _serving.cold_header(reply)
        return reply.status_code, time.perf_counter() - sent, path

    async def run() -> None:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            for status, took, path in await asyncio.gather(*(one(client, i)
                                                             for i in range(n))):
                out.statuses.append(status)
                out.latencies_s.append(took)
                key = path or "no header"
                out.paths[key] = out.paths.get(key, 0) + 1

    asyncio.run(run())


def report(label: str, out: Burst) -> None:
    s = out.summary()
    print(f"  burst {label:<20} non-200={s['non_200']} p50={h.fmt(s['p50_s'])}s "
          f"max={h.fmt(s['max_s'])}s paths={s['paths']}", flush=True)


def run_ember(v: m.EmberVariant, base_url: str, args: Any, deadline: h.Deadline,
              results: dict[str, Burst]) -> None:
    app = v.build()
    out = results.setdefault(v.key, Burst())
    try:
        _serving.deploy_ember(app, deadline)
        for _ in range(args.rounds):
            m.wait_ember_zero(v, base_url, deadline)
            burst(base_url + "/embed", args.burst, deadline, out)
            report(v.label, out)
    finally:
        serve.delete(app.name)


def run_plain(base_url: str, args: Any, deadline: h.Deadline,
              results: dict[str, Burst]) -> None:
    v = m.PLAIN_SHRUNK
    out = results.setdefault(v.key, Burst())
    for _ in range(args.rounds):
        m.wait_plain_zero(deadline)
        burst(f"{_serving.plain_url()}{v.prefix}/embed", args.burst, deadline, out)
        report(v.label, out)


def print_summary(rows: dict[str, dict[str, Any]]) -> None:
    peer = rows.get("e", {})
    lines = [["variant", "requests", "non-200", "p50 [s]", "max [s]", "peer p50 / it",
              "peer max / it", "paths"]]
    for key, s in rows.items():
        lines.append([f"({key}) {m.LABELS[key]}", str(s["requests"]), str(s["non_200"]),
                      h.fmt(s["p50_s"]), h.fmt(s["max_s"]),
                      h.fmt_ratio(peer.get("p50_s"), s["p50_s"], ".1f"),
                      h.fmt_ratio(peer.get("max_s"), s["max_s"], ".1f"), str(s["paths"])])
    print()
    h.print_table(lines)


def run(args: Any, deadline: h.Deadline, results: dict[str, Burst], errors: list[str]) -> None:
    m.prepare_weights()
    base_url = m.start(args.port or h.free_port(), plain=(m.PLAIN_SHRUNK,))
    print(f"serving at {base_url}", flush=True)
    for v in (m.POOL_PRELOAD, m.WARM_RUNTIME):
        h.section(v.label, errors,
                  functools.partial(run_ember, v, base_url, args, deadline, results))
    h.section("plain Ray Serve", errors, lambda: run_plain(base_url, args, deadline, results))


def main() -> int:
    parser = h.parser(__doc__, deadline_s=900)
    parser.add_argument("--burst", type=int, default=32, help="concurrent requests")
    parser.add_argument("--rounds", type=int, help="bursts per variant (2; short 1)")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    args = h.pick(parser.parse_args(), rounds=(2, 1))
    _serving.clear_overrides()
    results: dict[str, Burst] = {}
    errors: list[str] = []
    with h.deadline_run(args.deadline_s, errors, _serving.shutdown) as deadline:
        run(args, deadline, results, errors)
    rows = {k: b.summary() for k, b in results.items() if b.statuses}
    print_summary(rows)
    if any(r["non_200"] for r in rows.values()):
        errors.append("some burst requests did not answer 200")
    h.write_results("burst", {
        "model": "all-MiniLM-L6-v2 (ember.deployments.embeddings.MiniLM)",
        "complete": not errors, "errors": errors,
        "summary": {m.LABELS[k]: r for k, r in rows.items()},
        "config": {"burst": args.burst, "rounds": args.rounds,
                   "replica_num_cpus": _serving.REPLICA_CPUS,
                   "plain_shrunk_autoscaling": _serving.plain_autoscaling(True)},
        "raw": {m.LABELS[k]: asdict(b) for k, b in results.items()},
    }, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
