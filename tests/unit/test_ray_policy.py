"""The adapter that runs Ember's policy inside Ray Serve's controller, without a cluster.

These drive Ray's own wrapper (``_apply_autoscaling_config``) with Ray's own context type,
so a Ray upgrade that changes either fails here rather than in production.
"""

from __future__ import annotations

from typing import Any

from ray.serve import autoscaling_policy as ray_policy
from ray.serve._private.common import DeploymentID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from ember.app.config import DeploymentOptions, to_ray_options
from ember.control import ray_policy as _installs_hook  # noqa: F401  (installs the cold-start hook)
from ember.control.ray_policy import EmberAutoscalingPolicy


def _context(config: AutoscalingConfig, *, running: int, target: int, total: float,
             now: float, state: dict[str, Any] | None = None) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=DeploymentID(name="m", app_name="a"), deployment_name="m", app_name="a",
        current_num_replicas=running, target_num_replicas=target, running_replicas=[],
        total_num_requests=total, total_queued_requests=total, aggregated_metrics={},
        raw_metrics={}, capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas, policy_state=state or {},
        last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=config)


def _ember_config(**options: Any) -> AutoscalingConfig:
    ray_opts = to_ray_options(DeploymentOptions(**options), name="m")
    return AutoscalingConfig(**ray_opts["autoscaling_config"])


def _wrapped(config: AutoscalingConfig) -> Any:
    kwargs = config.policy.policy_kwargs
    return ray_policy._apply_autoscaling_config(EmberAutoscalingPolicy(**kwargs))


def test_burst_at_zero_starts_replicas_for_the_queue_in_one_decision() -> None:
    config = _ember_config(max_replicas=8, target_queue_depth=2)
    replicas, _ = _wrapped(config)(_context(config, running=0, target=0, total=20, now=0))
    assert replicas == 8  # ceil(20 / 2) capped at 8, not Ray's fast path of 1


def test_non_ember_deployments_keep_rays_fast_path() -> None:
    config = AutoscalingConfig(min_replicas=0, max_replicas=8)
    policy = ray_policy._apply_autoscaling_config(
        ray_policy.replica_queue_length_autoscaling_policy)
    replicas, _ = policy(_context(config, running=0, target=0, total=20, now=0))
    assert replicas == 1


def test_scale_to_zero_through_rays_wrapper_after_quiet_window() -> None:
    config = _ember_config(scaledown_after_s=5)
    policy = _wrapped(config)
    replicas, state = policy(_context(config, running=1, target=1, total=0, now=100))
    assert replicas == 1
    replicas, state = policy(_context(config, running=1, target=1, total=0, now=103,
                                      state=state))
    assert replicas == 1
    replicas, _ = policy(_context(config, running=1, target=1, total=0, now=105.1, state=state))
    assert replicas == 0


def test_floor_holds_through_rays_wrapper() -> None:
    config = _ember_config(warm_floor=2, max_replicas=4, scaledown_after_s=0)
    replicas, _ = _wrapped(config)(_context(config, running=2, target=2, total=0, now=0))
    assert replicas == 2
