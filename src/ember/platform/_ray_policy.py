"""Adapter that runs :func:`ember.platform.policy.decide` inside Ray Serve's controller.

Ray Serve resolves ``EmberAutoscalingPolicy`` by import path in the controller process and
calls it every control-loop tick with an ``AutoscalingContext``. This module is the only
place that knows Ray's context type; the policy itself stays a pure function.

Ray 2.60 wraps every custom policy with a "cold start fast path" that, while a deployment
has no *running* replica, asks for ``max(1, current target)`` replicas and never consults
the policy: a burst of 20 requests at zero starts one replica and waits for it before the
policy may add more. Ember's whole point is to start what the queue needs in one decision,
so importing this module narrows that fast path to deployments that are not Ember's.
The unit tests in ``tests/unit/test_ray_policy.py`` run Ray's own wrapper and fail if a Ray
upgrade moves the hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ray.serve import autoscaling_policy as _ray_autoscaling

from ember.platform.config import POLICY_IMPORT_PATH
from ember.platform.policy import PolicyContext, decide


def _is_ember_managed(ctx: Any) -> bool:
    policy = getattr(getattr(ctx, "config", None), "policy", None)
    return getattr(policy, "policy_function", None) == POLICY_IMPORT_PATH


def _install_cold_start_hook() -> None:
    original: Callable[[Any], int | None] = _ray_autoscaling._get_cold_start_scale_up_replicas
    if getattr(original, "__ember_hook__", False):
        return

    def cold_start_unless_ember(ctx: Any) -> int | None:
        # None means "no fast path": Ray then calls our policy, which sizes to the queue.
        return None if _is_ember_managed(ctx) else original(ctx)

    cold_start_unless_ember.__ember_hook__ = True  # type: ignore[attr-defined]
    _ray_autoscaling._get_cold_start_scale_up_replicas = cold_start_unless_ember


_install_cold_start_hook()


class EmberAutoscalingPolicy:
    """Callable Ray Serve instantiates once per deployment with ``policy_kwargs``."""

    def __init__(self, *, scaledown_after_s: float, target_queue_depth: float) -> None:
        self.scaledown_after_s = scaledown_after_s
        self.target_queue_depth = target_queue_depth

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time if ctx.current_time is not None else time.time()
        decision = decide(
            PolicyContext(
                now_s=float(now),
                target_replicas=int(ctx.target_num_replicas),
                total_requests=float(ctx.total_num_requests),
                floor=int(ctx.capacity_adjusted_min_replicas),
                max_replicas=int(ctx.capacity_adjusted_max_replicas),
                target_queue_depth=self.target_queue_depth,
                scaledown_after_s=self.scaledown_after_s,
                state=dict(ctx.policy_state or {}),
            )
        )
        return decision.replicas, decision.state
