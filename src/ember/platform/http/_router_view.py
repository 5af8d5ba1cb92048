"""What a deployment handle's router knows right now, read without waiting on anything.

The edge's replica counts come from Serve's controller, polled about once a second. The
router inside each handle hears of every change at once (the controller pushes the set of
running replicas to it), so it is the fresher source for the one decision that must not be
stale: whether a request to a deployment would wait for a fresh replica. Right after a scale
to zero, the poll still counts the last replica for up to a second, and a request sent in
that second would wait seconds for a new replica while the warm pool could answer at once.

Serve exposes neither fact publicly; both readers return None when the internals they read
are not there (a Ray upgrade moved them), and callers fall back to the polled counts.
``tests/integration/test_pool.py`` sends requests right as the last replica goes and fails
if they wait.
"""

from __future__ import annotations

from typing import Any


def running_replicas(handle: Any) -> int | None:
    """Replicas the handle's router may send to now, or None when that is not known."""
    router = getattr(getattr(handle, "_router", None), "_asyncio_router", None)
    if router is None:
        return None
    request_router = getattr(router, "_request_router", None)
    if request_router is not None:
        replicas = getattr(request_router, "curr_replicas", None)
        return len(replicas) if isinstance(replicas, dict) else None
    # Before its first request the router only stores the list it was sent.
    pending = getattr(router, "_running_replicas", None)
    return len(pending) if isinstance(pending, list) else None


def assigned(response: Any) -> bool | None:
    """Whether a sent request has reached a replica yet, or None when that is not known."""
    future = getattr(response, "_replica_result_future", None)
    done = getattr(future, "done", None)
    return bool(done()) if callable(done) else None
