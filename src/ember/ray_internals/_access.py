"""Accessors: the only code in Ember, beside ``ember.ray_controller``, that touches a private
Ray name; each one asks its check (:func:`available`) before it trusts the part."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from ember.errors import RayInternalsChanged
from ember.ray_internals._checks import LOOPBACK_ENV, available, problem


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


def wrap_scaled_to_zero_push(push_now: Callable[[Any], None]) -> bool:
    """Have ``push_now(manager)`` make every cold-start push of a router, in Ray's stead.

    Ray's router pushes its queue to the controller when a request meets zero replicas;
    with this, ``push_now`` makes that push and Ray's own does not happen. Returns False
    (and changes nothing) when Ray moved what this wraps.
    """
    if not available("fresh_push_at_zero"):
        return False
    from ray.serve._private.router import RouterMetricsManager

    manager: Any = RouterMetricsManager
    original: Callable[[Any, int], bool] = manager.should_send_scaled_to_zero_optimized_push
    if getattr(original, "__ember_wrapped__", False):
        return True

    def wrapped(self: Any, curr_num_replicas: int) -> bool:
        if original(self, curr_num_replicas):
            push_now(self)
        return False  # pushed already, or nothing to push

    wrapped.__ember_wrapped__ = True  # type: ignore[attr-defined]
    manager.should_send_scaled_to_zero_optimized_push = wrapped
    return True


#: The router's last push of demand at zero replicas, kept on its metrics manager.
_DEMAND_PUSH = "_ember_demand_push_ref"


def push_demand_now(manager: Any) -> None:
    """Record a sample of a router's queue and push it to the controller now.

    Ray's push skips itself while the router's previous push is in flight, and its
    periodic pushes (every ``metrics_interval_s``) are in flight often: a request at zero
    then waited for the next periodic push to reach the controller, up to one interval
    later. A periodic push in flight predates the request, so it is forgotten
    here and this push goes; the controller keeps whichever report is newest. Only a demand
    push of this function's own still in flight holds the next one back, so a burst at zero
    sends one push, not one per request.
    """
    manager._add_autoscaling_metrics_point()
    with manager._metrics_push_lock:
        pending = manager._pending_metrics_push_ref
        if pending is not None and pending is not getattr(manager, _DEMAND_PUSH, None):
            manager._pending_metrics_push_ref = None
    manager.push_autoscaling_metrics_to_controller()
    setattr(manager, _DEMAND_PUSH, manager._pending_metrics_push_ref)


#: The router's last periodic push that went: (the clock's time, whether it was idle).
_LAST_PUSH = "_ember_last_push"


def _always_due(idle: bool, idle_when_pushed: bool, since_push_s: float) -> bool:
    return True  # Ray's own behaviour, until an install gives the rule


#: What the quiet push asks, as the latest install gave them: whether a push is due, and when.
_quiet_due: Callable[[bool, bool, float], bool] = _always_due
_quiet_clock: Callable[[], float] = time.monotonic


def wrap_quiet_idle_push(due: Callable[[bool, bool, float], bool],
                         clock: Callable[[], float]) -> bool:
    """Have every router's periodic queue report go only when ``due`` says so.

    ``due(idle, idle_when_pushed, since_push_s)`` decides; a router is idle when nothing is
    queued or running on it and every sample of its look-back window is zero. A push that
    Ray skips (its last one still in flight) does not count as sent. The wrap is installed
    once per process; each call replaces ``due`` and ``clock``. Returns False (and changes
    nothing) when Ray moved what this reads.
    """
    if not available("quiet_idle_push"):
        return False
    from ray.serve._private.router import RouterMetricsManager

    global _quiet_due, _quiet_clock
    _quiet_due, _quiet_clock = due, clock
    manager: Any = RouterMetricsManager
    original: Callable[[Any], None] = manager.push_autoscaling_metrics_to_controller
    if getattr(original, "__ember_wrapped__", False):
        return True

    def wrapped(self: Any) -> None:
        idle, now = _router_idle(self), _quiet_clock()
        last: tuple[float, bool] | None = getattr(self, _LAST_PUSH, None)
        if last is not None and not _quiet_due(idle, last[1], now - last[0]):
            return
        before = self._pending_metrics_push_ref
        original(self)
        # Ray skips a push while its last is in flight, and then leaves the ref as it was:
        # only a new ref means a report left, and only a report that left starts the wait.
        if self._pending_metrics_push_ref is not before:
            setattr(self, _LAST_PUSH, (now, idle))

    wrapped.__ember_wrapped__ = True  # type: ignore[attr-defined]
    manager.push_autoscaling_metrics_to_controller = wrapped
    return True


def _router_idle(manager: Any) -> bool:
    try:
        if manager.num_queued_requests or any(manager.num_requests_sent_to_replicas.values()):
            return False
        return all(point.value == 0 for series in list(manager.metrics_store.data.values())
                   for point in series)
    except Exception:
        # A dict changed while read (another thread), or a field moved since the check ran:
        # call the router busy, so the report goes as Ray would send it. Never stop pushes.
        return False


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
