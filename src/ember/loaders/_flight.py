"""Single-flight node-cache fills: one fetch per blob across threads and processes.

Threads of one process share a future per key, so only one of them touches the lease
file; processes share the lease file (see ``_lease``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from ember.loaders._lease import Lease, acquire
from ember.loaders._tier import BlobKey
from ember.loaders._tier_node import NodeHit, NodeTier

_lock = threading.Lock()
_inflight: dict[str, Future[bool]] = {}


class FillTicket:
    """Permission to fill one key; :meth:`finish` tells every waiter how it went."""

    def __init__(self, key: BlobKey, lease: Lease, future: Future[bool], slot: str) -> None:
        self.key = key
        self._lease = lease
        self._future = future
        self._slot = slot
        self._done = False

    def finish(self, error: BaseException | None = None, *, published: bool = True) -> None:
        """Release the lease; waiters get ``error``, or retry when nothing was published."""
        if self._done:
            return
        self._done = True
        # An abandoned fill (the caller stopped iterating) is not an error for others.
        record = error if isinstance(error, Exception) else None
        self._lease.release(record)
        with _lock:
            _inflight.pop(self._slot, None)
        if record is not None:
            self._future.set_exception(record)
        else:
            self._future.set_result(published and error is None)


def claim(node: NodeTier, key: BlobKey) -> NodeHit | FillTicket:
    """Return the published blob for ``key``, waiting on any fill in progress, or a ticket.

    Raises:
        EmberError: the fill this call waited on failed (every waiter gets the error).
    """
    slot = f"{node.root}\0{key.digest()}"
    while True:
        with _lock:
            future = _inflight.get(slot)
            leader = future is None
            if future is None:
                future = Future()
                _inflight[slot] = future
        if not leader:
            future.result()  # re-raises the leader's error
            hit = node.hit(key)
            if hit is not None:
                return hit
            continue  # the leader gave up without publishing: compete again
        return _lead(node, key, slot, future)


def _lead(node: NodeTier, key: BlobKey, slot: str, future: Future[bool]) -> NodeHit | FillTicket:
    cfg = node.config
    try:
        outcome = acquire(
            node.lease_path(key),
            lambda: node.hit(key),
            timeout_s=cfg.lease_timeout_s,
            heartbeat_s=cfg.lease_heartbeat_s,
            poll_s=cfg.poll_interval_s,
        )
    except BaseException as exc:
        with _lock:
            _inflight.pop(slot, None)
        if isinstance(exc, Exception):
            future.set_exception(exc)
        else:
            future.set_result(False)
        raise
    if isinstance(outcome, Lease):
        return FillTicket(key, outcome, future, slot)
    with _lock:
        _inflight.pop(slot, None)
    future.set_result(True)
    return outcome
