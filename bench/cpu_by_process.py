"""Run a command and say where the machine's CPU went meanwhile, by kind of process.

    .venv/bin/python bench/cpu_by_process.py [--interval-s 2] [--out FILE] -- COMMAND...

Every ``--interval-s`` it reads each process's ``utime + stime`` from ``/proc`` and keeps
the last value seen, so a process that lives shorter than the interval is missed and one
that exits is counted up to its last sample. Processes already running when the command
starts count only what they use after. Ray's workers are named by the title Ray gives them
(``ray::ServeReplica:APP:DEPLOYMENT`` is a replica, ``...:ember-edge`` an edge); a worker
first seen idle keeps the name of what it became. The machine's busy time from
``/proc/stat`` is printed beside the sum, so what the sampling missed shows.
docs/testing.md quotes its figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
#: Substrings of a command line that name one of Ray's daemons or a tool, first match wins.
_KINDS = ("gcs_server", "raylet/raylet", "dashboard/agent", "runtime_env/agent", "log_monitor",
          "monitor.py", "dashboard.py", "ember run", "ember.cluster.watchdog", "pytest",
          "locust", "moto")
#: Names a later sample does not replace: a worker before and between its tasks.
_PLACEHOLDERS = ("ray::IDLE", "default_worker")


def kind(cmdline: str, comm: str) -> str:
    """The kind of a process from its command line (``/proc/PID/cmdline``) and name.

    Example:
        >>> kind("ray::ServeReplica:textgen:SmallGen", "ray::ServeRepli")
        'serve replica'
        >>> kind("ray::ServeReplica:textgen:ember-edge", "ray::ServeRepli")
        'ember edge'
        >>> kind("/venv/bin/python -m pytest tests/unit", "python")
        'pytest'
    """
    title = cmdline.split(" ", 1)[0] if cmdline.startswith("ray::") else ""
    if title.startswith("ray::ServeReplica:"):
        return "ember edge" if title.endswith(":ember-edge") else "serve replica"
    if title:
        return title.split("(", 1)[0]
    if "default_worker.py" in cmdline:
        return "default_worker"
    for name in _KINDS:
        if name in cmdline:
            return name
    return comm or "?"


def _sample() -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, start time) -> (kind, CPU-seconds) for every process readable now."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # gone meanwhile
            continue
        close = stat.rindex(")")
        fields = stat[close + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / _TICK
        name = kind(cmdline.decode(errors="replace").strip(), stat[stat.index("(") + 1:close])
        out[(int(entry), int(fields[19]))] = (name, cpu)
    return out


def _busy_s() -> float:
    """The machine's busy CPU-seconds since boot (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / _TICK


@dataclass
class Report:
    """What :func:`measure` saw: CPU-seconds by kind, beside the machine's busy time."""

    command: list[str]
    returncode: int
    wall_s: float
    machine_busy_cpu_s: float
    sampled_cpu_s: float
    by_kind: list[dict[str, float | int | str]]


def measure(command: list[str], interval_s: float) -> Report:
    """Run ``command`` to its end, sampling; the CPU-seconds by kind, and the machine's."""
    base = {key: cpu for key, (_, cpu) in _sample().items()}
    busy, started = _busy_s(), time.monotonic()
    seen: dict[tuple[int, int], tuple[str, float]] = {}
    proc = subprocess.Popen(command)
    while True:
        done = proc.poll() is not None
        for key, (name, cpu) in _sample().items():
            old = seen.get(key)
            if old and name in _PLACEHOLDERS and old[0] not in _PLACEHOLDERS:
                name = old[0]
            seen[key] = (name, cpu - base.get(key, 0.0))
        if done:
            break
        time.sleep(interval_s)
    totals: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    for name, cpu in seen.values():
        if cpu > 0:
            totals[name] += cpu
            counts[name] += 1
    return Report(command, proc.returncode, round(time.monotonic() - started, 1),
                  round(_busy_s() - busy, 1), round(sum(totals.values()), 1),
                  [{"kind": name, "cpu_s": round(cpu, 1), "processes": counts[name]}
                   for name, cpu in sorted(totals.items(), key=lambda kv: -kv[1])])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--interval-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run (put it after --)")
    report = measure(command, args.interval_s)
    for row in report.by_kind:
        print(f"{row['cpu_s']:8.1f} CPU-s {row['processes']:4d} x {row['kind']}")
    print(f"{report.sampled_cpu_s:8.1f} CPU-s sampled; the machine was busy "
          f"{report.machine_busy_cpu_s} CPU-s in {report.wall_s} s")
    if args.out:
        args.out.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report.returncode


if __name__ == "__main__":
    sys.exit(main())
