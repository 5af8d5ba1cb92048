"""A node's ledger of the memory that loads under way have claimed and not yet taken.

The fit check compares a replica's weights with the node's free memory before anything is
read. Two replicas starting on one node at the same moment would both compare theirs with
the same free memory, and both start; the second to finish its load finds none left. So a
load claims its bytes in this ledger before it reads, and the check of every other load
counts them as taken until the claim is released.

The ledger is a folder of small files, one per claim, under the node cache's root, and an
``flock`` makes the check and the claim one step. A claim names its process (PID and start
time, in clock ticks after boot, which no wall-clock step moves): a process killed mid-load
leaves a file that the next check finds dead and removes, so a crash never leaks memory from
the ledger. Claims are kept per memory domain (the
kernel's boot, the PID namespace and the memory cgroup): pods that share a host folder but
have limits of their own do not count each other's claims.

A claim is released once the load has its weights: by then the free-memory figure counts
what the load took. While a load is under way its claim may be counted twice for the part
it has already taken, so a check can refuse a replica that would just fit (it fails safe:
Serve starts the replica again).

Example:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> with claim(root, 600, free_bytes=1000, what="llama"):
    ...     claimed_bytes(root)
    600
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ember.errors import InsufficientMemory
from ember.loaders import memory

logger = logging.getLogger(__name__)

FOLDER = "reservations"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@contextlib.contextmanager
def claim(root: Path, needed_bytes: int, *, free_bytes: int | Callable[[], int], what: str,
          parts: str = "its weights") -> Iterator[None]:
    """Claim ``needed_bytes`` of the node's memory for as long as the ``with`` block.

    Args:
        root: the node cache's root (the ledger lives in ``<root>/reservations/``).
        needed_bytes: what the load will take.
        free_bytes: the node's free memory, or a function that measures it (called with the
            ledger locked, so that a check sees what every earlier claim has taken).
        what, parts: how a refusal names the load and what its bytes are for.

    Raises:
        InsufficientMemory: ``needed_bytes`` and the other live claims do not fit (503).
    """
    folder = root / FOLDER / domain()
    mine: Path | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _locked(folder):
            free = free_bytes() if callable(free_bytes) else free_bytes
            others = _live_claims(folder)
            check_fits(needed_bytes, free, what=what, parts=parts, others=others)
            mine = _write(folder, needed_bytes, what)
    except OSError as exc:  # a cache root that cannot be written: the plain check stands
        logger.warning("memory ledger unusable (%s); checking against free memory alone", exc)
        free = free_bytes() if callable(free_bytes) else free_bytes
        check_fits(needed_bytes, free, what=what, parts=parts)
    try:
        yield
    finally:
        if mine is not None:
            with contextlib.suppress(OSError):
                mine.unlink()


def claimed_bytes(root: Path) -> int:
    """The bytes that live claims of this memory domain hold now (dead ones are removed)."""
    folder = root / FOLDER / domain()
    if not folder.is_dir():
        return 0
    with _locked(folder):
        return sum(_live_claims(folder))


def domain(*, proc_cgroup: Path | None = None, root: Path | None = None) -> str:
    """This process's memory domain: its boot, PID namespace and memory cgroup, hashed."""
    try:
        boot = _BOOT_ID.read_text().strip()
        pid_ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        boot, pid_ns = "", ""
    found = memory.memory_cgroup(proc_cgroup or memory.PROC_CGROUP, root or memory.CGROUP_ROOT)
    cgroup = "" if found is None else str(found[1])
    return hashlib.sha256(f"{boot}|{pid_ns}|{cgroup}".encode()).hexdigest()[:16]


def check_fits(needed: int, free: int, *, what: str, parts: str = "its weights",
               others: Sequence[int] = ()) -> None:
    """Refuse a load whose ``needed`` bytes, beside the ``others`` claimed, exceed ``free``.

    Raises:
        InsufficientMemory: they do not fit (503), with the bytes in the message.

    Example:
        >>> check_fits(1 << 30, 4 << 30, what="llama")
    """
    if needed + sum(others) <= free:
        return
    if others:
        count = len(others)
        parts = (f"{parts}, beside {sum(others)} bytes that {count} other load"
                 f"{'s' if count > 1 else ''} starting on this node ha{'ve' if count > 1 else 's'}"
                 " claimed")
    raise InsufficientMemory(what=what, needed_bytes=needed, free_bytes=free, parts=parts)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with (folder / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _live_claims(folder: Path) -> list[int]:
    """The bytes of each claim whose process still runs; a dead process's file is removed."""
    live = []
    for path in folder.glob("*.json"):
        try:
            doc = json.loads(path.read_text())
            pid, ticks, size = int(doc["pid"]), int(doc["start_ticks"]), int(doc["bytes"])
        except (OSError, ValueError, KeyError, TypeError):
            # Half-written files never appear (each is renamed into place): unreadable is
            # foreign, and is left alone but not counted.
            continue
        if _alive(pid, ticks):
            live.append(size)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return live


def _alive(pid: int, start_ticks: int) -> bool:
    try:
        now = _start_ticks(pid)
    except (PermissionError, ValueError, IndexError):
        return True  # there, but not ours to read, or read torn: counted, failing safe
    # A PID the kernel gave again to a new process has another start; a zombie holds no
    # memory. Under hidepid=2 another user's process is not there at all: its claim is
    # dropped, as when /proc shows no other user's processes (one user per node's cache).
    return now is not None and now == (start_ticks, False)


def _start_ticks(pid: int) -> tuple[int, bool] | None:
    """The process's start in clock ticks after boot (which no wall-clock step moves, unlike
    a start time in seconds since the epoch) and whether it is a zombie; None if none runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name in brackets may hold anything
    return int(fields[19]), fields[0] == "Z"


def _write(folder: Path, size: int, what: str) -> Path:
    pid = os.getpid()
    mine = _start_ticks(pid)
    if mine is None:  # no /proc (not Linux): claim() checks against free memory alone
        raise FileNotFoundError(f"/proc/{pid}/stat")
    # The load's name without a query string: a signed URL's signature stays out of the file.
    doc = {"pid": pid, "start_ticks": mine[0], "bytes": size,
           "what": what.split("?", 1)[0][:300]}
    name = f"{pid}-{uuid.uuid4().hex}"
    tmp = folder / f".{name}.tmp"
    tmp.write_text(json.dumps(doc))
    path = folder / f"{name}.json"
    os.replace(tmp, path)
    return path
