"""The router's cold-start push and its quiet idle pushes, run through Ray Serve's own metrics
manager."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve._private import router
from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from ray.serve._private.config import DeploymentConfig
from ray.serve._private.router import RouterMetricsManager

from ember import ray_internals
from ember.control.backoff import idle_push_due
from ember.edge._router_view import push_fresh_demand_at_zero, quiet_idle_pushes
from ember.ray_internals import _access


class _Metric:
    def set_default_tags(self, tags: dict[str, str]) -> None: ...
    def set(self, value: float, tags: dict[str, str] | None = None) -> None: ...
    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None: ...


class _Method:
    def __init__(self) -> None:
        self.calls = 0

    def remote(self, payload: Any) -> object:
        self.calls += 1
        return object()  # the push's object ref, never resolved here


class _Controller:
    def __init__(self) -> None:
        self.record_autoscaling_metrics_from_handle = _Method()


def _manager() -> tuple[RouterMetricsManager, _Controller, list[Any]]:
    controller = _Controller()
    manager = RouterMetricsManager(
        DeploymentID(name="Model", app_name="app"), "handle", "actor",
        DeploymentHandleSource.UNKNOWN, controller,  # type: ignore[arg-type]
        _Metric(), _Metric(), _Metric(),  # type: ignore[arg-type]
        asyncio.new_event_loop())
    # What update_deployment_config would set, without starting its periodic tasks.
    manager._deployment_config = DeploymentConfig(
        autoscaling_config={"min_replicas": 0, "max_replicas": 2,
                            "look_back_period_s": 1.0, "metrics_interval_s": 0.25})
    reports: list[Any] = []
    build = manager._get_metrics_report

    def spy() -> Any:
        reports.append(build())
        return reports[-1]

    manager._get_metrics_report = spy  # type: ignore[method-assign]
    return manager, controller, reports


def test_the_push_for_a_request_at_zero_replicas_carries_that_request() -> None:
    assert push_fresh_demand_at_zero()
    manager, controller, reports = _manager()
    manager._add_autoscaling_metrics_point()  # type: ignore[no-untyped-call]  # periodic sample
    with manager.wrap_queued_request(is_retry=False, num_curr_replicas=0):
        pass
    assert controller.record_autoscaling_metrics_from_handle.calls == 1
    # Without the fix the newest sample is the periodic one: a queue of 0, nothing to start.
    assert reports[0].queued_requests[-1].value == 1


def test_a_deployment_with_replicas_gets_no_extra_sample_or_push() -> None:
    assert push_fresh_demand_at_zero()
    manager, controller, _ = _manager()
    manager._add_autoscaling_metrics_point()  # type: ignore[no-untyped-call]
    with manager.wrap_queued_request(is_retry=False, num_curr_replicas=1):
        pass
    assert controller.record_autoscaling_metrics_from_handle.calls == 0
    assert [point.value for point in manager.metrics_store.data["queued"]] == [0]


def test_a_request_at_zero_is_pushed_though_a_periodic_push_is_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray's push skips itself while its last one is in flight; a periodic push predates the
    # request, so the demand would reach the controller a whole metrics interval later.
    assert push_fresh_demand_at_zero()
    monkeypatch.setattr(router, "check_obj_ref_ready_nowait", lambda ref: False)
    manager, controller, reports = _manager()
    manager.push_autoscaling_metrics_to_controller()  # type: ignore[no-untyped-call]  # periodic, in flight
    with manager.wrap_queued_request(is_retry=False, num_curr_replicas=0):
        pass
    assert controller.record_autoscaling_metrics_from_handle.calls == 2
    assert reports[-1].queued_requests[-1].value == 1


def test_a_burst_at_zero_sends_one_demand_push_while_it_is_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert push_fresh_demand_at_zero()
    monkeypatch.setattr(router, "check_obj_ref_ready_nowait", lambda ref: False)
    manager, controller, _ = _manager()
    for _ in range(20):
        with manager.wrap_queued_request(is_retry=False, num_curr_replicas=0):
            pass
    assert controller.record_autoscaling_metrics_from_handle.calls == 1


class _Clock:
    def __init__(self) -> None:
        self.now = 1.8e9

    def __call__(self) -> float:
        return self.now


def _quiet(clock: _Clock) -> None:
    # The wrap is installed once per process (the edge's install may come first); each
    # install replaces the rule and the clock it reads.
    assert ray_internals.wrap_quiet_idle_push(
        lambda idle, was, since: idle_push_due(idle=idle, idle_when_pushed=was,
                                               since_push_s=since, keepalive_s=4.0), clock)


_CLOCK = _Clock()


def _tick(manager: RouterMetricsManager, seconds: float = 0.25) -> None:
    """One metrics interval: Ray samples the queue, then pushes."""
    _CLOCK.now += seconds
    manager._add_autoscaling_metrics_point()  # type: ignore[no-untyped-call]
    manager.push_autoscaling_metrics_to_controller()  # type: ignore[no-untyped-call]


@pytest.fixture(autouse=True)
def _fake_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's samples and the wrap read one fake clock; each push has reached the controller
    by the next tick (no Ray to ask here)."""
    monkeypatch.setattr(router, "time", SimpleNamespace(time=_CLOCK, monotonic=_CLOCK))
    # The wrap keeps the rule and clock of the latest install, process-wide: put back what
    # was there, so no later test's pushes read this fake clock.
    monkeypatch.setattr(_access, "_quiet_due", _access._quiet_due)
    monkeypatch.setattr(_access, "_quiet_clock", _access._quiet_clock)
    monkeypatch.setattr(router, "check_obj_ref_ready_nowait", lambda ref: True)


def test_an_idle_handle_reports_its_zeros_every_keepalive_not_every_tick() -> None:
    assert quiet_idle_pushes()  # the edge's install
    _quiet(_CLOCK)
    manager, controller, _ = _manager()
    for _ in range(16 * 3):  # 12 s of 0.25 s ticks
        _tick(manager)
    assert controller.record_autoscaling_metrics_from_handle.calls == 3  # 0.25 s, 4.25, 8.25


def test_a_request_on_a_quiet_handle_is_reported_at_the_next_tick() -> None:
    _quiet(_CLOCK)
    manager, controller, reports = _manager()
    for _ in range(4):
        _tick(manager)
    pushes = controller.record_autoscaling_metrics_from_handle.calls
    with manager.wrap_queued_request(is_retry=False, num_curr_replicas=1):
        _tick(manager)
    assert controller.record_autoscaling_metrics_from_handle.calls == pushes + 1
    assert reports[-1].queued_requests[-1].value == 1
    # Idle again: reported while the request's sample is in the look-back window, then once
    # more when the window holds only zeros, then quiet.
    for _ in range(12):
        _tick(manager)
    assert reports[-1].queued_requests[-1].value == 0
    assert all(point.value == 0 for point in reports[-1].queued_requests)
    assert controller.record_autoscaling_metrics_from_handle.calls <= pushes + 1 + 6


def test_a_push_ray_skips_in_flight_is_not_counted_as_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Were it counted, a busy report in flight would be the controller's last word for the
    # whole keep-alive after the load ended.
    _quiet(_CLOCK)
    manager, controller, _ = _manager()
    with manager.wrap_queued_request(is_retry=False, num_curr_replicas=1):
        _tick(manager)
    monkeypatch.setattr(router, "check_obj_ref_ready_nowait", lambda ref: False)
    for _ in range(8):
        _tick(manager)  # idle, but the busy push is still in flight: Ray skips each
    assert controller.record_autoscaling_metrics_from_handle.calls == 1
    monkeypatch.setattr(router, "check_obj_ref_ready_nowait", lambda ref: True)
    _tick(manager)
    assert controller.record_autoscaling_metrics_from_handle.calls == 2
