"""The checks of Ray's private parts (see the package's docstring for the table)."""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ember.errors import RayInternalsChanged

logger = logging.getLogger("ember.ray_internals")
#: Ray's switch that makes a node advertise 127.0.0.1 (what it does on macOS and Windows).
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
#: The title Ray gives a registered worker that runs nothing.
IDLE_WORKER_TITLE = "ray::IDLE"
#: An idle handle's queue report goes to Serve's controller at least this often (see
#: ``control/backoff.idle_push_due``); Serve drops a handle silent for 10 s.
QUIET_PUSH_KEEPALIVE_S = 4.0
#: Serve's switches that Ember sets on the clusters it starts (see cluster/runtime.py).
SERVE_ENV_SWITCHES = (
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT", "RAY_SERVE_FREEZE_GC_ON_STARTUP",
)


@dataclass(frozen=True)
class Internal:
    """One private part of Ray: how to check it, and what a change costs."""

    name: str
    on_change: Literal["refuse", "degrade"]
    check: Callable[[], str | None]  # None when the part is as Ember expects


def _source(module: str, attr: str | None = None) -> str:
    obj: Any = importlib.import_module(module)
    return inspect.getsource(getattr(obj, attr) if attr else obj)


def _method(class_source: str, name: str) -> str:
    """The text of one method in a class's source, up to the next member, async ones too."""
    body = class_source.split(f"def {name}(", 1)[-1]
    return re.split(r"\n    (?:async def |def |@)", body, maxsplit=1)[0]


def _params(func: Any) -> list[str]:
    return list(inspect.signature(func).parameters)


def _missing(module: str, attr: str) -> str | None:
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return f"{module}.{attr} is gone"
    return None if found is not None else f"{module}.{attr} is None"


def _check_loopback_node_ip() -> str | None:
    constants = "ray._private.ray_constants"
    gone = _missing(constants, "ENABLE_RAY_CLUSTER")
    if gone:
        return gone
    (env,) = LOOPBACK_ENV
    if env not in _source(constants):
        return f"{constants} no longer reads {env}"
    if "ENABLE_RAY_CLUSTER" not in _source("ray._private.services", "get_node_ip_address"):
        return "ray._private.services.get_node_ip_address no longer reads ENABLE_RAY_CLUSTER"
    return None


def _check_init_node_ip() -> str | None:
    if '"_node_ip_address"' not in _source("ray._private.worker", "init"):
        return "ray.init no longer takes _node_ip_address"
    return None


def _check_replica_grpc_bind() -> str | None:
    module = "ray.serve._private.replica"
    gone = _missing(module, "add_port_to_grpc_server")
    if gone:
        return gone
    add_port = getattr(importlib.import_module(module), "add_port_to_grpc_server")  # noqa: B009
    if len(_params(add_port)) != 2:
        return f"{module}.add_port_to_grpc_server(server, address) changed signature"
    if "add_port_to_grpc_server(" not in _source(module).split("def add_port_to_grpc_server")[-1]:
        return f"{module} no longer binds its replicas' gRPC server through add_port_to_grpc_server"
    return None


def _check_cold_start_fast_path() -> str | None:
    module = "ray.serve.autoscaling_policy"
    gone = _missing(module, "_get_cold_start_scale_up_replicas")
    if gone:
        return gone
    if _params(importlib.import_module(module)._get_cold_start_scale_up_replicas) != [
            "ctx"]:
        return f"{module}._get_cold_start_scale_up_replicas(ctx) changed signature"
    if "_get_cold_start_scale_up_replicas(ctx)" not in _source(
            module, "_apply_autoscaling_config"):
        return f"{module}._apply_autoscaling_config no longer asks the cold-start fast path"
    return None


_KV = {"_internal_kv_get": "key", "_internal_kv_put": "overwrite",
       "_internal_kv_del": "key", "_internal_kv_list": "prefix"}


def _check_kv_store() -> str | None:
    module = "ray.experimental.internal_kv"
    for name, param in _KV.items():
        gone = _missing(module, name)
        if gone:
            return gone
        params = _params(getattr(importlib.import_module(module), name))
        if param not in params or "namespace" not in params:
            return f"{module}.{name} no longer takes {param} and namespace"
    return None


def unread_serve_env_switches() -> list[str]:
    """Those of :data:`SERVE_ENV_SWITCHES` that Serve's code no longer reads."""
    source = _source("ray.serve._private.constants")
    return [name for name in SERVE_ENV_SWITCHES if f'"{name}"' not in source]


def _check_serve_env_switches() -> str | None:
    unread = unread_serve_env_switches()
    return f"Serve no longer reads {', '.join(unread)}" if unread else None


def _check_system_config() -> str | None:
    if '"_system_config"' not in _source("ray._private.worker", "init"):
        return "ray.init no longer takes _system_config"
    import mmap

    import ray

    # The raylet's settings live in its binary: the name is there while it takes the setting.
    raylet = os.path.join(os.path.dirname(ray.__file__), "core", "src", "ray", "raylet", "raylet")
    with open(raylet, "rb") as binary, mmap.mmap(binary.fileno(), 0,
                                                 access=mmap.ACCESS_READ) as data:
        if data.find(b"preload_python_modules") < 0:
            return "the raylet has no preload_python_modules setting"
    return None


def _check_prestart_workers() -> str | None:
    gone = _missing("ray._private.grpc_utils", "init_grpc_channel") or _missing(
        "ray.core.generated.node_manager_pb2", "PrestartWorkersRequest")
    if gone:
        return gone
    from ray.core.generated import node_manager_pb2_grpc

    if not hasattr(node_manager_pb2_grpc.NodeManagerServiceServicer, "PrestartWorkers"):
        return "the raylet's NodeManagerService has no PrestartWorkers"
    request: Any = importlib.import_module("ray.core.generated.node_manager_pb2")
    fields = set(request.PrestartWorkersRequest.DESCRIPTOR.fields_by_name)
    wanted = {"language", "job_id", "runtime_env_info", "keep_alive_duration_secs",
              "num_workers"}
    return None if wanted <= fields else f"PrestartWorkersRequest lacks {wanted - fields}"


def _check_grpc_by_value() -> str | None:
    from ray.serve.handle import DeploymentHandle

    if "_by_reference" not in _params(DeploymentHandle.options):
        return "DeploymentHandle.options no longer takes _by_reference"
    return None


def _check_router_view() -> str | None:
    from ray.serve._private import router
    from ray.serve._private.request_router import request_router
    from ray.serve.handle import DeploymentResponse

    if not isinstance(getattr(request_router.RequestRouter, "curr_replicas", None), property):
        return "RequestRouter.curr_replicas is gone"
    wanted = [(router.SingletonThreadRouter, "self._asyncio_router ="),
              (router.CurrentLoopRouter, "self._asyncio_router ="),
              (router.AsyncioRouter, "self._request_router ="),
              (router.AsyncioRouter, "self._running_replicas ="),
              (DeploymentResponse, "self._replica_result_future =")]
    for cls, assignment in wanted:
        sources = (inspect.getsource(base) for base in cls.__mro__ if base.__module__.startswith(
            "ray."))
        if not any(assignment in source for source in sources):
            return f"{cls.__name__} no longer sets {assignment.split('.')[1].rstrip(' =')}"
    return None


def _check_fresh_push_at_zero() -> str | None:
    from ray.serve._private import router

    manager = getattr(router, "RouterMetricsManager", None)
    for attr in ("should_send_scaled_to_zero_optimized_push", "_add_autoscaling_metrics_point",
                 "push_autoscaling_metrics_to_controller"):
        if not callable(getattr(manager, attr, None)):
            return f"RouterMetricsManager.{attr} is gone"
    push = _method(_source("ray.serve._private.router", "RouterMetricsManager"),
                   "push_autoscaling_metrics_to_controller")
    if ("with self._metrics_push_lock:" not in push
            or "if self._pending_metrics_push_ref is not None:" not in push
            or "self._pending_metrics_push_ref = (" not in push):
        return ("RouterMetricsManager.push_autoscaling_metrics_to_controller no longer skips "
                "on _pending_metrics_push_ref under _metrics_push_lock")
    return None


#: What Serve's handle report reads from its router: names and config, and the three fields
#: the quiet push judges idleness by (``_access._router_idle``).
_REPORT_FIELDS_JUDGED = frozenset({
    "_deployment_id", "_handle_id", "_handle_source", "_self_actor_id", "autoscaling_config",
    "metrics_store", "num_queued_requests", "num_requests_sent_to_replicas"})


def _router_metrics_manager() -> Any:
    return importlib.import_module("ray.serve._private.router").RouterMetricsManager


def _check_quiet_idle_push() -> str | None:
    from ray.serve._private import constants

    found = _check_fresh_push_at_zero()  # the push and its in-flight ref, as checked there
    if found is not None:
        return found
    record = _method(_source("ray.serve._private.router", "RouterMetricsManager"),
                     "_add_autoscaling_metrics_point")
    if "prune_keys_and_compact_data" not in record:
        # Skipped pushes would leave the samples unpruned: the store would grow unbounded.
        return "RouterMetricsManager._add_autoscaling_metrics_point no longer prunes"
    if not callable(getattr(_router_metrics_manager(), "_get_metrics_report", None)):
        return "RouterMetricsManager._get_metrics_report is gone"
    report = _method(_source("ray.serve._private.router", "RouterMetricsManager"),
                     "_get_metrics_report")
    for attr in ("self.num_queued_requests", "self.num_requests_sent_to_replicas",
                 "self.metrics_store.data"):
        if attr not in report:
            return f"RouterMetricsManager's report no longer reads {attr}"
    # The wrap calls a router idle from these fields alone: a report that reads anything
    # else might carry a load the wrap cannot see, and a quiet push would drop it.
    unjudged = set(re.findall(r"self\.(\w+)", report)) - _REPORT_FIELDS_JUDGED
    if unjudged:
        return f"RouterMetricsManager's report now reads {', '.join(sorted(unjudged))}"
    fields = getattr(importlib.import_module("ray.serve._private.metrics_utils"),
                     "TimeStampedValue", None)
    if "value" not in getattr(fields, "__dataclass_fields__", {}):
        return "TimeStampedValue.value is gone"
    timeout = getattr(constants, "RAY_SERVE_MIN_HANDLE_METRICS_TIMEOUT_S", None)
    if not isinstance(timeout, int | float) or timeout < 2 * QUIET_PUSH_KEEPALIVE_S:
        # A handle silent for the keep-alive would be dropped as stale by the controller.
        return "RAY_SERVE_MIN_HANDLE_METRICS_TIMEOUT_S is gone or under twice the keep-alive"
    return None


def _check_controller_hooks() -> str | None:
    controller_module, state_module = "ray.serve._private.controller", \
        "ray.serve._private.deployment_state"
    gone = _missing(controller_module, "ServeController") or _missing(
        state_module, "DeploymentStateManager")
    if gone:
        return gone
    manager: Any = importlib.import_module(state_module).DeploymentStateManager
    if _params(manager.autoscale) != ["self", "deployment_id", "target_num_replicas"]:
        return "DeploymentStateManager.autoscale changed signature"
    if _params(manager.update) != ["self", "proxy_nodes"] or not callable(
            getattr(manager, "get_deployment_target_num_replicas", None)):
        return "DeploymentStateManager.update or get_deployment_target_num_replicas changed"
    source = _method(_source(controller_module, "ServeController"), "run_control_loop_step")
    deployments = source.find("self.deployment_state_manager.update(")
    applications = source.find("self.application_state_manager.update()")
    if deployments < 0 or applications < deployments or "self._proxy_nodes" not in source:
        return ("ServeController.run_control_loop_step no longer updates deployments "
                "(with self._proxy_nodes) before applications")
    return (_check_replica_start_polls(state_module) or _check_demand_reports()
            or _check_actor_class_cache())


def _check_actor_class_cache() -> str | None:
    """``DeploymentInfo.actor_def``: a class made from the actor name alone, cached on the
    info (``ray_controller`` shares it between the copies Serve makes of an info)."""
    module = "ray.serve._private.deployment_info"
    gone = _missing(module, "DeploymentInfo")
    if gone:
        return gone
    actor_def = getattr(importlib.import_module(module).DeploymentInfo, "actor_def", None)
    made = actor_def.fget if isinstance(actor_def, property) else None
    source = inspect.getsource(made) if made is not None else ""
    if ("self._cached_actor_def is None" not in source or "self.actor_name," not in source
            or "(ReplicaActor,)" not in source):
        return "DeploymentInfo.actor_def no longer caches a class made from the actor name"
    return None


def _check_demand_reports() -> str | None:
    """What ``ray_controller`` reads to decide when a handle reports a request at zero."""
    apps_module, metrics_module = "ray.serve._private.application_state", \
        "ray.serve._private.autoscaling_state"
    gone = _missing(apps_module, "ApplicationStateManager") or _missing(
        metrics_module, "AutoscalingStateManager")
    if gone:
        return gone
    metrics: Any = importlib.import_module(metrics_module).AutoscalingStateManager
    if (_params(metrics.record_request_metrics_for_handle) != ["self", "handle_metric_report"]
            or _params(metrics.record_columnar_metrics_for_handle) != ["self", "payload"]):
        return "AutoscalingStateManager's handle reports changed signature"
    apps = importlib.import_module(apps_module)
    state: Any = getattr(apps, "ApplicationState", None)
    if (_params(apps.ApplicationStateManager.update) != ["self"]
            or "self._application_states: Dict[str, ApplicationState]" not in _source(
                apps_module, "ApplicationStateManager")
            or _params(state.autoscale) != ["self"] or _params(state.should_autoscale) != ["self"]):
        return "ApplicationStateManager.update, _application_states or autoscale changed"
    report = _source("ray.serve._private.common", "HandleMetricReport")
    flat = _source("ray.serve._private.autoscaling_metrics_codec", "FlatHandleReport")
    if "queued_requests: TimeSeries" not in report or "q_val: np.ndarray" not in flat:
        return "a handle's report no longer carries its queue as queued_requests / q_val"
    return None


def _check_replica_start_polls(state_module: str) -> str | None:
    import ray

    wrapper = getattr(importlib.import_module(state_module), "ActorReplicaWrapper", None)
    statuses = getattr(importlib.import_module(state_module), "ReplicaStartupStatus", None)
    if wrapper is None or _params(wrapper.check_ready) != ["self"] or _params(
            wrapper.on_scheduled)[:2] != ["self", "actor_handle"] or not all(
            hasattr(statuses, s) for s in ("PENDING_ALLOCATION", "PENDING_INITIALIZATION")):
        return "ActorReplicaWrapper.check_ready/on_scheduled or ReplicaStartupStatus changed"
    replica = _source(state_module, "ActorReplicaWrapper")
    scheduled, ready = _method(replica, "on_scheduled"), _method(replica, "check_ready")
    if "self._allocated_obj_ref = " not in scheduled or not all(
            f"self.{ref}" in ready for ref in ("_allocated_obj_ref", "_ready_obj_ref")):
        return ("ActorReplicaWrapper no longer sets _allocated_obj_ref in on_scheduled or "
                "polls it and _ready_obj_ref in check_ready")
    if not callable(getattr(ray.ObjectRef, "future", None)):
        return "ray.ObjectRef.future is gone"
    return None


def _check_dashboard_address() -> str | None:
    return _missing("ray._private.ray_constants", "DASHBOARD_ADDRESS") or _missing(
        "ray._private.ray_constants", "KV_NAMESPACE_DASHBOARD")


def _check_driver_signal_handlers() -> str | None:
    found = _missing("ray._private.utils", "set_sigterm_handler") or _missing(
        "ray._raylet", "CoreWorker")
    if found is None and "set_sigterm_handler" not in _source("ray._private.worker", "init"):
        return "ray.init no longer sets its SIGTERM handler through set_sigterm_handler"
    return found


INTERNALS = (
    Internal("loopback_node_ip", "refuse", _check_loopback_node_ip),
    Internal("init_node_ip", "refuse", _check_init_node_ip),
    Internal("replica_grpc_bind", "refuse", _check_replica_grpc_bind),
    Internal("cold_start_fast_path", "refuse", _check_cold_start_fast_path),
    Internal("kv_store", "refuse", _check_kv_store),
    Internal("serve_env_switches", "degrade", _check_serve_env_switches),
    Internal("system_config", "degrade", _check_system_config),
    Internal("prestart_workers", "degrade", _check_prestart_workers),
    Internal("grpc_by_value", "degrade", _check_grpc_by_value),
    Internal("router_view", "degrade", _check_router_view),
    Internal("fresh_push_at_zero", "degrade", _check_fresh_push_at_zero),
    Internal("quiet_idle_push", "degrade", _check_quiet_idle_push),
    Internal("controller_hooks", "degrade", _check_controller_hooks),
    Internal("dashboard_address", "degrade", _check_dashboard_address),
    Internal("driver_signal_handlers", "degrade", _check_driver_signal_handlers),
)
_BY_NAME = {internal.name: internal for internal in INTERNALS}


def problem(name: str) -> str | None:
    """What changed in the private part ``name``, or None when it is as Ember expects."""
    try:
        return _BY_NAME[name].check()
    except Exception as exc:  # a check that cannot even look is a change too
        return f"{name}: {type(exc).__name__}: {exc}"


@functools.cache
def available(name: str) -> bool:
    """Whether a degradable part is usable; logs once, with the reason, when it is not."""
    found = problem(name)
    if found is not None:
        logger.warning("Ray changed %s (%s); Ember runs without it", name, found)
    return found is None


def require(*, local: bool) -> None:
    """Refuse to go on when a part that keeps a door shut or a policy applied has changed.

    Args:
        local: Whether Ember is about to start a local cluster (its loopback parts count).

    Raises:
        RayInternalsChanged: with every reason found.
    """
    local_only = {"loopback_node_ip", "init_node_ip"}
    problems = [f"{i.name}: {found}" for i in INTERNALS
                if i.on_change == "refuse" and (local or i.name not in local_only)
                and (found := problem(i.name)) is not None]
    if problems:
        raise RayInternalsChanged(problems)
