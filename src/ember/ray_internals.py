"""Every private part of Ray that Ember uses, in one place, each checked before it is trusted.

Ray has no public API for these; a Ray minor release may move any of them. Each entry below
has a check that looks at the installed Ray (the attribute is there, its signature is what
Ember calls, Ray's own code still reads the switch or calls the function Ember wraps). What a
failed check does depends on what the part guards:

* ``refuse``: a door or a policy. The embedded cluster does not start, and says which part
  changed and why it matters (:func:`require`). Ember never runs with a port beyond
  127.0.0.1 or with its scaling policy silently gone.
* ``degrade``: a performance or freshness aid. Ember logs one warning and runs without it,
  as plain Ray Serve would.

Tested with Ray 2.60 (``tests/integration/test_ray_internals.py`` exercises each one live;
``tests/unit/test_ray_internals.py`` breaks each check on purpose).

=====================  =============================================  ====================
Name                   Why Ember needs it                             If Ray changes it
=====================  =============================================  ====================
loopback_node_ip       ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` and    refuse: the node IP
                       ``ray_constants.ENABLE_RAY_CLUSTER``: Ray      would be the
                       resolves 127.0.0.1 to the machine's address    machine's, every Ray
                       unless this flag is off, so without it a       port beyond loopback
                       local cluster binds every port beyond
                       loopback
init_node_ip           ``ray.init(_node_ip_address=)``: the node IP   refuse
                       the local cluster advertises and binds
replica_grpc_bind      ``serve._private.replica.                      refuse: replicas
                       add_port_to_grpc_server``: Serve binds each    would listen on
                       replica's gRPC server to ``[::]``; Ember       every interface
                       narrows it to the node IP
cold_start_fast_path   ``serve.autoscaling_policy.                    refuse: a burst at
                       _get_cold_start_scale_up_replicas``: Ray       zero would start one
                       sizes a cold start to 1 without asking the     replica, not what
                       policy; Ember lets its policy decide           the queue needs
kv_store               ``ray.experimental.internal_kv._internal_kv_*  refuse: leases
                       ``: the cluster's key-value store (floors,     (floors) would not
                       traffic, rollouts, edge metrics, pool          reach the policy
                       failures)
serve_env_switches     ``RAY_SERVE_*`` switches of Serve's            degrade: the switch
                       throughput mode and control-loop interval      is not set; slower
system_config          ``ray.init(_system_config=                     degrade: no warm
                       {"preload_python_modules"})`` (documented      runtime
                       "testing only")
prestart_workers       the raylet's ``PrestartWorkers`` RPC over      degrade: no warm
                       ``ray._private.grpc_utils.init_grpc_channel``  runtime
                       (carries the cluster's auth token), and the
                       ``ray::IDLE`` process title
grpc_by_value          handle option ``_by_reference=False``: the     degrade: handles
                       edges' handles send over Serve's gRPC          send by actor call
router_view            a handle's ``_router._asyncio_router           degrade: the polled
                       ._request_router.curr_replicas`` and a         replica counts are
                       response's ``_replica_result_future``          used
fresh_push_at_zero     ``RouterMetricsManager.should_send_scaled_     degrade: cold starts
                       to_zero_optimized_push`` and ``._add_          wait up to one
                       autoscaling_metrics_point``                    metrics interval
controller_hooks       ``DeploymentStateManager.autoscale``/          degrade: a cold
                       ``update``, ``ActorReplicaWrapper.             start waits up to
                       on_scheduled``/``check_ready`` (their          three control loops
                       ``_allocated_obj_ref``, ``_ready_obj_ref``),   more (0.1 s each)
                       and the order of ``ServeController.
                       run_control_loop_step``: Serve acts on a
                       scale-up and a starting replica a loop
                       later; ``ray_controller`` acts at once
dashboard_address      the key under which Ray stores its dashboard's degrade: status
                       address (``ray_constants.DASHBOARD_ADDRESS``)  omits the dashboard
driver_signal_handlers ``set_sigterm_handler`` and ``CoreWorker``,     degrade: a signal
                       swapped during ``ray.init`` so SIGTERM/SIGINT  during ray.init
                       keep ``ember run``'s drain handlers            meets Ray's handler
=====================  =============================================  ====================

Public APIs replace what they can: the raylet's address (``ray.nodes()``), the job id
(``ray.get_runtime_context()``), the node IP (``ray.util.get_node_ip_address``), the raylet
process (a child of this process named ``raylet``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from ember.errors import RayInternalsChanged as RayInternalsChanged

logger = logging.getLogger("ember.ray_internals")

#: Ray's switch that makes a node advertise 127.0.0.1 (what it does on macOS and Windows).
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
#: The title Ray gives a registered worker that runs nothing.
IDLE_WORKER_TITLE = "ray::IDLE"
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
    for attr in ("should_send_scaled_to_zero_optimized_push", "_add_autoscaling_metrics_point"):
        if not callable(getattr(manager, attr, None)):
            return f"RouterMetricsManager.{attr} is gone"
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
    source = _source(controller_module, "ServeController").split(
        "def run_control_loop_step", 1)[-1].split("\n    def ", 1)[0]
    deployments = source.find("self.deployment_state_manager.update(")
    applications = source.find("self.application_state_manager.update()")
    if deployments < 0 or applications < deployments or "self._proxy_nodes" not in source:
        return ("ServeController.run_control_loop_step no longer updates deployments "
                "(with self._proxy_nodes) before applications")
    return _check_replica_start_polls(state_module)


def _check_replica_start_polls(state_module: str) -> str | None:
    import ray

    wrapper = getattr(importlib.import_module(state_module), "ActorReplicaWrapper", None)
    statuses = getattr(importlib.import_module(state_module), "ReplicaStartupStatus", None)
    if wrapper is None or _params(wrapper.check_ready) != ["self"] or _params(
            wrapper.on_scheduled)[:2] != ["self", "actor_handle"] or not all(
            hasattr(statuses, s) for s in ("PENDING_ALLOCATION", "PENDING_INITIALIZATION")):
        return "ActorReplicaWrapper.check_ready/on_scheduled or ReplicaStartupStatus changed"
    replica = _source(state_module, "ActorReplicaWrapper")
    scheduled = replica.split("def on_scheduled", 1)[-1].split("\n    def ", 1)[0]
    ready = replica.split("def check_ready", 1)[-1].split("\n    def ", 1)[0]
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


# Accessors: the only code in Ember that touches a private Ray name.


def set_driver_loopback_flag() -> None:
    """In the driver, before ``ray.init``: Ray's already-imported copy of the loopback flag.

    Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, at import; the processes it starts
    read it from the environment they inherit.
    """
    from ray._private import ray_constants

    if all(os.environ.get(name) == value for name, value in LOOPBACK_ENV.items()):
        ray_constants.ENABLE_RAY_CLUSTER = False


def init_kwargs(*, node_ip: str | None, system_config: dict[str, Any] | None) -> dict[str, Any]:
    """``ray.init``'s private arguments: the node IP, and raylet settings if Ray takes them."""
    kwargs: dict[str, Any] = {"_node_ip_address": node_ip}
    if system_config and available("system_config"):
        kwargs["_system_config"] = system_config
    return kwargs


def wrap_replica_grpc_bind(wrap: Callable[[Callable[[Any, str], int]],
                                          Callable[[Any, str], int]]) -> None:
    """Replace Serve's replica gRPC bind with ``wrap(original)``, once per process.

    Raises:
        RayInternalsChanged: when Serve no longer binds through it (the replica must not
            start: its server would listen on every interface).
    """
    found = problem("replica_grpc_bind")
    if found is not None:
        raise RayInternalsChanged([f"replica_grpc_bind: {found}"])
    from ray.serve._private import replica

    original = getattr(replica, "add_port_to_grpc_server")  # noqa: B009
    if not getattr(original, "__ember_wrapped__", False):
        wrapped = wrap(original)
        wrapped.__ember_wrapped__ = True  # type: ignore[attr-defined]
        setattr(replica, "add_port_to_grpc_server", wrapped)  # noqa: B010


def wrap_cold_start_fast_path(wrap: Callable[[Callable[[Any], int | None]],
                                             Callable[[Any], int | None]]) -> None:
    """Replace Serve's cold-start fast path with ``wrap(original)``, once per process.

    Raises:
        RayInternalsChanged: when Ray's autoscaler no longer asks it (Ember's policy would
            silently not apply at zero replicas).
    """
    found = problem("cold_start_fast_path")
    if found is not None:
        raise RayInternalsChanged([f"cold_start_fast_path: {found}"])
    from ray.serve import autoscaling_policy as module

    policy: Any = module
    original = policy._get_cold_start_scale_up_replicas
    if not getattr(original, "__ember_wrapped__", False):
        wrapped = wrap(original)
        wrapped.__ember_wrapped__ = True  # type: ignore[attr-defined]
        policy._get_cold_start_scale_up_replicas = wrapped


def handle_by_value_options() -> dict[str, Any]:
    """Handle options that send over Serve's gRPC transport, or {} when Ray lost the option."""
    return {"_by_reference": False} if available("grpc_by_value") else {}


def router_running_replicas(handle: Any) -> int | None:
    """Replicas a handle's router may send to now, or None when that is not known."""
    if not available("router_view"):
        return None
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


def response_assigned(response: Any) -> bool | None:
    """Whether a sent request has reached a replica yet, or None when that is not known."""
    future = getattr(response, "_replica_result_future", None)
    done = getattr(future, "done", None)
    return bool(done()) if callable(done) else None


def wrap_scaled_to_zero_push(after_send: Callable[[Any], None]) -> bool:
    """Call ``after_send(manager)`` whenever a router decides on its cold-start push.

    Returns False (and changes nothing) when Ray moved what this wraps.
    """
    if not available("fresh_push_at_zero"):
        return False
    from ray.serve._private.router import RouterMetricsManager

    manager: Any = RouterMetricsManager
    original: Callable[[Any, int], bool] = manager.should_send_scaled_to_zero_optimized_push
    if getattr(original, "__ember_wrapped__", False):
        return True

    def wrapped(self: Any, curr_num_replicas: int) -> bool:
        send = original(self, curr_num_replicas)
        if send:
            after_send(self)
        return send

    wrapped.__ember_wrapped__ = True  # type: ignore[attr-defined]
    manager.should_send_scaled_to_zero_optimized_push = wrapped
    return True


def record_metrics_point(manager: Any) -> None:
    """Make a router's metrics manager record a sample now."""
    manager._add_autoscaling_metrics_point()


def prestart_workers(count: int, keep_alive_s: int) -> None:
    """Ask this node's raylet to start ``count`` idle Python workers of this job now.

    Raises:
        RuntimeError: when Ray changed the call (the caller runs without a warm runtime).
    """
    if not available("prestart_workers"):
        raise RuntimeError("the raylet's PrestartWorkers call changed")
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
    from ray.core.generated import runtime_environment_pb2 as runtime_env_pb2

    # Ray's generated protobuf modules carry no type information.
    common: Any = common_pb2
    manager: Any = node_manager_pb2
    env_pb2: Any = runtime_env_pb2
    stubs: Any = node_manager_pb2_grpc
    node = this_node()
    channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
    try:
        request = manager.PrestartWorkersRequest(
            language=common.PYTHON,
            job_id=bytes.fromhex(ray.get_runtime_context().get_job_id()),
            # Replicas of an embedded Ember app have no runtime environment: "{}".
            runtime_env_info=env_pb2.RuntimeEnvInfo(serialized_runtime_env="{}"),
            keep_alive_duration_secs=keep_alive_s,
            num_workers=count,
        )
        stubs.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=10)
    finally:
        channel.close()


def dashboard_address() -> str | None:
    """``host:port`` of the cluster's dashboard, where Ray records it; None without one.

    Ray records the address even when it runs the dashboard without its HTTP server
    (``include_dashboard=False``, as ``ember run`` does unless asked), so an address where
    nothing answers counts as none.
    """
    if not available("dashboard_address"):
        return None
    from ray._private import ray_constants

    found = kv_get(ray_constants.DASHBOARD_ADDRESS,
                   namespace=ray_constants.KV_NAMESPACE_DASHBOARD.decode())
    if not found:
        return None
    address = found.decode()
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=0.5):
            return address
    except (OSError, ValueError):
        return None


def this_node() -> dict[str, Any]:
    """This process's node as ``ray.nodes()`` describes it (public API)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return next(n for n in nodes if n["NodeID"] == node_id)


def serve_replica_module() -> list[str]:
    """Serve's replica module, for workers to preload; [] when Ray moved it."""
    import importlib.util

    name = "ray.serve._private.replica"
    try:
        return [name] if importlib.util.find_spec(name) is not None else []
    except ImportError:
        return []


def kv_get(key: str | bytes, *, namespace: str) -> bytes | None:
    """The value at ``key`` in the cluster's key-value store, or None."""
    from ray.experimental import internal_kv

    value = internal_kv._internal_kv_get(key, namespace=namespace)
    return None if value is None else bytes(value)


def kv_put(key: str | bytes, value: bytes, *, namespace: str, overwrite: bool = True) -> bool:
    """Store ``value`` at ``key``; True when the key already existed."""
    from ray.experimental import internal_kv

    return bool(internal_kv._internal_kv_put(key, value, overwrite=overwrite,
                                             namespace=namespace))


def kv_delete(key: str | bytes, *, namespace: str) -> int:
    """Delete ``key``; how many keys went."""
    from ray.experimental import internal_kv

    return int(internal_kv._internal_kv_del(key, namespace=namespace))


def kv_list(prefix: str | bytes, *, namespace: str) -> Iterator[bytes]:
    """Keys that start with ``prefix``."""
    from ray.experimental import internal_kv

    yield from internal_kv._internal_kv_list(prefix, namespace=namespace)


@contextlib.contextmanager
def driver_keeps_signal_handlers(restore: Callable[[], None]) -> Iterator[None]:
    """Around ``ray.init`` in the main thread: skip Ray's ``sys.exit`` SIGTERM handler, and call
    ``restore`` the moment the core worker is built (it installs Abseil's handler, which prints a
    stack and aborts). Without the part (Ray changed), ``ray.init`` runs as Ray has it."""
    if not available("driver_signal_handlers"):
        yield
        return
    import ray._private.utils as ray_utils
    import ray._raylet

    raylet: Any = ray._raylet  # a compiled module: no types to check against
    core_worker, set_handler = raylet.CoreWorker, ray_utils.set_sigterm_handler

    def core_worker_then_restore(*args: Any, **kwargs: Any) -> Any:
        try:
            return core_worker(*args, **kwargs)
        finally:
            restore()

    ray_utils.set_sigterm_handler = lambda _handler: None
    raylet.CoreWorker = core_worker_then_restore
    try:
        yield
    finally:
        raylet.CoreWorker, ray_utils.set_sigterm_handler = core_worker, set_handler
