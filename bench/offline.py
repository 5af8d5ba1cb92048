"""Embeddings online at batch size 1 vs the offline batch job: items/s and cost, one run.

The deployment (default ``ember.deployments.embeddings:app``, all-MiniLM-L6-v2; any
``module:app[:Deployment]`` with a batch handler works, imported only when the run starts)
embeds the same synthetic corpus three ways on this machine:

* ``online b=1``: one item per call, sequentially, as one replica serves one caller. With
  ``--online-url`` each item is an HTTP POST to a running Ember (route from the deployment,
  JSON body ``[text]``); without it the handler is called in this process with the
  replica's thread count (its ``num_cpus``), which leaves out HTTP and Ray Serve overhead
  and so flatters the online side.
* ``handler batched`` (reference): the same, on batches of ``--batch-size``: the model's
  own batched throughput per replica here.
* ``offline job``: ``ember.offline.run_batch`` over a JSONL file with
  ``--concurrency`` Ray Data workers (default: as many as the machine's CPUs hold at the
  deployment's ``num_cpus``), Parquet output. Its items/s is rows over the whole job's wall
  time, worker start-up and model load included: what a job costs. The row below it leaves
  the start-up out (``BatchReport.startup_s``): the rate a long job settles at.

Cost per million items is ``price_per_hour / 3600 / items_per_s * 1e6``: the machine billed
for the time each way takes. The machine column is the best case for the in-process ways:
their one-replica rate times the job's worker count, as if every core ran a replica, each
always busy (real b=1 traffic leaves replicas idle between calls); the second ratio printed
compares the job with it. Absolute numbers on a shared machine move from run to run; the
ratios are the point.

Usage:
    .venv/bin/python bench/offline.py [--short] [--rows 4000] [--online-items 200]
        [--price-per-hour 0.40] [--online-url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _harness as h

_WORDS = [
    "the", "model", "maps", "every", "sentence", "to", "a", "vector", "so", "that", "similar",
    "meanings", "land", "close", "together", "while", "unrelated", "text", "drifts", "apart",
    "across", "the", "embedding", "space", "of", "three", "hundred", "eighty", "four",
    "dimensions", "trained", "on", "a", "billion", "pairs", "of", "questions", "answers",
    "titles", "and", "passages", "from", "the", "open", "web",
]


@dataclass(frozen=True)
class Measure:
    """One way of embedding the corpus; ``replicas`` copies of it fill the machine."""

    name: str
    items: int
    seconds: float
    replicas: int
    price_per_hour: float

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else 0.0

    @property
    def machine_items_per_s(self) -> float:
        return self.items_per_s * self.replicas

    @property
    def cost_per_million(self) -> float:
        return cost_per_million(self.items_per_s, self.price_per_hour)


def cost_per_million(items_per_s: float, price_per_hour: float) -> float:
    """Dollars per million items at ``items_per_s`` on a machine billed ``price_per_hour``."""
    return price_per_hour / 3600.0 / items_per_s * 1e6 if items_per_s > 0 else float("inf")


def corpus(rows: int, seed: int = 7) -> list[str]:
    """Deterministic sentences of 6 to 40 words, like short documents and queries."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 40))) for _ in range(rows)]


def _timed(name: str, items: int, args: argparse.Namespace, work: Callable[[], Any]) -> Measure:
    started = time.perf_counter()
    work()
    return Measure(name, items, time.perf_counter() - started, args.concurrency,
                   args.price_per_hour)


def _handler(target: str, deployment: str | None, attr: str | None) -> Callable[[list[str]], Any]:
    """The batch handler of a fresh instance, set up (and warmed up) as a replica would be."""
    import torch

    from ember.offline._job import resolve_target

    resolved = resolve_target(target, deployment, attr)
    # A replica's threads are its CPUs (Ray sets OMP_NUM_THREADS so); more threads than
    # that also fight the job's workers and anything else on a shared machine.
    torch.set_num_threads(max(1, int(resolved.spec.options.num_cpus)))
    impl = resolved.spec.cls()
    for hook in ("setup", "warmup"):
        method = getattr(impl, hook, None)
        if callable(method):
            method()
    fn: Callable[[list[str]], Any] = getattr(impl, resolved.route.attr)
    return fn


def measure_online_local(fn: Callable[[list[str]], Any], texts: list[str],
                         args: argparse.Namespace) -> Measure:
    """The handler called once per item, in this process."""
    return _timed("online b=1 (handler)", len(texts), args, lambda: [fn([t]) for t in texts])


def measure_online_http(url: str, route: str, texts: list[str],
                        args: argparse.Namespace) -> Measure:
    """One HTTP POST per item to a running Ember, sequentially."""
    import httpx

    with httpx.Client(timeout=60) as client:
        client.post(f"{url}{route}", json=[texts[0]]).raise_for_status()  # wake and warm

        def run() -> None:
            for text in texts:
                client.post(f"{url}{route}", json=[text]).raise_for_status()

        return _timed("online b=1 (HTTP)", len(texts), args, run)


def measure_batched(fn: Callable[[list[str]], Any], texts: list[str],
                    args: argparse.Namespace) -> Measure:
    """The handler on batches of ``--batch-size``, in this process."""
    def run() -> None:
        for start in range(0, len(texts), args.batch_size):
            fn(texts[start : start + args.batch_size])

    return _timed(f"handler batched b={args.batch_size}", len(texts), args, run)


def measure_offline(args: argparse.Namespace, texts: list[str],
                    workdir: Path) -> tuple[Measure, Measure]:
    """The offline job over a JSONL file of ``texts``: whole job, and without start-up."""
    from ember.offline._job import run_batch

    source = workdir / "corpus.jsonl"
    source.write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                              for i, t in enumerate(texts)))
    report = run_batch(args.target, input=str(source), output=str(workdir / "out"),
                       deployment=args.deployment, attr=args.attr, batch_size=args.batch_size,
                       concurrency=args.concurrency, progress=False)
    if report.rows_failed:
        raise RuntimeError(f"{report.rows_failed} rows failed; see {workdir / 'out'}")
    name = f"offline job b={args.batch_size} x{args.concurrency}"
    # The job's rate is already the machine's: its workers ran side by side.
    job = Measure(name, report.rows_processed, report.elapsed_s, 1, args.price_per_hour)
    steady = Measure(f"  same, once workers were up ({report.startup_s:.0f} s start-up)",
                     report.rows_processed, report.elapsed_s - report.startup_s, 1,
                     args.price_per_hour)
    return job, steady


def _default_concurrency(args: argparse.Namespace) -> int:
    from ember.offline._job import resolve_target

    cpus = resolve_target(args.target, args.deployment, args.attr).spec.options.num_cpus
    return max(1, int((os.cpu_count() or 1) // cpus)) if cpus > 0 else 1


def render(measures: list[Measure], price: float) -> None:
    """The results table, with each way's items/s over online b=1's."""
    online = measures[0]
    lines = [["way", "items", "seconds", "items/s", "machine", "$/M items", "vs online b=1"]]
    for m in measures:
        lines.append([m.name, str(m.items), h.fmt(m.seconds, ".2f"), h.fmt(m.items_per_s, ".1f"),
                      h.fmt(m.machine_items_per_s, ".1f"), h.fmt(m.cost_per_million),
                      h.fmt_ratio(m.items_per_s, online.items_per_s, ".1f")])
    h.print_table(lines)
    job, steady = measures[2], measures[3]
    print(f"offline job / online b=1: {job.items_per_s / online.items_per_s:.1f}x items/s, so as"
          f" much cheaper per item (at ${price:.2f}/h); "
          f"{steady.items_per_s / online.items_per_s:.1f}x once workers are up")
    print(f"against online b=1 on every core (best case, machine column): "
          f"{job.items_per_s / online.machine_items_per_s:.1f}x, "
          f"{steady.items_per_s / online.machine_items_per_s:.1f}x once workers are up")


def figures(measures: list[Measure]) -> dict[str, Any]:
    """The measures with their rates and costs, and the ratios the README quotes."""
    online, job, steady = measures[0], measures[2], measures[3]
    return {
        "measures": [{**asdict(m), "items_per_s": m.items_per_s,
                      "machine_items_per_s": m.machine_items_per_s,
                      "cost_per_million": m.cost_per_million} for m in measures],
        "ratio_items_per_s": job.items_per_s / online.items_per_s,
        "ratio_items_per_s_steady": steady.items_per_s / online.items_per_s,
        "ratio_vs_online_every_core": job.items_per_s / online.machine_items_per_s,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = h.parser(__doc__, deadline_s=900)
    parser.add_argument("--target", default="ember.deployments.embeddings:app")
    parser.add_argument("--deployment", default=None)
    parser.add_argument("--attr", default=None)
    parser.add_argument("--rows", type=int, help="items of the offline job (4000; short 600)")
    parser.add_argument("--online-items", type=int, help="items sent at b=1 (200; short 50)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--price-per-hour", type=float, default=0.40,
                        help="machine price in $/h (default: a 2-core cloud VM)")
    parser.add_argument("--online-url", default=None, help="a running Ember to POST items to")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the results here instead of bench/results/")
    return h.pick(parser.parse_args(argv), rows=(4000, 600), online_items=(200, 50))


def measure_all(args: argparse.Namespace) -> list[Measure]:
    """Online b=1, the handler batched, then the offline job (whole and once started)."""
    texts = corpus(args.rows)
    online_texts = texts[: args.online_items]
    args.concurrency = args.concurrency or _default_concurrency(args)
    fn = _handler(args.target, args.deployment, args.attr)
    if args.online_url:
        from ember.offline._job import resolve_target

        route = resolve_target(args.target, args.deployment, args.attr).route.path
        online = measure_online_http(args.online_url.rstrip("/"), route, online_texts, args)
    else:
        online = measure_online_local(fn, online_texts, args)
    batched = measure_batched(fn, texts, args)
    del fn  # free the in-process model before the job's workers load theirs
    from ember.cluster import runtime

    # Started after the in-process runs, which it would slow while it boots, and outside
    # the job's time: a cluster exists before a job in production.
    runtime.start_ray()
    with tempfile.TemporaryDirectory(prefix="ember-offline-bench-") as tmp:
        offline, steady = measure_offline(args, texts, Path(tmp))
    return [online, batched, offline, steady]


def main(argv: list[str] | None = None) -> int:
    """Run the measurements, print the table and write the results; the exit status.

    Ray is shut down at the end only if this run started it (a test may lend its cluster).
    """
    import ray

    args = parse_args(argv)
    sys.path.insert(0, os.getcwd())  # targets given as module:app import from here
    ray_was_up = ray.is_initialized()
    deadline = h.install_deadline(args.deadline_s)
    doc: dict[str, Any] = {}
    errors: list[str] = []
    try:
        def run() -> None:
            measures = measure_all(args)
            doc.update(figures(measures))
            render(measures, args.price_per_hour)

        h.section("offline", errors, run)
        deadline.left()
    except h.DeadlineExceeded as exc:
        errors.append(f"DeadlineExceeded: {exc}")
    finally:
        h.clear_deadline()
        from ember.cluster import runtime

        if ray.is_initialized() and not ray_was_up:
            runtime.shutdown()
    doc.update(complete=not errors, errors=errors, config={
        "target": args.target, "rows": args.rows, "online_items": args.online_items,
        "batch_size": args.batch_size, "concurrency": args.concurrency,
        "price_per_hour": args.price_per_hour, "online_url": args.online_url})
    h.write_results("offline", doc, short=args.short, path=args.json)
    return 0 if not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
