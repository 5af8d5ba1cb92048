"""What a deployment handle's router knows right now, read without waiting on anything.

The edge's replica counts come from Serve's controller, polled every 1-3 s. The
router inside each handle hears of every change at once (the controller pushes the set of
running replicas to it), so it is the fresher source for the one decision that must not be
stale: whether a request to a deployment would wait for a fresh replica. Right after a scale
to zero, the poll still counts the last replica for up to its period, and a request sent
then would wait seconds for a new replica while the warm pool could answer at once.

Serve exposes neither fact publicly; both readers return None when the internals they read
are not there (a Ray upgrade moved them), and callers fall back to the polled counts.
``tests/integration/test_pool.py`` sends requests right as the last replica goes and fails
if they wait.

``push_fresh_demand_at_zero`` mends the router's side of a cold start: see its doc.
``check_now`` runs the readers' check when the edge starts rather than in its first request.
"""

from __future__ import annotations

import time
from typing import Any

from ember import ray_internals
from ember.control.backoff import idle_push_due


def running_replicas(handle: Any) -> int | None:
    """Replicas the handle's router may send to now, or None when that is not known."""
    return ray_internals.router_running_replicas(handle)


def assigned(response: Any) -> bool | None:
    """Whether a sent request has reached a replica yet, or None when that is not known."""
    return ray_internals.response_assigned(response)


def push_fresh_demand_at_zero() -> bool:
    """Make the router's cold-start push carry the request that caused it.

    When a request is queued for a deployment with no replica, Serve's router pushes its
    queue metrics to the controller at once, so the controller can start a replica without
    waiting for the next periodic push. But the report is built from the samples the router
    records every ``look_back_period_s / 5``, and the newest of those predates the request:
    the controller reads a queue of 0 and starts nothing until the next periodic push, up to
    ``metrics_interval_s`` later (0.1-0.25 s of every own-replica cold start, measured).
    Recording a sample just before that push fixes it. Installed in the process that holds
    the handles (the edge); returns False when a Ray upgrade moved what this wraps.
    """
    return ray_internals.wrap_scaled_to_zero_push(ray_internals.push_demand_now)


def quiet_idle_pushes() -> bool:
    """Send an idle handle's queue reports every few seconds instead of every 0.25 s.

    Each of an edge's handles reports its queue to Serve's controller every
    ``metrics_interval_s`` (0.25 s, so queue-depth scaling reacts fast), busy or not: with
    two edges and two deployments that is 16 calls a second that the controller handles
    while the app serves nothing, a large part of what an idle Ember costs beyond plain
    Serve (``bench/idle_cpu.py``). A report of zeros after a report of zeros now goes
    every ``QUIET_PUSH_KEEPALIVE_S``; any request, and the first idle report after it, go
    at the next tick as before. Installed in the edge; False when a Ray upgrade moved what
    this reads.
    """
    keepalive_s = ray_internals.QUIET_PUSH_KEEPALIVE_S
    return ray_internals.wrap_quiet_idle_push(
        lambda idle, was_idle, since_s: idle_push_due(
            idle=idle, idle_when_pushed=was_idle, since_push_s=since_s, keepalive_s=keepalive_s),
        time.monotonic)


def check_now() -> bool:
    """Check the router's internals now, at the edge's start; whether the readers work.

    The check reads Ray's source (about 0.09 s of CPU here) and its answer is kept for the
    process. Left to the first reading, it ran inside the first cold request each edge
    served, between the request's arrival and its send, so that request's replica started
    0.09 s later.
    """
    return ray_internals.available("router_view")
