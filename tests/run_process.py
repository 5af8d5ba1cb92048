"""``ember run`` as a child process for end-to-end tests: start, wait, signal, stop, inspect.

The command runs in a session of its own, so every process it starts (Ray's included) can be
found by that session id as well as by the process tree, and the whole session can be
killed if a test gives up on it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
EMBER = Path(sys.executable).with_name("ember")
#: What a crash or an unhandled signal prints; a clean stop prints neither.
STACK_MARKERS = ("Traceback (most recent call last)", "*** SIGTERM received", "*** SIGINT received",
                 "KeyboardInterrupt")


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else "(no log)"


class EmberRun:
    """``ember run TARGET`` in its own session, its output in ``log``."""

    def __init__(self, target: str, env: dict[str, str], log: Path) -> None:
        self.log = log
        env = {**env, "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ADDRESS", None)  # a local run: never join someone else's cluster
        with log.open("wb") as out:
            self.proc = subprocess.Popen([str(EMBER), "run", target], cwd=ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.pid = self.proc.pid
        #: Every process of the run seen so far (by PID and start time): see :meth:`record`.
        self.seen: dict[int, psutil.Process] = {}

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for the ready line; fail at once if the command exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"`ember run` exited with {self.proc.returncode}:\n{tail(self.log)}")
            if "Press Ctrl-C" in self.output():
                return
            self.record()
            time.sleep(0.5)
        self.kill_session()
        pytest.fail(f"`ember run` not ready in {timeout_s:g}s:\n{tail(self.log)}")

    def record(self) -> dict[int, psutil.Process]:
        """Add the run's processes alive now (its tree and its session) to :attr:`seen`."""
        found: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            found = psutil.Process(self.pid).children(recursive=True)
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(process.pid) == self.pid and process.pid != self.pid:
                    found.append(process)
        self.seen.update({p.pid: p for p in found})
        return {p.pid: p for p in found}

    def alive(self) -> list[psutil.Process]:
        """Processes of :attr:`seen` still running (same PID and start time), not zombies."""
        left = []
        for process in self.seen.values():
            with contextlib.suppress(psutil.Error):
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    left.append(process)
        return left

    def send(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the command by PID (not to its group)."""
        self.record()
        os.kill(self.pid, sig)

    def wait(self, timeout_s: float = 180) -> int:
        """The exit code; on a hang, kill the session and fail."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_session()
            pytest.fail(f"`ember run` still running {timeout_s:g}s on:\n{tail(self.log)}")

    def stop(self, timeout_s: float = 180) -> int:
        """SIGTERM (if still running) and the exit code."""
        if self.proc.poll() is None:
            self.send(signal.SIGTERM)
        return self.wait(timeout_s)

    def kill_session(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        for process in self.alive():
            with contextlib.suppress(psutil.Error):
                process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def assert_no_stack(self) -> None:
        text = self.output()
        found = [m for m in STACK_MARKERS if m in text]
        assert not found, f"{found} in the output:\n{tail(self.log, 6000)}"

    def assert_nothing_left(self, timeout_s: float = 30) -> None:
        """No process the run was seen with outlives it by more than ``timeout_s``."""
        assert self.seen, "no process of the run was ever recorded"
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in self.alive()]
        if left:
            self.kill_session()
        assert not left, f"{len(left)} processes of the run outlived it:\n" + "\n".join(left)


def ready(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    return False
