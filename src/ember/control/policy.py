"""Queue-depth autoscaling as a pure function.

The controller asks, every tick, "how many replicas should this deployment have?".
:func:`decide` answers from a :class:`PolicyContext` alone, so it is tested with a fake
clock and no cluster. The rules:

* **Up at once, sized to the queue.** Desired replicas are
  ``ceil((ongoing + queued) / target_queue_depth)``; from zero that is
  ``ceil(queued / target_queue_depth)`` in one decision, not one replica per delay.
* **Down only after a quiet window.** Replicas are removed only when the load has stayed
  below the current size for ``scaledown_after_s``, and then only down to the *peak* demand
  seen in that window (Knative's stable window), so a steady or noisy load never oscillates.
* **Never below the floor, never above the cap.**

Example:
    >>> ctx = PolicyContext(now_s=0.0, target_replicas=0, total_requests=20.0,
    ...                     floor=0, max_replicas=8, target_queue_depth=4.0,
    ...                     scaledown_after_s=30.0)
    >>> decide(ctx).replicas
    5
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Keys of the state dict carried from one decision to the next.
_QUIET_SINCE = "ember_quiet_since_s"
_WINDOW_PEAK = "ember_window_peak"


@dataclass(frozen=True)
class PolicyContext:
    """Everything one scaling decision may look at.

    Attributes:
        now_s: The clock, in seconds (monotonic or wall; only differences matter).
        target_replicas: Replicas currently wanted, starting ones included.
        total_requests: Ongoing plus queued requests across the deployment.
        floor: Minimum replicas right now (constant floor, lease or schedule).
        max_replicas: Upper bound.
        target_queue_depth: Requests per replica the policy aims for.
        scaledown_after_s: Quiet seconds before replicas are removed.
        state: What the previous decision left behind.
    """

    now_s: float
    target_replicas: int
    total_requests: float
    floor: int
    max_replicas: int
    target_queue_depth: float
    scaledown_after_s: float
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScaleDecision:
    """The answer: a replica count, the state for next time, and why (for logs)."""

    replicas: int
    state: dict[str, Any]
    reason: str


def demand(total_requests: float, target_queue_depth: float) -> int:
    """Replicas needed to hold ``total_requests`` at ``target_queue_depth`` each."""
    if total_requests <= 0:
        return 0
    # A tiny epsilon keeps float noise (4.0000001 / 2) from asking for an extra replica.
    return math.ceil(total_requests / target_queue_depth - 1e-9)


def clamp(replicas: int, floor: int, max_replicas: int) -> int:
    """Bound ``replicas`` to ``[floor, max_replicas]``; the cap wins over a misconfigured floor."""
    return max(min(floor, max_replicas), min(replicas, max_replicas))


def decide(ctx: PolicyContext) -> ScaleDecision:
    """Decide the replica count for one tick.

    Args:
        ctx: The deployment's current load, bounds and carried state.

    Returns:
        The decision; feed ``decision.state`` back in as ``ctx.state`` next tick.
    """
    wanted = clamp(demand(ctx.total_requests, ctx.target_queue_depth), ctx.floor, ctx.max_replicas)
    current = ctx.target_replicas
    if current < min(ctx.floor, ctx.max_replicas):
        return ScaleDecision(clamp(wanted, ctx.floor, ctx.max_replicas), {}, "below floor")
    if wanted > current:
        return ScaleDecision(wanted, {}, f"scale up: {ctx.total_requests:g} requests")
    if wanted == current:
        return ScaleDecision(current, {}, "steady")
    return _maybe_scale_down(ctx, wanted)


def _maybe_scale_down(ctx: PolicyContext, wanted: int) -> ScaleDecision:
    """Scale down only once the load has been below ``target_replicas`` for the quiet window."""
    quiet_since = float(ctx.state.get(_QUIET_SINCE, ctx.now_s))
    peak = max(int(ctx.state.get(_WINDOW_PEAK, wanted)), wanted)
    if ctx.now_s - quiet_since >= ctx.scaledown_after_s:
        return ScaleDecision(peak, {}, f"scale down after {ctx.now_s - quiet_since:.1f}s quiet")
    state = {_QUIET_SINCE: quiet_since, _WINDOW_PEAK: peak}
    return ScaleDecision(ctx.target_replicas, state, "waiting for quiet window")
