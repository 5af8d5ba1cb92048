"""The checks of Ray's private parts, run against the installed Ray, and each broken once.

Each check must pass on the Ray Ember is tested with and fail when the part it guards is
taken away; the parts that keep a door shut or a policy applied must stop the start.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ember import ray_controller, ray_internals
from ember.control.listeners import cluster_access, verify_loopback
from ember.ray_internals import _checks as checks

SRC = Path(__file__).resolve().parents[2] / "src" / "ember"
#: Files still allowed to call internal_kv directly: none (all go through ray_internals).
_KV_PENDING: set[str] = set()
_PRIVATE = re.compile(
    r"ray\._|_private\b|\._raylet|_internal_kv|\b_system_config|\b_node_ip_address|"
    r"ENABLE_RAY_CLUSTER|add_port_to_grpc_server|_get_cold_start|curr_replicas|"
    r"RouterMetricsManager|\b_by_reference|_asyncio_router|_replica_result_future|"
    r"global_worker|_global_node|PrestartWorkersRequest")


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    ray_internals.available.cache_clear()
    yield
    ray_internals.available.cache_clear()


@pytest.mark.parametrize("name", [i.name for i in ray_internals.INTERNALS])
def test_each_private_part_is_as_ember_expects_on_the_installed_ray(name: str) -> None:
    assert ray_internals.problem(name) is None


def test_nothing_outside_ray_internals_names_a_private_part_of_ray() -> None:
    found = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("ray_internals/") or rel == "ray_controller.py":  # the controller part
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _PRIVATE.search(code) and not (rel in _KV_PENDING and "_internal_kv" in code):
                found.append(f"{rel}:{number}: {line.strip()}")
    # Docstrings may name them (warm_runtime explains PrestartWorkers): only code counts.
    assert [f for f in found if "``" not in f] == []


def _breaks() -> list[tuple[str, str, str]]:
    """(internal, module, attribute) whose removal each check must notice."""
    return [
        ("loopback_node_ip", "ray._private.ray_constants", "ENABLE_RAY_CLUSTER"),
        ("replica_grpc_bind", "ray.serve._private.replica", "add_port_to_grpc_server"),
        ("cold_start_fast_path", "ray.serve.autoscaling_policy",
         "_get_cold_start_scale_up_replicas"),
        ("kv_store", "ray.experimental.internal_kv", "_internal_kv_list"),
        ("prestart_workers", "ray._private.grpc_utils", "init_grpc_channel"),
        ("controller_hooks", "ray.serve._private.deployment_state",
         "DeploymentStateManager"),
        ("controller_hooks", "ray.serve._private.autoscaling_state",
         "AutoscalingStateManager"),
        ("controller_hooks", "ray.serve._private.deployment_info", "DeploymentInfo"),
        ("fresh_push_at_zero", "ray.serve._private.router",
         "RouterMetricsManager.push_autoscaling_metrics_to_controller"),
        ("quiet_idle_push", "ray.serve._private.router",
         "RouterMetricsManager.push_autoscaling_metrics_to_controller"),
    ]


@pytest.mark.parametrize(("name", "module", "attr"), _breaks())
def test_a_removed_private_part_is_noticed(monkeypatch: pytest.MonkeyPatch, name: str,
                                           module: str, attr: str) -> None:
    import importlib

    # Loaded first, as in a running process: importing it after the delete fails on its own
    # imports, and the check would report the controller gone instead of the part removed.
    importlib.import_module("ray.serve._private.controller")
    *owners, last = attr.split(".")  # a dotted attribute: one of a class in the module
    target = importlib.import_module(module)
    for owner in owners:
        target = getattr(target, owner)
    monkeypatch.delattr(target, last)
    assert f"{attr} is gone" in (ray_internals.problem(name) or "")


def test_a_push_that_no_longer_skips_on_its_pending_ref_is_noticed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = checks._source

    def renamed(module: str, attr: str | None = None) -> str:
        text = real(module, attr)
        return text.replace("_pending_metrics_push_ref", "_in_flight") if (
            attr == "RouterMetricsManager") else text

    monkeypatch.setattr(checks, "_source", renamed)
    assert "_pending_metrics_push_ref" in (ray_internals.problem("fresh_push_at_zero") or "")


def test_quiet_pushes_are_refused_when_skipped_samples_would_go_unpruned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = checks._source

    def unpruned(module: str, attr: str | None = None) -> str:
        text = real(module, attr)
        return text.replace("prune_keys_and_compact_data", "compact") if (
            attr == "RouterMetricsManager") else text

    monkeypatch.setattr(checks, "_source", unpruned)
    assert "no longer prunes" in (ray_internals.problem("quiet_idle_push") or "")


def _report_source_edited(monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    real = checks._source

    def edited(module: str, attr: str | None = None) -> str:
        text = real(module, attr)
        return text.replace(old, new) if attr == "RouterMetricsManager" else text

    monkeypatch.setattr(checks, "_source", edited)


def test_quiet_pushes_are_refused_when_the_report_stops_reading_a_judged_field(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _report_source_edited(monkeypatch, "self.num_queued_requests", "self.queue_length")
    found = ray_internals.problem("quiet_idle_push") or ""
    assert "no longer reads self.num_queued_requests" in found


def test_quiet_pushes_are_refused_when_the_report_reads_a_field_they_do_not_judge(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A new load figure in the report: the wrap would call a router idle that is not.
    _report_source_edited(monkeypatch, "timestamp=timestamp,",
                          "timestamp=timestamp, pending=self.num_pending_streams,")
    assert "now reads num_pending_streams" in (ray_internals.problem("quiet_idle_push") or "")


def test_quiet_pushes_are_refused_when_the_report_builder_is_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve._private.router import RouterMetricsManager

    monkeypatch.delattr(RouterMetricsManager, "_get_metrics_report")
    assert "_get_metrics_report is gone" in (ray_internals.problem("quiet_idle_push") or "")


def test_quiet_pushes_are_refused_when_a_sample_has_no_value(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from ray.serve._private import metrics_utils

    @dataclasses.dataclass
    class Renamed:
        timestamp: float
        amount: float

    monkeypatch.setattr(metrics_utils, "TimeStampedValue", Renamed)
    assert "TimeStampedValue.value is gone" in (ray_internals.problem("quiet_idle_push") or "")


def test_a_router_whose_fields_moved_is_called_busy_so_its_reports_still_go() -> None:
    from types import SimpleNamespace

    from ember.ray_internals import _access

    assert _access._router_idle(SimpleNamespace()) is False  # AttributeError: never quiet
    idle = SimpleNamespace(num_queued_requests=0, num_requests_sent_to_replicas={},
                           metrics_store=SimpleNamespace(data={}))
    assert _access._router_idle(idle) is True


def test_quiet_pushes_are_refused_when_serve_drops_silent_handles_sooner(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve._private import constants

    monkeypatch.setattr(constants, "RAY_SERVE_MIN_HANDLE_METRICS_TIMEOUT_S",
                        ray_internals.QUIET_PUSH_KEEPALIVE_S)
    assert "keep-alive" in (ray_internals.problem("quiet_idle_push") or "")


def test_refusing_parts_stop_the_start_with_every_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve import autoscaling_policy
    from ray.serve._private import replica

    monkeypatch.delattr(replica, "add_port_to_grpc_server")
    monkeypatch.delattr(autoscaling_policy, "_get_cold_start_scale_up_replicas")
    with pytest.raises(ray_internals.RayInternalsChanged) as refused:
        ray_internals.require(local=True)
    assert [p.split(":")[0] for p in refused.value.problems] == [
        "replica_grpc_bind", "cold_start_fast_path"]
    assert "refusing to start" in str(refused.value)


def test_a_wrapper_whose_target_ray_no_longer_calls_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The function is there but Ray's autoscaler stopped asking it: patching it would be a
    # policy silently gone.
    from ray.serve import autoscaling_policy

    before = autoscaling_policy._get_cold_start_scale_up_replicas
    monkeypatch.setattr(checks, "_source", lambda module, attr=None: "")
    with pytest.raises(ray_internals.RayInternalsChanged, match="cold_start_fast_path"):
        ray_internals.wrap_cold_start_fast_path(lambda original: original)
    assert autoscaling_policy._get_cold_start_scale_up_replicas is before  # untouched


def test_an_env_switch_serve_no_longer_reads_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    real = checks._source

    def without_grpc_switch(module: str, attr: str | None = None) -> str:
        return real(module, attr).replace('"RAY_SERVE_USE_GRPC_BY_DEFAULT"', '"RENAMED"')

    monkeypatch.setattr(checks, "_source", without_grpc_switch)
    assert ray_internals.unread_serve_env_switches() == ["RAY_SERVE_USE_GRPC_BY_DEFAULT"]
    assert not ray_internals.available("serve_env_switches")


def test_a_degradable_part_falls_back_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from ray.serve.handle import DeploymentHandle

    def options(self: Any, *, method_name: str = "") -> Any:  # a Ray without _by_reference
        return self

    assert ray_internals.handle_by_value_options() == {"_by_reference": False}
    ray_internals.available.cache_clear()
    monkeypatch.setattr(DeploymentHandle, "options", options)
    with caplog.at_level(logging.WARNING, logger="ember.ray_internals"):
        assert ray_internals.handle_by_value_options() == {}
        assert ray_internals.handle_by_value_options() == {}
    assert [r.getMessage() for r in caplog.records] == [
        "Ray changed grpc_by_value (DeploymentHandle.options no longer takes _by_reference); "
        "Ember runs without it"]


def test_router_view_answers_none_when_ray_moved_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve._private.request_router import request_router

    monkeypatch.delattr(request_router.RequestRouter, "curr_replicas")
    assert ray_internals.router_running_replicas(object()) is None


def test_a_cluster_beyond_loopback_is_refused() -> None:
    verify_loopback("127.0.0.1:6379", "127.0.0.1")
    with pytest.raises(ray_internals.RayInternalsChanged, match=r"gcs is on 10\.0\.0\.5"):
        verify_loopback("10.0.0.5:6379", "127.0.0.1")
    with pytest.raises(ray_internals.RayInternalsChanged, match=r"node is on 10\.0\.0\.5"):
        verify_loopback("[::1]:6379", "10.0.0.5")


def test_the_line_that_reaches_a_loopback_cluster() -> None:
    access = cluster_access("127.0.0.1:6379", token_auth=True, dashboard="127.0.0.1:8265")
    env = "RAY_ADDRESS=127.0.0.1:6379 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token"
    assert access["ray_status"] == f"{env} ray status"
    assert access["serve_status"] == (
        f"{env} RAY_DASHBOARD_ADDRESS=http://127.0.0.1:8265 serve status")
    remote = cluster_access("10.0.0.5:6379", token_auth=False)
    assert remote["ray_status"] == "RAY_ADDRESS=10.0.0.5:6379 ray status"
    assert remote["serve_status"] is None and remote["dashboard"] is None


def test_a_step_that_runs_the_policies_first_is_left_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve._private.deployment_state import DeploymentStateManager

    real = checks._source

    def applications_first(module: str, attr: str | None = None) -> str:
        step = real(module, attr)
        return step.replace("self.application_state_manager.update()", "") if (
            attr == "ServeController") else step

    before = DeploymentStateManager.autoscale
    monkeypatch.setattr(checks, "_source", applications_first)
    assert "before applications" in (ray_internals.problem("controller_hooks") or "")
    assert not ray_controller.move_on_at_once("a")
    assert DeploymentStateManager.autoscale is before  # untouched
