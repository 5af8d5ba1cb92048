"""The live pieces tests start and read: an ``ember run`` server, a metrics scrape, moto's S3.

On pytest's ``pythonpath`` (like ``support``), so every layer imports it as ``harness``:

* :class:`EmberRun`: ``ember run TARGET`` as a child process in its own session, logged to
  a file, ready once it prints its banner (and ``/readyz`` answers, if asked), signalled by
  PID, stopped with SIGTERM and, if that hangs, SIGKILL of the whole session; it records the
  processes the run starts, so a test can check that none outlives it.
* :func:`scrape` and :func:`metric`: one ``/metrics`` scrape, parsed by prometheus_client.
* :func:`moto_s3`: moto's standalone S3 server on 127.0.0.1, and :func:`s3_options`;
  :class:`S3Log` records the requests it serves.
* :class:`ControllerLog`: what Serve's controller logged after a point, with the times.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from support import free_port, tail

ROOT = Path(__file__).resolve().parents[1]
EMBER = Path(sys.executable).with_name("ember")
#: What ``ember run`` prints once its apps are deployed.
BANNER = "Press Ctrl-C"
#: What a crash or an unhandled signal prints; a clean stop prints neither.
STACK_MARKERS = ("Traceback (most recent call last)", "*** SIGTERM received", "*** SIGINT received",
                 "KeyboardInterrupt")


def run_env(tmp_path: Path, port: int, **extra: str) -> dict[str, str]:
    """The environment of a local ``ember run``: its own port, cache, state and (never joined)
    Ray."""
    # XDG_DATA_HOME: the run's operator state (ember run's default --state-dir) is the
    # test's own, never a previous run's left in the user's data directory.
    env = {**os.environ, "EMBER_PORT": str(port), "EMBER_CACHE_DIR": str(tmp_path / "cache"),
           "XDG_DATA_HOME": str(tmp_path / "data"), "PYTHONUNBUFFERED": "1", **extra}
    env.pop("RAY_ADDRESS", None)  # a local run: never join (and kill in) another cluster
    return env


class EmberRun:
    """``ember run`` (or any command that starts it) as a child in its own session.

    The session also lets every process the run starts (Ray's included) be found by its
    session id as well as by the process tree: :meth:`record` notes them (PID and start
    time), so a test can check that none outlives the run (:meth:`assert_nothing_left`).

    Args:
        target: ``module:attr`` or ``file.py:attr`` for ``ember run``.
        tmp_path: Where the log (``log_name``) and the run's cache go.
        env: Extra environment, over :func:`run_env`'s.
        unset: Variables to remove from it.
        full_env: The whole environment instead (``EMBER_PORT`` set in it).
        argv: A whole command line instead of ``ember run target`` (e.g. ``make run``).
        port: The port; a free one by default.
        extra_args: More arguments after ``ember run target``.

    Example:
        >>> with EmberRun("examples/mlp_app.py:app", tmp_path) as run:  # doctest: +SKIP
        ...     run.wait_ready(180)
        ...     httpx.post(f"{run.url}/mlp", json={"inputs": [[0.5] * 256]})
    """

    def __init__(self, target: str, tmp_path: Path, *, env: Mapping[str, str] | None = None,
                 argv: Sequence[str] | None = None, port: int | None = None,
                 log_name: str = "run.log", extra_args: Sequence[str] = (),
                 unset: Sequence[str] = (), full_env: Mapping[str, str] | None = None) -> None:
        if full_env is not None:  # the caller built the whole environment, port included
            port = int(full_env["EMBER_PORT"])
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(full_env) if full_env is not None else run_env(
            tmp_path, self.port, **dict(env or {}))
        for name in unset:
            self.env.pop(name, None)
        self.log = tmp_path / log_name
        command = list(argv) if argv else [str(EMBER), "run", target, *extra_args]
        with self.log.open("wb") as out:
            # Own session: if SIGTERM is not enough, the SIGKILL reaches Ray's children too.
            self.proc = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        #: Every process of the run seen so far (by PID and start time): see :meth:`record`.
        self.seen: dict[int, psutil.Process] = {}

    def __enter__(self) -> EmberRun:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop(fail_on_hang=False)

    def text(self) -> str:
        """The log so far."""
        return self.log.read_text(errors="replace")

    def tail(self, chars: int = 3000) -> str:
        """The end of the log, for failure messages."""
        return tail(self.log, chars)

    def wait_ready(self, timeout_s: float, *, http: bool = False) -> None:
        """Fail unless the banner is printed (and ``/readyz`` is 200, if ``http``) in time.

        Fails at once if the command exits first; on a timeout, kills the session first.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"`ember run` exited with {self.proc.returncode}:\n{self.tail()}")
            if BANNER in self.text() and (not http or ready(self.url)):
                return
            self.record()
            time.sleep(0.2)
        self.kill_session()
        pytest.fail(f"`ember run` not ready in {timeout_s:g}s:\n{self.tail()}")

    # -- the run's processes -------------------------------------------------------------
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

    # -- signals and stopping ------------------------------------------------------------
    def send(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the command itself, by PID (not to its group), after a
        :meth:`record`, so the processes it may take down are known."""
        self.record()
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 180) -> int:
        """The exit code; on a hang, kill the session and fail."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_session()
            pytest.fail(f"`ember run` still running {timeout_s:g}s on:\n{self.tail()}")

    def stop(self, timeout_s: float = 120, *, fail_on_hang: bool = True) -> int:
        """SIGTERM (if still running) and wait; on a hang, kill the session (and fail, if
        asked)."""
        if self.proc.poll() is None:
            self.send(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_session()
            if fail_on_hang:
                pytest.fail(f"`ember run` ignored SIGTERM for {timeout_s:g}s:\n{self.tail()}")
        return int(self.proc.returncode)

    def kill(self) -> None:
        """SIGKILL the command by its PID (nothing of it gets a chance to clean up), then
        whatever of the run outlived it (:meth:`kill_session`), so the port is free again."""
        self.send(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        self.kill_session()

    def kill_session(self) -> None:
        """SIGKILL the run's session and every process of :attr:`seen` still alive."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        for process in self.alive():
            with contextlib.suppress(psutil.Error):
                process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    # -- checks --------------------------------------------------------------------------
    def assert_no_stack(self) -> None:
        """No traceback or unhandled-signal message in the log (a clean stop prints none)."""
        text = self.text()
        found = [m for m in STACK_MARKERS if m in text]
        assert not found, f"{found} in the output:\n{self.tail(6000)}"

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


class ControllerLog:
    """The lines Serve's controller logs from now on, in a Ray session's directory.

    Example:
        >>> log = ControllerLog(session_dir)  # doctest: +SKIP
        >>> ...  # the requests under test
        >>> log.first("Upscaling Deployment(name='Cold'")  # doctest: +SKIP
    """

    def __init__(self, session_dir: Path) -> None:
        logs = session_dir / "logs" / "serve"
        self.path = max(logs.glob("controller_*.log"), key=lambda p: p.stat().st_mtime)
        self.offset = self.path.stat().st_size

    def lines(self) -> list[str]:
        with self.path.open() as log:
            log.seek(self.offset)
            return log.read().splitlines()

    def first(self, *parts: str, after: float = 0.0) -> tuple[float, str] | None:
        """(time, line) of the first line logged at or after ``after`` with every part."""
        for line in self.lines():
            if all(part in line for part in parts) and (at := logged_at(line)) >= after:
                return at, line
        return None


def logged_at(line: str) -> float:
    """The wall-clock time of a line of Serve's log ("INFO 2026-11-27 21:53:44,012 ...")."""
    day, clock = line.split()[1:3]
    return time.mktime(time.strptime(f"{day} {clock[:8]}", "%Y-%m-%d %H:%M:%S")) + int(
        clock[9:12]) / 1000


def session_dir_of(processes: Iterable[psutil.Process]) -> Path | None:
    """The Ray session directory named on the command line of one of ``processes``."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            for arg in process.cmdline():
                if arg.startswith(("--session-dir=", "--session_dir=")):
                    return Path(arg.split("=", 1)[1])
    return None


def ready(url: str) -> bool:
    """Whether ``/readyz`` at ``url`` answers 200 now."""
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


# -- metrics -------------------------------------------------------------------------------
def scrape(url: str, **headers: str) -> list[Sample]:
    """Every sample of one ``/metrics`` scrape of ``url`` (any edge answers for all)."""
    reply = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    reply.raise_for_status()
    return [s for family in text_string_to_metric_families(reply.text) for s in family.samples]


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``, in one scrape."""
    return sum(s.value for s in scrape(url) if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items()))


def by_label(samples: list[Sample], name: str, label: str, **labels: str) -> dict[str, float]:
    """``name``'s values summed by ``label``, over the samples whose labels include ``labels``."""
    out: dict[str, float] = {}
    for s in samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            out[s.labels.get(label, "")] = out.get(s.labels.get(label, ""), 0.0) + s.value
    return out


# -- S3 on loopback ------------------------------------------------------------------------
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                  "AWS_DEFAULT_REGION": "us-east-1"}


def s3_options(endpoint: str) -> dict[str, Any]:
    """fsspec storage options that reach the moto S3 server at ``endpoint``."""
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint},
            "skip_instance_cache": True}


@dataclass(frozen=True)
class S3Request:
    """One request the S3 server received."""

    method: str
    path: str  # /bucket/key
    query: str
    range: str  # the Range header, or ""


@dataclass
class S3Log:
    """Every request the S3 server receives, recorded before moto handles it."""

    requests: list[S3Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
        def logged(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            request = S3Request(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""),
                                environ.get("QUERY_STRING", ""), environ.get("HTTP_RANGE", ""))
            with self.lock:
                self.requests.append(request)
            return app(environ, start_response)

        return logged

    def for_bucket(self, bucket: str) -> list[S3Request]:
        """The requests on ``bucket`` (its objects and its listings)."""
        with self.lock:
            return [r for r in self.requests
                    if r.path == f"/{bucket}" or r.path.startswith(f"/{bucket}/")]


@contextmanager
def moto_s3(log: S3Log | None = None) -> Iterator[str]:
    """moto's standalone S3 server on 127.0.0.1; yields its endpoint URL.

    moto's servers in one process share their buckets: give each user a bucket of its own.
    With ``log``, every request is recorded there.
    """
    from moto.server import ThreadedMotoServer

    for key, value in S3_CREDENTIALS.items():
        os.environ.setdefault(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    if log is not None:  # moto keeps its WSGI app on the werkzeug server it started
        inner = server._server
        assert inner is not None  # set by start()
        inner.app = log.wrap(inner.app)
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def versions_served(client: httpx.Client, url: str, n: int) -> dict[str, int]:
    """POST ``n`` requests to ``url``'s ``/embed``; how many each version answered (all 200)."""
    seen: dict[str, int] = {}
    for i in range(n):
        reply = client.post(f"{url}/embed", json={"text": f"r{i}"})
        assert reply.status_code == 200, reply.text
        version = reply.headers["X-Ember-Version"]
        seen[version] = seen.get(version, 0) + 1
    return seen
