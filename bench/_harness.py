"""What every benchmark shares: deadlines, ports, percentiles, tables, subprocesses, results.

A benchmark script builds its parser with :func:`parser` (``--short`` and ``--deadline-s``),
fills the defaults that differ between full and short runs with :func:`pick`, bounds every
wait by one :class:`Deadline` (:func:`install_deadline` adds a SIGALRM backstop), prints its
table with :func:`print_table` and ratios with :func:`fmt_ratio`, and ends with
:func:`write_results`, which writes ``bench/results/<name>.json`` (``<name>.short.json`` for
``--short``) with the host's facts beside the figures. Peer servers run as
:class:`ServerProcess`: started in a session of their own and stopped by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
HOST = "127.0.0.1"
_STARTED_AT = time.time()
_LOAD_AT_START = list(os.getloadavg())
#: (handler, alarm seconds left, when) of whoever used SIGALRM before each install_deadline.
_PREVIOUS_ALARMS: list[tuple[Any, int, float]] = []


class DeadlineExceeded(RuntimeError):
    """The global time budget ran out."""


class Deadline:
    """A global wall-clock budget that every wait and request is bounded by."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; raises :class:`DeadlineExceeded` when none are."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"global deadline of {self.seconds:.0f}s exceeded")
        return left

    def timeout(self, cap_s: float = 120.0) -> float:
        """A timeout for one call: at most ``cap_s``, never past the deadline."""
        return min(cap_s, self.left())


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise DeadlineExceeded("hard deadline: a call blocked past the global deadline")


def install_deadline(seconds: float) -> Deadline:
    """A :class:`Deadline`, plus SIGALRM a minute after it for calls that ignore timeouts."""
    handler = signal.signal(signal.SIGALRM, _on_alarm)
    left = signal.alarm(int(seconds) + 60)
    _PREVIOUS_ALARMS.append((handler, left, time.monotonic()))
    return Deadline(seconds)


def clear_deadline() -> None:
    """Cancel the SIGALRM backstop and give SIGALRM back to whoever had it (a test runner)."""
    signal.alarm(0)
    if _PREVIOUS_ALARMS:
        handler, left, at = _PREVIOUS_ALARMS.pop()
        signal.signal(signal.SIGALRM, handler)
        if left:
            signal.alarm(max(1, int(left - (time.monotonic() - at))))


def wait_until(check: Callable[[], bool], what: str, deadline: Deadline,
               cap_s: float = 300.0, poll_s: float = 0.2) -> float:
    """Poll ``check`` until true; seconds waited. Raises RuntimeError after ``cap_s``."""
    started = time.monotonic()
    limit = deadline.timeout(cap_s)
    while not check():
        if time.monotonic() - started > limit:
            deadline.left()
            raise RuntimeError(f"timed out after {limit:.0f}s waiting for {what}")
        time.sleep(poll_s)
    return time.monotonic() - started


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``GET url`` answers 200 now."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's
    ephemeral range: a port the kernel hands out (bind to 0, as Ray's many servers do) can
    be taken between this check and the server's own bind, which fails an edge's start
    (the tests take their ports here too, through tests/support.py)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


# --- statistics and formatting -------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def p50_p99(values: Sequence[float]) -> dict[str, float | None]:
    """``{"p50", "p99", "mean"}`` of ``values`` (None when empty)."""
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    return {"p50": percentile(values, 50), "p99": percentile(values, 99),
            "mean": statistics.fmean(values)}


def median_or_none(values: Sequence[float | None]) -> float | None:
    """Median of the values that are not None."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is missing or ``den`` is not positive."""
    return None if num is None or den is None or den <= 0 else num / den


def fmt_ratio(num: float | None, den: float | None, spec: str = ".2f") -> str:
    """``num / den`` as ``"2.10x"``, or ``"-"``."""
    value = ratio(num, den)
    return "-" if value is None else f"{format(value, spec)}x"


def fmt(value: float | None, spec: str = ".3f") -> str:
    """A number, or ``"-"`` for None."""
    return "-" if value is None else format(value, spec)


def print_table(lines: list[list[str]]) -> None:
    """Aligned columns; the first line is the header."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for i, line in enumerate(lines):
        print(" | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


# --- command line --------------------------------------------------------------------------


def parser(doc: str | None, deadline_s: float = 1200.0) -> argparse.ArgumentParser:
    """An argument parser with ``--short`` and ``--deadline-s``."""
    out = argparse.ArgumentParser(description=(doc or "").split("\n", 1)[0])
    out.add_argument("--short", action="store_true",
                     help="the quick version: fewer trials and requests (about 1-3 minutes)")
    out.add_argument("--deadline-s", type=float, default=deadline_s,
                     help="global time budget in seconds")
    return out


def pick(args: argparse.Namespace, **choices: tuple[Any, Any]) -> argparse.Namespace:
    """Fill each option left None with its (full, short) default; refuse non-positive ones."""
    for name, (full, short) in choices.items():
        if getattr(args, name) is None:
            setattr(args, name, short if args.short else full)
        if isinstance(getattr(args, name), int | float) and getattr(args, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must not be negative")
    return args


@contextmanager
def deadline_run(seconds: float, errors: list[str],
                 cleanup: Callable[[], None] | None = None) -> Iterator[Deadline]:
    """A run under a global deadline: one that is passed ends up in ``errors``, not raised.

    The SIGALRM backstop is cleared and ``cleanup`` (e.g. shutting Serve down) runs however
    the run ends.
    """
    deadline = install_deadline(seconds)
    try:
        yield deadline
    except DeadlineExceeded as exc:
        errors.append(f"DeadlineExceeded: {exc}")
    finally:
        clear_deadline()
        if cleanup is not None:
            cleanup()


def section(name: str, errors: list[str], fn: Callable[[], None]) -> None:
    """Run one part; a failure is recorded in ``errors`` and the next part still runs.

    Any exception counts (Ray raises bare ``Exception`` when a node fails to start), so that
    the results file still says what failed; only the global deadline stops the run.
    """
    try:
        fn()
    except DeadlineExceeded:
        raise
    except Exception as exc:
        error = f"{name}: {type(exc).__name__}: {exc}"
        errors.append(error)
        print(f"  error in {error}", file=sys.stderr, flush=True)


# --- peer servers --------------------------------------------------------------------------


class ServerProcess:
    """A subprocess in a session of its own, stopped by PID (never by name).

    With ``capture`` its output goes to a temporary log (shown if it exits early), else to
    this process's stdout and stderr.
    """

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, *,
                 capture: bool = True, cwd: Path | None = None,
                 inherit_env: bool = True) -> None:
        self.log: Path | None = None
        out: int | None = None
        if capture:
            out, log = tempfile.mkstemp(prefix="bench-server-", suffix=".log")
            self.log = Path(log)
        try:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT if capture else None,
                env={**(os.environ if inherit_env else {}), **(env or {})},
                cwd=cwd or tempfile.gettempdir(),
                start_new_session=True)
        finally:
            if out is not None:
                os.close(out)

    def wait_ready(self, url: str, deadline: Deadline, cap_s: float = 300.0) -> None:
        """Until ``GET url`` answers 200; raises if the process exits first."""
        def ready() -> bool:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-1500:] if self.log else ""
                raise RuntimeError(f"server exited with {self.proc.returncode}: {tail}")
            return http_ok(url)

        wait_until(ready, url, deadline, cap_s=cap_s, poll_s=0.5)

    def tree(self) -> list[psutil.Process]:
        """The server and every process it started."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def family(self) -> list[psutil.Process]:
        """:meth:`tree`, plus every process of the Ray sessions it started (found by session
        name, so daemons reparented away from the tree count too) and their descendants."""
        tree = self.tree()
        sessions = {m.group(0) for p in tree for m in [_RAY_SESSION.search(_cmdline(p))] if m}
        seen = {p.pid: p for p in tree}
        if sessions:
            for proc in psutil.process_iter():
                if proc.pid not in seen and any(s in _cmdline(proc) for s in sessions):
                    for p in (proc, *_children(proc)):
                        seen.setdefault(p.pid, p)
        return list(seen.values())

    def interrupt(self, timeout_s: float = 30.0) -> None:
        """Ctrl-C (SIGINT) to the server alone, as a user stops ``serve run`` or ``ember
        run``; then :meth:`stop` for whatever of its family is left."""
        family = self.family()
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)
        self.stop(family)

    def stop(self, procs: list[psutil.Process] | None = None) -> None:
        """Terminate the server and its children (or ``procs``), each by its own PID; kill
        what remains."""
        procs = self.tree() if procs is None else procs
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
        self.proc.wait(timeout=5)
        if self.log is not None:
            self.log.unlink(missing_ok=True)


_RAY_SESSION = re.compile(r"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+")


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return list(proc.children(recursive=True))
    except psutil.Error:
        return []


def cpu_seconds(procs: Sequence[psutil.Process]) -> float:
    """CPU seconds (user + system) of ``procs`` so far, with their reaped children's."""
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def start_peer(script: str, args: list[str], deadline: Deadline) -> tuple[ServerProcess, str]:
    """Run a peer's server ``script`` on a free port (one torch thread) until ``/health``.

    Returns the process and its base URL; a peer that never gets healthy is stopped.
    """
    port = free_port()
    server = ServerProcess([sys.executable, script, "--port", str(port), *args],
                           env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    return ready_or_stopped(server, f"http://{HOST}:{port}", "/health", deadline)


def ready_or_stopped(server: ServerProcess, url: str, path: str,
                     deadline: Deadline) -> tuple[ServerProcess, str]:
    """``server`` and ``url`` once ``GET url+path`` answers 200; one that never does is
    stopped (its whole tree, by PID) before the error goes on."""
    try:
        server.wait_ready(url + path, deadline)
    except BaseException:
        server.stop()
        raise
    return server, url


# --- results -------------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _script() -> str:
    """``sys.argv[0]`` relative to the repository root when it lies inside it."""
    script = Path(sys.argv[0]).resolve()
    return str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0]


def _cpu_model() -> str | None:
    """The processor's model name, as ``/proc/cpuinfo`` gives it (None elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    names = [line.split(":", 1)[1].strip() for line in text.splitlines()
             if line.startswith("model name") and ":" in line]
    return names[0] if names else None


#: CPU features torch's kernels pick their paths by (x86; absent names are not there).
_KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_kernels() -> dict[str, Any]:
    """Which of torch's CPU kernels this processor gets, and a ``bfloat16`` linear layer's
    speed against ``float32``'s (one thread, 256 tokens through 2048x2048, best of three).

    Without native bf16 (an AVX2-only processor: no ``avx512_bf16`` nor ``amx_bf16``) a bf16
    model's prefill runs several times slower than on one that has it, so the forward takes
    a larger share of every time to first token and ratios between contenders that share
    the forward move toward 1: a result says which kind of processor produced it.
    """
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    present = set(line.partition(":")[2].split())
    facts: dict[str, Any] = {"flags": [f for f in _KERNEL_FLAGS if f in present]}
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return facts
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        facts["torch_capability"] = torch.backends.cpu.get_cpu_capability()
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(256, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
            F.linear(x, w)
            best = math.inf
            for _ in range(3):
                start = time.perf_counter()
                F.linear(x, w)
                best = min(best, time.perf_counter() - start)
            facts[f"linear_gflops_{str(dtype).removeprefix('torch.')}"] = round(
                2 * 256 * 2048 * 2048 / best / 1e9, 1)
    finally:
        torch.set_num_threads(threads)
    return facts


def host_facts(short: bool) -> dict[str, Any]:
    """The machine, the software and the command that produced a result."""
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        # Ratios move with the processor (a decode step is bandwidth-bound on one CPU and
        # compute-bound on another): say which one produced them.
        "cpu_model": _cpu_model(),
        "cpu_kernels": cpu_kernels(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: _version(dist) for name, dist in
                     (("ember", "ember-serve"), ("ray", "ray"), ("torch", "torch"),
                      ("litserve", "litserve"), ("safetensors", "safetensors"))},
        "load_avg_at_start": _LOAD_AT_START,
        "load_avg_at_end": list(os.getloadavg()),
        "started_at": datetime.datetime.fromtimestamp(_STARTED_AT, datetime.UTC).isoformat(),
        "runtime_s": round(time.time() - _STARTED_AT, 1),
        "command": shlex.join([Path(sys.executable).name, _script(), *sys.argv[1:]]),
        "short": short,
    }


def write_results(name: str, data: dict[str, Any], *, short: bool,
                  path: Path | None = None) -> Path:
    """Write ``bench/results/<name>[.short].json`` (or ``path``): host facts beside ``data``.

    ``data``'s keys come first (the figures), then ``benchmark`` and ``host``.
    """
    if path is None:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"{name}{'.short' if short else ''}.json"
    doc = {**data, "benchmark": name, "host": host_facts(short)}
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path
