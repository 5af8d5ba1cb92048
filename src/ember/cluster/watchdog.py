"""A watchdog process that leaves no process of a serving process's tree behind it.

Ray ties its GCS and raylet to the process that started them (``PR_SET_PDEATHSIG``), but not
what the raylet starts in turn: after a ``SIGKILL`` of ``ember run`` its dashboard agent,
runtime-env agent and workers live on with no parent. The watchdog is a small child process
that records the serving process's descendants (PID and start time) every
:data:`RECORD_EVERY_S` (less often while the tree stands still) and, when the serving process
is gone (the pipe it holds reaches end of file) or asks for it, kills every recorded process
still alive and their own descendants.
Processes are found by PID and start time only, never by name: other Ray clusters on the
machine are not touched.

Run as ``python -m ember.cluster.watchdog PID``; :func:`start` does that. The watchdog
ignores SIGINT and SIGTERM (a Ctrl-C on a terminal reaches the whole process group): it ends
when the process it watches ends.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from typing import IO

import psutil

from ember.control.backoff import next_interval_s

RECORD_EVERY_S = 0.5
#: The record's period while the tree stands still (``control/backoff``). Each record reads
#: every process's parent from /proc, so a fixed fast one costs an idle server CPU all day;
#: a process born this long before a ``SIGKILL`` of the serving process may be missed.
STEADY_RECORD_EVERY_S = 1.0
#: How long one round of killing waits for its processes to end.
KILL_WAIT_S = 5.0
#: Commands on the watchdog's stdin, each answered with one line on its stdout.
RECORD, REAP = b"record\n", b"reap\n"


class Watchdog:
    """The serving process's handle on its watchdog."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def _ask(self, command: bytes) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(command)
            self.proc.stdin.flush()
            self.proc.stdout.readline()

    def wait_started(self) -> None:
        """Wait until the watchdog watches (its own start takes a moment on a busy machine)."""
        assert self.proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdout.readline()

    def record(self) -> None:
        """Have the watchdog note every process of the tree now (before a sudden exit)."""
        self._ask(RECORD)

    def reap(self) -> None:
        """Kill every process of the tree but this one now, and wait until they are gone."""
        self._ask(REAP)


def start() -> Watchdog:
    """Start the watchdog of this process; it lives until this process ends.

    Returns at once; :meth:`Watchdog.wait_started` waits until it watches.
    """
    # The pipe's ends are not inheritable (PEP 446): only this process holds the write end,
    # so the watchdog sees end of file exactly when this process is gone.
    proc = subprocess.Popen([sys.executable, "-m", "ember.cluster.watchdog", str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    return Watchdog(proc)


def _tree(roots: list[psutil.Process]) -> dict[int, psutil.Process]:
    """``roots`` still alive and all their descendants, by PID."""
    found: dict[int, psutil.Process] = {}
    for root in roots:
        with contextlib.suppress(psutil.Error):
            if root.is_running():  # same PID and start time as when recorded
                found[root.pid] = root
                found.update({child.pid: child for child in root.children(recursive=True)})
    return found


def _ended(process: psutil.Process) -> bool:
    """Gone, or a zombie: a killed direct child of the serving process stays a zombie until
    that process reaps it, and no signal can end it sooner."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _kill(known: dict[int, psutil.Process], spare: set[int]) -> None:
    """SIGKILL every known process still alive, and descendants found meanwhile."""
    for _ in range(3):
        targets = [p for pid, p in _tree(list(known.values())).items()
                   if pid not in spare and not _ended(p)]
        if not targets:
            return
        for process in targets:
            known[process.pid] = process
            with contextlib.suppress(psutil.Error):
                process.kill()
        # Not psutil.wait_procs: for a process that is not our child it waits for the PID to
        # vanish, which a zombie's never does, so each round would wait out its timeout.
        deadline = time.monotonic() + KILL_WAIT_S
        while not all(_ended(p) for p in targets) and time.monotonic() < deadline:
            time.sleep(0.05)


def _record(parent: psutil.Process, known: dict[int, psutil.Process], spare: set[int]) -> bool:
    """Add ``parent``'s descendants to ``known``; forget the known ones that ended.

    Returns:
        Whether ``known`` changed.
    """
    before = set(known)
    for pid in [pid for pid, p in known.items() if not p.is_running()]:
        del known[pid]
    with contextlib.suppress(psutil.Error):
        known.update({p.pid: p for p in parent.children(recursive=True) if p.pid not in spare})
    return set(known) != before


def watch(parent_pid: int, commands: IO[bytes], answers: IO[bytes]) -> None:
    """Record ``parent_pid``'s tree until ``commands`` ends, then kill what is left of it."""
    try:
        parent = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        return  # gone before this started: it waited for nothing, so it started nothing
    known: dict[int, psutil.Process] = {}
    spare = {os.getpid(), parent_pid}
    _record(parent, known, spare)
    answers.write(b"ok\n")  # started: see Watchdog.wait_started
    answers.flush()
    period = RECORD_EVERY_S
    while True:
        ready, _, _ = select.select([commands], [], [], period)
        changed = _record(parent, known, spare)
        period = next_interval_s(period, changed=changed, fast_s=RECORD_EVERY_S,
                                 slow_s=STEADY_RECORD_EVERY_S)
        if not ready:
            continue
        line = commands.readline()
        if not line:  # the parent is gone
            _kill(known, spare)
            return
        if line == REAP:
            _kill(known, spare)
        answers.write(b"ok\n")
        answers.flush()


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    watch(int(sys.argv[1]), sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main()
