"""Run every benchmark, one after another, each in a process of its own; ``make bench``.

Each script writes its own ``bench/results/<name>.json`` (``<name>.short.json`` with
``--short``, so quick runs never overwrite full ones). A script that fails does not stop
the others; the exit status is non-zero if any failed. A script still running after
``--timeout-s`` is stopped with every process it started, each by its PID.

Usage:
    .venv/bin/python bench/run_all.py [--short] [--only coldstart throughput ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import _harness as h

#: Every benchmark, quickest and quietest first (the model alone before any server).
SCRIPTS = ("model_ceiling", "textgen", "loaders", "mlp_coldstart", "coldstart", "burst",
           "replica_memory", "batching_curve", "throughput", "idle_cpu", "hops", "offline",
           "shadow", "textgen_http")


def run_one(name: str, short: bool, timeout_s: float) -> tuple[int, float]:
    """Run ``bench/<name>.py``; its exit status (124 on timeout) and seconds taken."""
    argv = [sys.executable, f"bench/{name}.py", *(["--short"] if short else [])]
    print(f"\n=== {' '.join(argv[1:])}", flush=True)
    started = time.monotonic()
    proc = h.ServerProcess(argv, capture=False, cwd=h.ROOT)
    try:
        rc = proc.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"=== {name}: over {timeout_s:.0f}s, stopping it", flush=True)
        proc.stop()
        rc = 124
    return rc, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--short", action="store_true", help="every script with --short")
    parser.add_argument("--only", nargs="+", choices=SCRIPTS, default=list(SCRIPTS),
                        help="run these, in this order (default: all)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per script")
    args = parser.parse_args()
    outcomes = [(name, *run_one(name, args.short, args.timeout_s))
                for name in dict.fromkeys(args.only)]  # in the order given
    print()
    h.print_table([["benchmark", "exit", "seconds"]] + [
        [name, str(rc), f"{took:.0f}"] for name, rc, took in outcomes])
    return 0 if all(rc == 0 for _, rc, _ in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
