"""Single-flight fills across processes with ``O_CREAT|O_EXCL`` lease files.

Correctness never depends on ``flock`` (it is unreliable on network filesystems). A lease
file holds ``{pid, host, token}``; its holder refreshes the file's mtime as a heartbeat. A
waiter takes a lease over when its holder is a dead process on this host or its heartbeat
is older than the timeout. A failed fill leaves an error record that names the lease
token, so every process that waited on that lease raises the same error. Publication is by
atomic rename, so even a lease broken in error costs a duplicate fetch, never a bad blob.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from ember.errors import EmberError, SourceError
from ember.loaders._error_records import rebuild_error

T = TypeVar("T")
_HOST = socket.gethostname()
_RECORD_CAP_BYTES = 64 << 10


@dataclass(frozen=True)
class LeaseInfo:
    """The contents of a lease file."""

    token: str
    pid: int
    host: str


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(_RECORD_CAP_BYTES))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def read_lease(path: Path) -> LeaseInfo | None:
    """The lease at ``path``, or ``None`` when it is absent or not yet fully written."""
    doc = _read_json(path)
    if doc is None:
        return None
    try:
        return LeaseInfo(str(doc["token"]), int(doc["pid"]), str(doc["host"]))
    except (KeyError, TypeError, ValueError):
        return None


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a unique temp file, fsync and rename."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class Lease:
    """A held lease; refreshes its heartbeat until released."""

    def __init__(self, path: Path, token: str, heartbeat_s: float) -> None:
        self.path = path
        self.token = token
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, args=(heartbeat_s,), name="ember-lease", daemon=True
        )
        self._thread.start()

    def _owned(self) -> bool:
        info = read_lease(self.path)
        return info is not None and info.token == self.token

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            if self._owned():
                with contextlib.suppress(OSError):
                    os.utime(self.path)

    def release(self, error: BaseException | None = None) -> None:
        """Stop the heartbeat, record ``error`` for waiters, and remove the lease file."""
        self._stop.set()
        self._thread.join()
        if error is not None:
            _write_error(self.path, self.token, error)
        else:  # a success supersedes an older failure's record
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_error_path(self.path))
        if self._owned():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _error_path(lease_path: Path) -> Path:
    return lease_path.with_suffix(".error")


def _write_error(lease_path: Path, token: str, error: BaseException) -> None:
    if isinstance(error, EmberError):
        fields = {
            k: v if isinstance(v, int | float | str) else str(v) for k, v in error.fields.items()
        }
        kind = type(error).__name__
    else:
        fields = {"detail": f"{type(error).__name__}: {error}", "url": "the origin"}
        kind = SourceError.__name__
    record = {"token": token, "type": kind, "fields": fields}
    with contextlib.suppress(OSError):
        write_atomic(_error_path(lease_path), json.dumps(record).encode())


def _raise_recorded(lease_path: Path, token: str) -> None:
    doc = _read_json(_error_path(lease_path))
    if doc and doc.get("token") == token and isinstance(doc.get("fields"), dict):
        raise rebuild_error(str(doc.get("type")), dict(doc["fields"]))


def _try_create(path: Path, heartbeat_s: float) -> Lease | None:
    token = uuid.uuid4().hex
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    with os.fdopen(fd, "w") as f:
        json.dump({"token": token, "pid": os.getpid(), "host": _HOST, "at": time.time()}, f)
    return Lease(path, token, heartbeat_s)


def _stale(path: Path, info: LeaseInfo | None, timeout_s: float) -> bool:
    try:
        age_s = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return False
    if info is not None and info.host == _HOST and not psutil.pid_exists(info.pid):
        return True
    return age_s > timeout_s


def _break(path: Path, info: LeaseInfo | None) -> None:
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    moved = read_lease(aside)
    if info is not None and moved is not None and moved.token != info.token:
        # Another waiter replaced the stale lease first; give the fresh one back.
        with contextlib.suppress(OSError):
            os.link(aside, path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside)


def acquire(
    path: Path,
    done: Callable[[], T | None],
    *,
    timeout_s: float,
    heartbeat_s: float,
    poll_s: float,
) -> Lease | T:
    """Return ``done()`` once it is not ``None``, or a :class:`Lease` to do the work.

    Args:
        path: the lease file.
        done: returns the finished result (a cache hit), or ``None`` while there is none.
        timeout_s: heartbeat age after which a holder is presumed dead.
        heartbeat_s: how often a holder refreshes its lease.
        poll_s: how often a waiter checks.

    Raises:
        EmberError: the error the holder recorded when its fill failed.
    """
    while True:
        result = done()
        if result is not None:
            return result
        lease = _try_create(path, heartbeat_s)
        if lease is not None:
            # The work may have finished between the check and the create.
            result = done()
            if result is None:
                return lease
            lease.release()
            return result
        result = _wait(path, done, timeout_s=timeout_s, poll_s=poll_s)
        if result is not None:
            return result


def _wait(path: Path, done: Callable[[], T | None], *, timeout_s: float, poll_s: float) -> T | None:
    info = read_lease(path)
    interval_s = poll_s / 4
    while True:
        time.sleep(interval_s)
        interval_s = min(interval_s * 2, poll_s)
        result = done()
        if result is not None:
            return result
        now = read_lease(path)
        if info is None and now is None and not path.exists():
            # The holder was gone before this waiter first read its lease (released, or
            # given up without publishing): nothing will ever refresh it, so try again.
            return None
        if info is None:
            info = now
        elif now is None or now.token != info.token:
            _raise_recorded(path, info.token)
            return None
        if _stale(path, now, timeout_s):
            _break(path, now)
            return None
