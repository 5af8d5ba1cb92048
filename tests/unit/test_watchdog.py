"""The watchdog with real processes (no Ray): a parent's tree does not outlive it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from ember.cluster import watchdog

from support import wait_for

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from ember.cluster import watchdog
    guard = watchdog.start()
    guard.wait_started()
    # A child that starts a grandchild: neither dies with the parent on its own.
    child = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"])
    time.sleep(1.5)  # a few of the watchdog's rounds
    if sys.argv[1] == "reap":
        started = time.monotonic()
        guard.reap()
        print(f"reaped in {time.monotonic() - started:.2f}", flush=True)
    print("up", flush=True)
    time.sleep(300)
""")


def _start(mode: str) -> tuple[subprocess.Popen[str], list[psutil.Process], list[str]]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    assert parent.stdout is not None
    lines: list[str] = []
    while not lines or lines[-1] != "up":
        line = parent.stdout.readline().strip()
        assert line, "the parent ended early"
        lines.append(line)
    tree = psutil.Process(parent.pid).children(recursive=True)
    return parent, [p for p in tree if not _is_watchdog(p)], lines


def _is_watchdog(process: psutil.Process) -> bool:
    try:
        return "watchdog" in " ".join(process.cmdline())
    except psutil.Error:  # a zombie (a killed child not yet waited for) has no command line
        return False


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(process)
    return left


def _cleanup(parent: subprocess.Popen[str], tree: list[psutil.Process]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(parent.pid, signal.SIGKILL)
    for process in _alive(tree):
        process.kill()
    parent.wait(timeout=30)


def test_sigkill_of_the_parent_kills_its_whole_tree() -> None:
    parent, tree, _ = _start("wait")
    try:
        assert len(tree) >= 3, tree  # sh, sleep, sleep
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        started = time.monotonic()
        wait_for(lambda: not _alive(tree), 15, what="the orphaned tree to be killed")
        assert time.monotonic() - started < 15
    finally:
        _cleanup(parent, tree)


def test_reap_kills_the_tree_and_spares_the_parent() -> None:
    parent, tree, lines = _start("reap")
    try:
        assert parent.poll() is None
        assert not _alive(tree)
        # The killed ``sh`` is the parent's own child, a zombie until the parent waits for
        # it: reap must not wait for its PID to vanish (that took three rounds of 5 s).
        took_s = float(next(line for line in lines if line.startswith("reaped in")).split()[-1])
        assert took_s < 4, f"reap took {took_s:.1f} s"
    finally:
        _cleanup(parent, tree)


def test_a_record_says_whether_the_tree_changed() -> None:
    """The record's period backs off only while this is False (``control/backoff``)."""
    me = psutil.Process()
    known: dict[int, psutil.Process] = {}
    spare = {os.getpid()}
    watchdog._record(me, known, spare)
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert watchdog._record(me, known, spare) is True  # a process was born
        assert watchdog._record(me, known, spare) is False  # nothing new
        child.kill()
        child.wait(timeout=30)
        assert watchdog._record(me, known, spare) is True  # it ended and was forgotten
        assert watchdog._record(me, known, spare) is False
    finally:
        child.kill()
        child.wait(timeout=30)
