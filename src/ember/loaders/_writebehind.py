"""Write-behind node-cache fills: the load returns before its bytes reach the disk.

A load reads each file into one anonymous buffer and builds its tensors on it; the node
cache is then filled from that same buffer by one background thread per process, at a
lower CPU priority so that it yields to the loads still running. The thread writes a
unique temp file, hashes the bytes in the same pass (and compares the origin's checksum,
when there is one), fsyncs once and publishes by rename, then the marker and the snapshot
link (``NodeTier.commit``). Then the blob's pages replace the buffer's under the load's
tensors (:func:`ember.loaders.pages.remap_onto`): the replica holds the node cache's copy,
the one later replicas map, and its anonymous one is freed. A process killed midway leaves
only its temp file, which the next fill on the node sweeps; a reader never sees a
half-written entry.

A file from a local origin is copied by the kernel into its temp file (``_copy``), which
the load maps (``CacheSeal``); once the load has mapped it, this thread hashes it, renames
it to its blob name, fsyncs it and publishes it. The load shares the pages later replicas
map without waiting for the hash or the disk's durable write.

The fill's single-flight ticket travels with the job: other processes on the node wait
for the published blob rather than fetching the same bytes again, and a failed write lets
them fetch it themselves (the loading replica already has its tensors). The worker is not
a daemon thread, so a script's pending writes finish before the interpreter exits.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, TypeVar

from ember.errors import IntegrityError
from ember.loaders._flight import FillTicket
from ember.loaders._source import ObjectInfo
from ember.loaders._tier import BlobKey, BlobRecord
from ember.loaders._tier_node import NodeHit, NodeTier, TempBlob
from ember.loaders.pages import remap_onto

log = logging.getLogger("ember.loaders")
T = TypeVar("T")
_CHUNK_BYTES = 8 << 20
# Nice 10: the page copies and the hash run when the loading threads leave a core idle.
_NICE = 10
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pending: set[Future[Any]] = set()


@dataclass
class CacheWrite:
    """One file's bytes, in memory, to publish in the node cache.

    Attributes:
        node: the node tier.
        key: the blob key.
        info: the origin object (size; ``sha256`` when the origin publishes one).
        buffer: the whole file, as the load read it.
        sha256: the checksum the load computed, or ``""`` (computed here).
        ticket: the fill's single-flight ticket, finished once the write is over.
        after: called with the published blob (refs, the regional tier).
    """

    node: NodeTier
    key: BlobKey
    info: ObjectInfo
    buffer: mmap.mmap
    sha256: str
    ticket: FillTicket
    after: Callable[[NodeHit], None] | None = None


def _lower_priority() -> None:
    # Linux applies setpriority to one thread when given its id; elsewhere this is a no-op.
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < _NICE:
            os.setpriority(os.PRIO_PROCESS, tid, _NICE)


def _submit(fn: Callable[..., T], *args: Any, refused: Callable[[], T]) -> Future[T]:
    """Queue ``fn(*args)``. A job the pool refuses (at interpreter shutdown thread pools take
    no new work) runs ``refused`` here instead, its way out without the queue, so that no
    ticket is left unfinished and the load that queued it keeps its tensors."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="ember-cache-write",
                                       initializer=_lower_priority)
        try:
            future = _pool.submit(fn, *args)
        except RuntimeError as exc:
            log.warning("node cache work not queued: %s", exc)
            refusal: RuntimeError | None = exc
        else:
            refusal = None
            _pending.add(future)
    if refusal is not None:
        return done(refused())
    future.add_done_callback(_forget)
    return future


def _unqueued(ticket: FillTicket, tmp: TempBlob | None) -> None:
    """A refused write or seal: its temp file goes and its ticket is finished unpublished,
    so waiters here and in other processes fetch for themselves instead of waiting out the
    lease."""
    if tmp is not None:
        tmp.discard()
    ticket.finish(published=False)


def _forget(future: Future[Any]) -> None:
    with _lock:
        _pending.discard(future)


def _copy_and_hash(job: CacheWrite, tmp: TempBlob) -> str:
    """Write the buffer to ``tmp`` and hash it, one pass; the hex digest."""
    hasher = None if job.sha256 else hashlib.sha256()
    with memoryview(job.buffer) as whole:
        for start in range(0, job.info.size, _CHUNK_BYTES):
            with whole[start : min(start + _CHUNK_BYTES, job.info.size)] as chunk:
                tmp.write_at(start, chunk)
                if hasher is not None:
                    hasher.update(chunk)
    return job.sha256 or (hasher.hexdigest() if hasher else "")


def _write(job: CacheWrite) -> NodeHit | None:
    tmp: TempBlob | None = None
    try:
        tmp = job.node.begin_fill(job.key, job.info.size)
        sha = _copy_and_hash(job, tmp)
        expected = job.info.sha256
        if expected and expected != sha:
            raise IntegrityError(what="sha256", name=job.key.name, expected=expected, actual=sha)
        hit = job.node.commit(job.key, tmp, BlobRecord(sha, job.info.size))
    except Exception as exc:  # the load has its tensors; the node fills another time
        if tmp is not None:
            tmp.discard()
        log.warning("node cache write of %s failed: %s", job.key.name, exc)
        job.ticket.finish(published=False)  # waiters fetch it themselves
        return None
    except BaseException:
        if tmp is not None:
            tmp.discard()
        job.ticket.finish(published=False)
        raise
    job.ticket.finish()
    _after(job.after, hit)
    # The load's tensors move onto the blob's pages: one copy of the weights on the node,
    # the one later replicas map. Where it cannot, the replica keeps its buffer.
    try:
        if not remap_onto(job.buffer, hit.path):
            log.info("node cache: %s stays in the load's memory", job.key.name)
    except OSError as exc:
        log.info("node cache: %s stays in the load's memory: %s", job.key.name, exc)
    return hit


@dataclass
class CacheSeal:
    """A filled temp file to hash (unless the read did), place, make durable and publish.

    Attributes:
        node: the node tier.
        key: the blob key.
        tmp: the complete temp file (the load may map it: renaming keeps its pages).
        record: its size, and its checksum when the read computed it (else ``""``).
        ticket: the fill's single-flight ticket, finished once the blob is published.
        after: called with the published blob (refs, the regional tier).
    """

    node: NodeTier
    key: BlobKey
    tmp: TempBlob
    record: BlobRecord
    ticket: FillTicket
    after: Callable[[NodeHit], None] | None = None


def _digest(tmp: TempBlob, size: int) -> str:
    """The sha256 of a temp file's bytes, read in chunks from the page cache.

    Not through a mapping: its pages would count in the process's RSS while it hashes,
    beside the load's own mapping of the same file.
    """
    hasher, buffer, offset = hashlib.sha256(), bytearray(_CHUNK_BYTES), 0
    with memoryview(buffer) as view:
        while offset < size:
            got = os.preadv(tmp.fd, [view[: min(_CHUNK_BYTES, size - offset)]], offset)
            if got == 0:
                raise IntegrityError(what="size", name=str(tmp.path), expected=size, actual=offset)
            hasher.update(view[:got])  # hashlib releases the GIL for large updates
            offset += got
    return hasher.hexdigest()


def _seal(job: CacheSeal) -> NodeHit | None:
    try:
        # The file may have waited in the queue: a fresh mtime keeps other fills' sweeps
        # from taking it for a dead process's leftover while it is hashed and placed.
        os.utime(job.tmp.fd)
        record = job.record
        if not record.sha256:
            record = BlobRecord(_digest(job.tmp, record.size), record.size)
        blob = job.node.place(job.key, job.tmp, record)
        hit = job.node.seal(job.key, blob, record)
    except Exception as exc:
        # A placed blob stays unmarked: no lookup trusts it, the next fill replaces it and
        # the sweep removes it once stale. The load's mapping keeps its own pages.
        job.tmp.discard()
        log.warning("node cache seal of %s failed: %s", job.key.name, exc)
        job.ticket.finish(published=False)
        return None
    except BaseException:
        job.tmp.discard()
        job.ticket.finish(published=False)
        raise
    job.ticket.finish()
    _after(job.after, hit)
    return hit


def _after(after: Callable[[NodeHit], None] | None, hit: NodeHit) -> None:
    if after is None:
        return
    try:
        after(hit)
    except Exception as exc:  # the node copy is published; the rest is best effort
        log.warning("after publishing %s: %s", hit.link.name, exc)


def seal(job: CacheSeal) -> Future[NodeHit | None]:
    """Queue ``job``; its future gives the published blob, or ``None`` if the seal failed."""
    return _submit(_seal, job, refused=lambda: _unqueued(job.ticket, job.tmp))


def submit(job: CacheWrite) -> Future[NodeHit | None]:
    """Queue ``job``; its future gives the published blob, or ``None`` if the write failed."""
    return _submit(_write, job, refused=lambda: _unqueued(job.ticket, None))


def then(
    futures: Sequence[Future[NodeHit | None]], fn: Callable[[list[NodeHit]], None]
) -> Future[None]:
    """Run ``fn`` with every blob once all ``futures`` are published (skipped if one failed)."""

    def run() -> None:
        hits = [f.result() for f in futures]
        published = [h for h in hits if h is not None]
        if len(published) == len(hits):
            fn(published)

    # Refused, the record is skipped: the next load finds no record, fills and records.
    return _submit(run, refused=lambda: None)


def wait_all(timeout_s: float | None = None) -> bool:
    """Wait for every queued node-cache write of this process (``ember.loaders`` exports it
    as ``wait_for_cache_writes``).

    Args:
        timeout_s: how long to wait at most; ``None`` waits until they are all done.

    Returns:
        ``False`` if some are still running at the timeout.

    Example:
        >>> wait_all(timeout_s=5.0)
        True
    """
    with _lock:
        pending = list(_pending)
    _, not_done = wait_futures(pending, timeout=timeout_s)
    return not not_done


def done(value: T) -> Future[T]:
    """A future that already holds ``value`` (a node hit needs no write)."""
    future: Future[T] = Future()
    future.set_result(value)
    return future
