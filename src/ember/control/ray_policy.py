"""Adapter that runs :func:`ember.control.policy.decide` inside Ray Serve's controller.

Ray Serve resolves ``EmberAutoscalingPolicy`` by import path in the controller process and
calls it every control-loop tick with an ``AutoscalingContext``. This module is the only
place that knows Ray's context type; the policy itself stays a pure function.

Ray 2.60 wraps every custom policy with a "cold start fast path" that, while a deployment
has no *running* replica, asks for ``max(1, current target)`` replicas and never consults
the policy: a burst of 20 requests at zero starts one replica and waits for it before the
policy may add more. Ember's whole point is to start what the queue needs in one decision,
so this module narrows that fast path to deployments that are not Ember's. The hook is
installed when the policy is constructed, in the controller: Ray may ship the policy class
by value (cloudpickle), in which case this module's import-time code never runs there.
The unit tests in ``tests/unit/test_ray_policy.py`` run Ray's own wrapper and fail if a Ray
upgrade moves the hook.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from ember import ray_controller, ray_internals
from ember.app import schedule
from ember.app.config import POLICY_IMPORT_PATH
from ember.control import floors
from ember.control.policy import PolicyContext, ScaleDecision, decide


def _is_ember_managed(ctx: Any) -> bool:
    policy = getattr(getattr(ctx, "config", None), "policy", None)
    return getattr(policy, "policy_function", None) == POLICY_IMPORT_PATH


def _unless_ember(original: Callable[[Any], int | None]) -> Callable[[Any], int | None]:
    def cold_start_unless_ember(ctx: Any) -> int | None:
        # None means "no fast path": Ray then calls our policy, which sizes to the queue.
        return None if _is_ember_managed(ctx) else original(ctx)
    return cold_start_unless_ember


def _install_cold_start_hook() -> None:
    """Raises ``RayInternalsChanged`` when Ray moved the fast path (see ember.ray_internals)."""
    ray_internals.wrap_cold_start_fast_path(_unless_ember)


_install_cold_start_hook()


#: Leases are read from the cluster's key-value store at most this often per deployment.
_LEASE_REFRESH_S = 1.0


class EmberAutoscalingPolicy:
    """Callable Ray Serve instantiates once per deployment with ``policy_kwargs``."""

    def __init__(self, *, scaledown_after_s: float, target_queue_depth: float,
                 warm_schedule: list[str] | None = None, warm_schedule_tz: str = "UTC",
                 scheduled_floor: int = 1) -> None:
        _install_cold_start_hook()  # here, in the controller process (see the module doc)
        self.scaledown_after_s = scaledown_after_s
        self.target_queue_depth = target_queue_depth
        self.windows = schedule.parse_schedule(warm_schedule or [])
        self.tz = warm_schedule_tz
        self.scheduled_floor = scheduled_floor
        self._lease: dict[str, Any] | None = None
        self._lease_read_at = float("-inf")

    def floor(self, ctx: Any, now_s: float, *, fresh: bool = False) -> int:
        """Constant floor, lease and schedule, whichever is highest right now.

        The lease is read again when ``fresh`` or when the last read is a second old.
        """
        lease_floor = 0
        if ctx.app_name is not None:
            if fresh or now_s - self._lease_read_at >= _LEASE_REFRESH_S:
                self._lease_read_at = now_s
                # If the store is unreachable, keep the last lease seen.
                with contextlib.suppress(Exception):
                    self._lease = self._read_lease(ctx.app_name, ctx.deployment_name)
            lease_floor = floors.leased_floor(time.time(), self._lease)
        scheduled = floors.scheduled_floor(floors.now_in(self.tz), self.windows,
                                           self.scheduled_floor) if self.windows else 0
        return max(int(ctx.capacity_adjusted_min_replicas), lease_floor, scheduled)

    def _read_lease(self, app: str, deployment: str) -> dict[str, Any] | None:
        return floors.LeaseStore(app).get(deployment)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        # In the controller: this deployment's scale-ups and starting replicas are acted on
        # at once, not at the next control-loop step.
        ray_controller.move_on_at_once(ctx.deployment_id)
        now = float(ctx.current_time if ctx.current_time is not None else time.time())
        decision = self._decide(ctx, now, fresh=False)
        if decision.replicas < int(ctx.target_num_replicas):
            # A scale-down stops a replica that a lease set within the last second may be
            # meant to hold: decide again on a lease read now, not on one up to a second old.
            decision = self._decide(ctx, now, fresh=True)
        return decision.replicas, decision.state

    def _decide(self, ctx: Any, now_s: float, *, fresh: bool) -> ScaleDecision:
        return decide(
            PolicyContext(
                now_s=now_s,
                target_replicas=int(ctx.target_num_replicas),
                total_requests=float(ctx.total_num_requests),
                floor=self.floor(ctx, now_s, fresh=fresh),
                max_replicas=int(ctx.capacity_adjusted_max_replicas),
                target_queue_depth=self.target_queue_depth,
                scaledown_after_s=self.scaledown_after_s,
                state=dict(ctx.policy_state or {}),
            )
        )
