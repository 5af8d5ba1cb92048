"""Where the request path spends its CPU: py-spy profiles of each serving process under load.

Serves the batched MiniLM flagship (``bench/_batching_apps.py``, one replica), drives a
closed loop of one text per request at ``--concurrency`` for ``--duration-s``, and meanwhile
samples every process on the path with py-spy (``--rate`` samples/s, busy threads only):
Serve's HTTP proxy when there is one, Ember's edges (or, before them, the ingress replica),
the model replica. Prints per process group the functions holding the most samples, by
their own time (the leaf of the stack) and inclusive of what they call, and writes
``bench/results/profile_path.json``. Run it on two checkouts to compare a change to the path.

Usage (py-spy is in the dev extra; it must be allowed to ptrace this user's processes):
    .venv/bin/python bench/profile_path.py [--short] [--duration-s 15] [--concurrency 32]
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _batching_apps as apps
import _harness as h
import _load
import _serving
import psutil

TOP = 15
_LINE = re.compile(r":\d+\)$")


def path_processes(app_name: str) -> dict[int, str]:
    """PID -> group of every process that handles requests of ``app_name``."""
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            group = _load.process_group(" ".join(proc.cmdline()))
        except psutil.Error:
            continue
        if group == _load.SERVE_PROXY or f" {app_name}:" in group:
            found[proc.pid] = group
    return found


def summarize(raw: str) -> dict[str, Any]:
    """Samples, and the top functions by own and inclusive samples, from collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_LINE.sub(")", f) for f in stack.split(";")]
        n = int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n

    def top(counter: collections.Counter[str]) -> list[dict[str, Any]]:
        return [{"function": f, "share": round(c / total, 4)} for f, c in counter.most_common(TOP)]

    return {"samples": total, "own": top(own) if total else [],
            "inclusive": top(inclusive) if total else []}


def profile(args: Any, deadline: h.Deadline, doc: dict[str, Any]) -> None:
    base_url = apps.start(args.port or h.free_port(), ("batched",), deadline)
    target = _load.LoadTarget("Ember batched", "batched", base_url + "/embed",
                              apps.ember_text_body)
    _load.closed_loop(target, args.concurrency, args.warmup_s, deadline)
    pids = path_processes(apps.APP_NAME)
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        spies = [subprocess.Popen(  # one sampler per process, all during the same load
            [_py_spy(), "record", "-p", str(pid), "-d", str(int(args.duration_s)), "-r",
             str(args.rate), "-f", "raw", "-o", f"{tmp}/{pid}.txt", "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for pid in pids]
        load = _load.closed_loop(target, args.concurrency, args.duration_s, deadline)
        for spy in spies:
            spy.wait(timeout=deadline.timeout(60.0))
        doc["load"] = load.summary()
        doc["processes"] = [
            {"pid": pid, "group": group,
             **summarize(Path(f"{tmp}/{pid}.txt").read_text(errors="replace")
                         if Path(f"{tmp}/{pid}.txt").is_file() else "")}
            for pid, group in pids.items()]
    print_report(doc)


def _py_spy() -> str:
    return shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))


def print_report(doc: dict[str, Any]) -> None:
    load = doc["load"]
    print(f"\nc={doc['config']['concurrency']}: {h.fmt(load['throughput_rps'], '.1f')} req/s, "
          f"p50 {h.fmt(load['p50_ms'], '.1f')} ms, {load['errors']} errors")
    for proc in doc["processes"]:
        print(f"\n{proc['group']} (pid {proc['pid']}, {proc['samples']} busy samples)")
        h.print_table([["own", "share", "inclusive", "share"]] + [
            [o["function"][:70], f"{o['share']:.1%}", i["function"][:70], f"{i['share']:.1%}"]
            for o, i in zip(proc["own"], proc["inclusive"], strict=False)])


def main() -> int:
    parser = h.parser(__doc__, deadline_s=600)
    parser.add_argument("--duration-s", type=float, help="seconds sampled under load (15; 5)")
    parser.add_argument("--warmup-s", type=float, help="untimed load first (3; 1)")
    parser.add_argument("--concurrency", type=int, default=32, help="clients (32)")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples/s (100)")
    parser.add_argument("--port", type=int, default=0, help="Ember HTTP port (default: free)")
    args = h.pick(parser.parse_args(), duration_s=(15.0, 5.0), warmup_s=(3.0, 1.0))
    _serving.clear_overrides()
    doc: dict[str, Any] = {"model": "all-MiniLM-L6-v2", "config": {
        "duration_s": args.duration_s, "concurrency": args.concurrency, "rate": args.rate}}
    errors: list[str] = []
    with h.deadline_run(args.deadline_s, errors, _serving.shutdown) as deadline:
        h.section("profile", errors, lambda: profile(args, deadline, doc))
    doc.update(complete=not errors, errors=errors)
    h.write_results("profile_path", doc, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
