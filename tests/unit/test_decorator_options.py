"""The decorator is typed from the options model: every documented option type-checks."""

from __future__ import annotations

import typing

import ember
from ember.app.config import DeploymentKwargs, DeploymentOptions


def test_typed_keywords_are_exactly_the_options_fields() -> None:
    assert set(typing.get_type_hints(DeploymentKwargs)) == set(DeploymentOptions.model_fields)


def test_every_option_is_accepted_by_the_decorator() -> None:
    # mypy --strict checks this call too (it covers tests/): an option the typed keywords
    # lacked would fail the type check, as it once did for the last six below.
    @ember.deployment(
        name="Typed", route="/typed", warm_floor=0, max_replicas=2, target_queue_depth=2.0,
        max_queue=8, max_ongoing_requests=4, batch=ember.Batch(max_size=4, max_wait_ms=1),
        scaledown_after_s=5.0, request_timeout_s=5.0, max_request_bytes=1024, num_cpus=0.1,
        num_gpus=0.0, graceful_shutdown_s=1.0, cold_start_budget_s=1.0, preload=False,
        warm_pool=True, warm_schedule=["Mon-Fri 08:00-20:00"], warm_schedule_tz="UTC",
        retry_on_replica_loss=False, max_start_attempts=2, health_check_period_s=1.0,
        health_check_timeout_s=5.0, snapshot_url="file:///m/model.safetensors",
        snapshot_version="v1", router="prefix", prefix_max_queue_gap=4,
    )
    class Typed:
        def __call__(self, items: list[str]) -> list[int]:
            return [len(i) for i in items]

    options = Typed.__ember_deployment__.options  # type: ignore[attr-defined]
    assert options.max_start_attempts == 2 and options.retry_on_replica_loss is False
