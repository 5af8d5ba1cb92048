"""What an idle deployment costs: CPU per second and memory of a served app nobody calls, and
how long it takes to start, Ember against Ray Serve as its users run it.

Scale to zero saves a replica's memory and accelerator; what is left running still burns
CPU on every node, all day: Serve's controller loop, the proxies or edges, health checks and
metrics pushes, idle pre-started workers. This bench measures that floor.

Contenders, started as in ``bench/throughput.py`` (its :func:`throughput.launch`: each as
its users start it, alone on the machine, in a process tree and a Ray cluster of its own,
the same filtered environment):

* **Ember**: ``ember run _ember_minilm:app``, Ember's defaults (its edges, warm pool and
  warm runtime);
* **Ray Serve, stock**: ``serve run`` of the same model code, every option at Ray's default.

A round starts one contender, waits until the model answers and the idle workers have
settled (:func:`throughput.settle`), waits ``--quiet-s`` more with no request, then reads the
CPU time (user + system) of the contender's whole family, every process of its Ray session
(:meth:`_harness.ServerProcess.family`), twice, ``--window-s`` apart, with no request in
between. ``idle_cpu_pct`` is that CPU over the window, in percent of one core; the same
definition for both. Per process kind (Serve controller, edges or proxy, replicas, Ray's
daemons, idle workers) the same figure shows where it goes. Rounds alternate the contenders.

Two more figures per round, the same definitions for both: ``answering_s``, seconds from the
command's start to the model's first 200 (the start an operator waits for); and
``pss_mb``, the family's proportional set size after the window (shared pages split between
the processes that map them, so torch's libraries count once), by kind too.

Usage:
    .venv/bin/python bench/idle_cpu.py [--short] [--rounds 3] [--window-s 30]
"""

from __future__ import annotations

import contextlib
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h
import psutil
import throughput as tp

CONTENDERS = tuple(c for c in tp.CONTENDERS if c.key in ("ember", "stock"))
#: A process's kind from its command line: the first pattern that matches names it.
KINDS = (
    ("serve controller", r"ray::ServeController"),
    ("edges / proxy", r"ember-edge|ray::ProxyActor"),
    ("replicas", r"ray::ServeReplica|ray::SERVE_REPLICA"),
    ("idle workers", r"ray::IDLE"),
    ("ray daemons", r"gcs_server|raylet|dashboard|log_monitor|monitor\.py|agent|runtime_env"),
)


def kind(proc: psutil.Process) -> str:
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return "gone"
    return next((name for name, pattern in KINDS if re.search(pattern, line)), "other")


def cpu_by_kind(family: list[psutil.Process]) -> dict[int, tuple[str, float]]:
    out: dict[int, tuple[str, float]] = {}
    for proc in family:
        with contextlib.suppress(psutil.Error):
            out[proc.pid] = (kind(proc), h.cpu_seconds([proc]))
    return out


def pss_by_kind(family: list[psutil.Process]) -> dict[str, float]:
    """MB of proportional set size per kind of process (shared pages split between users)."""
    out: dict[str, float] = {}
    for proc in family:
        with contextlib.suppress(psutil.Error):
            name = kind(proc)
            out[name] = out.get(name, 0.0) + proc.memory_full_info().pss / 2**20
    return {k: round(v, 1) for k, v in sorted(out.items())}


def measure_idle(server: h.ServerProcess, window_s: float) -> dict[str, Any]:
    """The family's CPU over ``window_s`` with no request; percent of one core, by kind."""
    before, started = cpu_by_kind(server.family()), time.monotonic()
    time.sleep(window_s)
    after, seconds = cpu_by_kind(server.family()), time.monotonic() - started
    kinds: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        # A process born in the window counts from zero; one gone in it is not seen again.
        used = cpu - before.get(pid, (name, 0.0))[1]
        kinds[name] = kinds.get(name, 0.0) + used
    total = sum(kinds.values())
    return {"window_s": round(seconds, 2), "cpu_s": round(total, 3),
            "idle_cpu_pct": round(100.0 * total / seconds, 2),
            "by_kind_pct": {k: round(100.0 * v / seconds, 2) for k, v in sorted(kinds.items())},
            "processes": len(after)}


def one_round(contender: tp.Contender, args: Any, deadline: h.Deadline,
              workdir: Path) -> dict[str, Any]:
    port, started = h.free_port(), time.monotonic()
    server = tp.launch(contender, port, args.torch_threads, workdir)
    url = f"http://{h.HOST}:{port}/embed"
    try:
        tp.wait_answering(server, url, contender, deadline)
        answering_s = time.monotonic() - started
        settle_s = tp.settle(server, deadline)
        time.sleep(args.quiet_s)
        idle = measure_idle(server, args.window_s)
        pss = pss_by_kind(server.family())
    finally:
        server.interrupt()
    return {"contender": contender.key, "answering_s": round(answering_s, 2),
            "settle_s": round(settle_s, 1), **idle,
            "pss_mb": round(sum(pss.values()), 1), "pss_mb_by_kind": pss}


#: The per-round figures summarised, each a median with its spread.
FIGURES = ("idle_cpu_pct", "pss_mb", "answering_s")


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in CONTENDERS:
        out[c.key] = {"label": c.label, "how": c.how}
        for figure in FIGURES:
            values = [r[figure] for r in rounds if r["contender"] == c.key]
            out[c.key][figure] = {"median": statistics.median(values), "min": min(values),
                                  "max": max(values), "values": values} if values else None
    return out


def ratios(summary: dict[str, Any]) -> dict[str, Any]:
    """Ember over stock, per figure, against the target of at most 1x."""
    out = {}
    for figure in FIGURES:
        ember, stock = (summary[k][figure] for k in ("ember", "stock"))
        value = h.ratio(ember and ember["median"], stock and stock["median"])
        out[f"ember/stock {figure}"] = {"value": value, "target": "<= 1",
                                        "met": value is not None and value <= 1.0}
        print(f"{figure} (median): Ember {h.fmt(ember and ember['median'], '.1f')}, Ray Serve "
              f"stock {h.fmt(stock and stock['median'], '.1f')}; Ember / stock "
              f"{h.fmt(value, '.2f')} (target <= 1)", flush=True)
    return out


def main() -> int:
    parser = h.parser(__doc__, deadline_s=1500.0)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--window-s", type=float, default=None)
    parser.add_argument("--quiet-s", type=float, default=5.0,
                        help="no request for this long before the window (after settling)")
    parser.add_argument("--torch-threads", type=int, default=1)
    args = h.pick(parser.parse_args(), rounds=(3, 1), window_s=(30.0, 10.0))
    rounds: list[dict[str, Any]] = []
    errors: list[str] = []
    with h.deadline_run(args.deadline_s, errors) as deadline, \
            tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        for n in range(args.rounds):
            for contender in CONTENDERS:
                def run(c: tp.Contender = contender, n: int = n) -> None:
                    row = one_round(c, args, deadline, Path(tmp))
                    rounds.append({"round": n, **row})
                    print(f"round {n} {c.label}: {row['idle_cpu_pct']:.1f} % of a core "
                          f"{row['by_kind_pct']}; {row['pss_mb']:.0f} MB PSS "
                          f"{row['pss_mb_by_kind']}; answered after {row['answering_s']:.1f} s",
                          flush=True)

                h.section(f"round {n} {contender.key}", errors, run)
    summary = summarise(rounds)
    print()
    h.write_results("idle_cpu", {
        "complete": not errors and len(rounds) == args.rounds * len(CONTENDERS),
        "errors": errors, "summary": summary, "rounds": rounds, "ratio": ratios(summary),
        "config": {"rounds": args.rounds, "window_s": args.window_s,
                   "quiet_s": args.quiet_s, "torch_threads": args.torch_threads},
    }, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
