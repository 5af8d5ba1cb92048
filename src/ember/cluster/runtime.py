"""Starting and stopping Ember on a Ray cluster.

``serve(app)`` joins ``RAY_ADDRESS`` when it is set, or starts an embedded local cluster,
then deploys the app with Ray Serve: one Serve deployment per Ember deployment, the warm
pool, and the edges that listen for HTTP. Nothing here schedules replicas; Ray Serve does.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray import serve

from ember import ray_internals, settings
from ember.app.app import App
from ember.app.config import SHUTDOWN_WAIT_LOOP_S, serve_logging, to_ray_options
from ember.cluster import lifecycle
from ember.cluster.defaults import DEFAULT_HOST as DEFAULT_HOST
from ember.cluster.defaults import DEFAULT_PORT as DEFAULT_PORT
from ember.cluster.defaults import EDGE_NUM_CPUS as EDGE_NUM_CPUS
from ember.cluster.defaults import POOL_NUM_CPUS as POOL_NUM_CPUS
from ember.cluster.defaults import default_port as default_port
from ember.control import snapshot_placement, store, warm_runtime
from ember.control.listeners import (
    LOCAL_CLUSTER_ENV,
    LOOPBACK,
    use_loopback_node_ip,
    verify_loopback,
)
from ember.control.pool import GPU_POOL_DEPLOYMENT, POOL_DEPLOYMENT, EmberPool
from ember.control.replica import replica_class
from ember.control.warm_env import WARM_IMPORTS_ENV, light_runtime_env
from ember.edge.auth import ApiKeys, check_exposure
from ember.edge.drain import STEADY_WATCH_PERIOD_S
from ember.edge.edge import (
    DRAIN_S,
    EDGE_DEPLOYMENT,
    HEALTH_CHECK_PERIOD_S,
    EmberEdge,
    edge_placement,
)
from ember.edge.ratelimit import RateLimiter
from ember.loaders import snapshot_key

logger = logging.getLogger("ember")


#: Ray Serve's in-process throughput settings (part of its ``RAY_SERVE_THROUGHPUT_OPTIMIZED``
#: mode), set for the clusters Ember starts. Measured on 2 cores with MiniLM at concurrency 32
#: (``bench/throughput.py``): 10-30% more requests per second, because each request
#: costs less CPU in Serve's proxy, the ingress (both since replaced by the edges) and the
#: replicas. Ember's replica methods are async and run sync user code in worker threads, so user
#: code may share the replica's event loop. The rest of that mode (direct ingress, HAProxy) is
#: left off: HAProxy listens on every interface, and Ember's edges do direct ingress's job.
#: Values already in the environment win; on an existing cluster set them where ``ray start``
#: runs.
THROUGHPUT_SETTINGS = {
    # User code and the handles' routers share the replica's event loop instead of each
    # running in a thread of its own (no cross-thread hand-offs per request). A handle used
    # from sync code then needs its router back in a loop of its own: offline workers in share
    # mode set SYNC_HANDLE_ENV (below).
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # Handles talk to replicas over direct gRPC, not through the object store (the edges
    # restate it on their handles: see edge/_dispatch.py).
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    # Objects alive after a replica's constructor are never scanned by the GC again.
    "RAY_SERVE_FREEZE_GC_ON_STARTUP": "1",
}

# Serve's control loop keeps Ray's 0.1 s. Ember once set 0.05 s for the own replica's cold
# start (the controller walks a new replica through its states one tick per step): later
# same-session runs of bench/coldstart.py measured no gain from it, and it cost the idle
# controller about 2% of a core. An operator's RAY_SERVE_CONTROL_LOOP_INTERVAL_S still wins.

#: Environment of a Ray worker that calls deployment handles from sync code.
SYNC_HANDLE_ENV = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}

def build_application(app: App, *, host: str = DEFAULT_HOST, port: int | None = None) -> Any:
    """The Ray Serve application for ``app``: its edges, bound to every deployment's handle.

    The edges listen on ``host:port`` themselves (see ``edge/edge.py``); Serve's HTTP proxy
    plays no part, so the application has no route prefix.
    """
    handles: dict[str, Any] = {}
    options = {}
    placements = snapshot_placements(app)
    for spec in app.specs:
        opts = spec.options.with_env_overrides()
        options[spec.name] = opts
        ray_options = to_ray_options(opts, name=spec.name, placement=placements.get(spec.name))
        deployment = serve.deployment(**ray_options)(replica_class(spec))
        handles[spec.name] = deployment.bind()
    # Nodes that can run an edge: a head started with no CPUs (as on Kubernetes) cannot.
    nodes = [n for n in ray.nodes()  # type: ignore[no-untyped-call]
             if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    edges, per_node = edge_placement(len(nodes))
    edge = serve.deployment(
        name=EDGE_DEPLOYMENT,
        num_replicas=edges,
        max_replicas_per_node=per_node,
        # Nothing calls an edge through Serve; its requests arrive on its own socket.
        max_ongoing_requests=1,
        ray_actor_options=_light({"num_cpus": EDGE_NUM_CPUS}),
        logging_config=serve_logging(),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=DRAIN_S + 5,
        # Serve counts only calls through its handles, and an edge gets none: its drain is
        # in ``EmberEdge.__del__`` (requests on its socket finish there). Serve's default
        # (2 s) was a plain 2 s sleep before that, on every stop of the server.
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
    )(EmberEdge)
    state_args = {
        "app_name": app.name, "routes": list(app.routes()), "options": options,
        "handles": handles, "timeouts": app.timeouts(), "protocols": app.protocols,
        "pool": _pool_deployment(app),
        "pool_names": frozenset(s.name for s in app.pool_specs()),
        "gpu_pool": _pool_deployment(app, gpu=True),
        "gpu_pool_names": frozenset(s.name for s in app.pool_specs(gpu=True)),
        "versions": app.versions, "labels": {s.name: s.version for s in app.served},
        # Read where the operator set them; only key digests travel to the edges.
        "keys": ApiKeys.from_env(), "limiter": RateLimiter.from_env(),
    }
    # Refuse here too, before anything is deployed: the edges would refuse to start.
    check_exposure(host, state_args["keys"])
    return edge.bind(host, default_port() if port is None else port, state_args)


def _light(actor_options: dict[str, Any]) -> dict[str, Any]:
    """``actor_options`` for a process that needs none of the warm runtime's imports."""
    runtime_env = light_runtime_env()
    return {**actor_options, "runtime_env": runtime_env} if runtime_env else actor_options


def snapshot_placements(app: App) -> dict[str, dict[str, Any]]:
    """Deployment name -> actor options preferring the nodes that hold its snapshot."""
    keys = {spec.name: snapshot_key(spec.options.snapshot_url, spec.options.snapshot_version)
            for spec in app.specs if spec.options.snapshot_url}
    if not keys:
        return {}
    found = snapshot_placement.holders(sorted(set(keys.values())))
    return {name: snapshot_placement.prefer_nodes(found[key]) for name, key in keys.items()}


def _pool_deployment(app: App, *, gpu: bool = False) -> Any:
    """The bound CPU (or GPU) warm pool of ``app``, or None when it has none."""
    specs = app.pool_specs(gpu=gpu)
    if not specs:
        return None
    preload = [s.name for s in specs if s.options.preload]
    pool = serve.deployment(
        name=GPU_POOL_DEPLOYMENT if gpu else POOL_DEPLOYMENT,
        num_replicas=app.warm_pool,
        # Requests reach the pool only while a deployment is cold; it must not queue them.
        max_ongoing_requests=512,
        ray_actor_options={"num_cpus": POOL_NUM_CPUS},
        logging_config=serve_logging(),
        # Preloading runs setup() of every preloaded deployment before the pool is ready.
        health_check_timeout_s=60,
        # Counted sooner, not waited less: requests in flight still finish (Serve's default
        # sleeps 2 s before the first count even with none).
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
    )(EmberPool)
    return pool.bind(specs, preload, app.warm_pool_bytes, app.name, gpu=gpu,
                     park_after_s=settings.load().gpu_pool_park_after_s)


#: Keeps the warm runtime's idle workers while this process's local cluster runs.
_refiller: warm_runtime.Refiller | None = None
#: How long ``serve_app`` waits for them before it returns (importing torch takes seconds).
_WARM_RUNTIME_WAIT_S = 60.0


def app_modules(app: App) -> list[str]:
    """Modules that define ``app``'s deployments and those it asks to preload (what a
    warm-runtime worker imports)."""
    return sorted({spec.cls.__module__ for spec in app.specs} | set(app.preload_modules))


def start_ray(*, address: str | None = None, num_cpus: float | None = None,
              preload: list[str] | None = None, warm: bool | None = None,
              dashboard_port: int = 0) -> bool:
    """Join ``address`` (or ``RAY_ADDRESS``), else start a local cluster; idempotent.

    Args:
        preload: Modules every worker of a local cluster imports before it takes work
            (the warm runtime); torch and Ember's replica code are always among them.
        warm: Whether a local cluster's workers preload at all; None reads
            ``EMBER_WARM_RUNTIME`` (off at 0).
        dashboard_port: Start Ray's dashboard on 127.0.0.1 at this port (local cluster only;
            0: no dashboard).

    Returns:
        True if this call started a local cluster.
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    # Before anything starts: a Ray that moved what keeps a door shut or a policy applied
    # is refused here, with the reason (see ember/ray_internals/).
    ray_internals.require(local=address is None)
    user_paths = _user_module_paths()
    if address is None and user_paths:
        # Local workers inherit this environment, so user modules import there by name.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [*user_paths, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
    if address is None:
        _set_local_cluster_env()
        use_loopback_node_ip()
    runtime_env = {"working_dir": user_paths[0]} if address and user_paths else None
    warm = address is None and (settings.load().warm_runtime > 0 if warm is None else warm)
    # Every worker of the cluster inherits it: what the preloaded gate imports (none of it
    # where Ember joins a cluster or the warm runtime is off).
    os.environ.pop(WARM_IMPORTS_ENV, None)
    if warm and ray_internals.available("system_config"):
        os.environ.update(warm_runtime.worker_env(preload or []))
    dashboard_port = dashboard_port if address is None else 0
    # SIGTERM and SIGINT stay with this process's handlers (a drain), not Ray's.
    with lifecycle.ray_init_keeps_handlers():
        ray.init(
            # "local", not None: with None Ray joins the cluster its bootstrap file
            # (ray_current_cluster) names, someone else's on a shared machine.
            address=address or "local",
            num_cpus=None if address else (int(num_cpus) if num_cpus else None),
            include_dashboard=dashboard_port > 0,
            # Only when asked for, and then on loopback like the rest.
            dashboard_host=LOOPBACK,
            dashboard_port=dashboard_port or None,
            runtime_env=runtime_env,
            logging_level=logging.WARNING,
            configure_logging=True,
            # A local cluster is reachable from this machine only (see control/listeners.py).
            **ray_internals.init_kwargs(
                node_ip=None if address else LOOPBACK,
                system_config=warm_runtime.system_config() if warm else None),
        )
    if address is None:
        try:
            verify_loopback(ray.get_runtime_context().gcs_address,
                            str(ray.util.get_node_ip_address()))  # type: ignore[no-untyped-call]
        except ray_internals.RayInternalsChanged:
            ray.shutdown()
            raise
    return address is None


def _set_local_cluster_env() -> None:
    """The environment local workers and Serve's controller inherit; set values win."""
    serve_switches = dict(THROUGHPUT_SETTINGS)
    if not ray_internals.available("serve_env_switches"):
        # Only the switches Serve still reads: one it ignores is a no-op, not a risk.
        unread = ray_internals.unread_serve_env_switches()
        serve_switches = {k: v for k, v in serve_switches.items() if k not in unread}
    for name, value in {**serve_switches, **LOCAL_CLUSTER_ENV}.items():
        os.environ.setdefault(name, value)


def serve_app(app: App, *, host: str = DEFAULT_HOST, port: int | None = None,
              stop: threading.Event | None = None, dashboard_port: int = 0,
              state_dir: Path | None = None) -> str:
    """Deploy ``app`` and return its base URL; returns once the app is running.

    The edges answer ``/readyz`` 200 only once this returns (and the warm runtime of a local
    cluster is up or given up on). ``stop`` set meanwhile cuts the waits short; the app is
    then left starting (not ready) for the caller to drain and shut down.

    Args:
        state_dir: Where the operator's settings live when this call starts a local
            cluster (``control/store.py``); when it joins a cluster they live in the
            cluster's GCS.

    Example:
        >>> url = serve_app(my_app)            # doctest: +SKIP
        >>> httpx.post(f"{url}/mlp", json=...)  # doctest: +SKIP
    """
    global _refiller
    stop = stop or threading.Event()
    started_here = start_ray(preload=app_modules(app), dashboard_port=dashboard_port)
    port = default_port() if port is None else port
    # Before anything of the app starts: every process reads it once.
    store.announce(app.name, state_dir if started_here else None)
    lifecycle.set_phase(app.name, lifecycle.STARTING)
    if started_here and _refiller is None:
        # Started now, the idle workers import torch while Serve starts and the edges (light
        # workers, which take none of them) start. The app's first replicas (pool, floors)
        # take some as they start; the refiller tops them up.
        _refiller = warm_runtime.Refiller(settings.load().warm_runtime)
        _refiller.start()
    # Ember's edges take the place of Serve's HTTP proxy (see edge/edge.py). Serve's
    # controller is not a light worker: the replicas it creates inherit its runtime
    # environment, and one of their own would keep them from the idle workers.
    serve.start(proxy_location="Disabled")
    serve.run(build_application(app, host=host, port=port), name=app.name, route_prefix=None,
              blocking=False)
    if started_here and _refiller is not None:
        _wait_deployed(app.name, _WARM_RUNTIME_WAIT_S, stop)
        if stop.is_set():  # asked to stop while deploying
            return f"http://{host}:{port}"
        if not _wait_warm(_refiller, _WARM_RUNTIME_WAIT_S, stop) and not stop.is_set():
            logger.warning("the warm runtime's workers are not up yet; the first cold starts "
                           "may start fresh processes")
    if not stop.is_set():
        lifecycle.set_phase(app.name, lifecycle.SERVING)
    return f"http://{host}:{port}"


def _wait_deployed(name: str, timeout_s: float, stop: threading.Event) -> None:
    """Wait until Serve is done starting ``name``'s replicas, however that ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        app = serve.status().applications.get(name)
        if app is not None and app.status not in ("NOT_STARTED", "DEPLOYING"):
            return
        stop.wait(0.2)


def _wait_warm(refiller: warm_runtime.Refiller, timeout_s: float, stop: threading.Event) -> bool:
    """Wait for the warm runtime's workers, a slice at a time so that ``stop`` is seen."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        if refiller.wait_ready(min(0.5, max(0.0, deadline - time.monotonic()))):
            return True
        if time.monotonic() >= deadline:
            return False
    return False


def drain(app: App, *, interrupted: Callable[[], bool] = lambda: False) -> bool:
    """Have the edges refuse new requests and wait for those in flight, up to the longest
    ``graceful_shutdown_s`` of the app's deployments.

    Returns:
        True when nothing was left in flight; False when time ran out or ``interrupted()``.
    """
    timeout_s = max(spec.options.with_env_overrides().graceful_shutdown_s
                    for spec in app.specs)
    status = serve.status().applications.get(app.name)
    edge = status.deployments.get(EDGE_DEPLOYMENT) if status is not None else None
    edges = sum(int(n) for state, n in (edge.replica_states if edge is not None else {}).items()
                if getattr(state, "value", state) == "RUNNING")
    # A serving edge reads the phase at least every STEADY_WATCH_PERIOD_S: give it that to
    # report.
    return lifecycle.drain(app.name, edges=edges,
                           timeout_s=timeout_s + 2 * STEADY_WATCH_PERIOD_S,
                           interrupted=interrupted)


def shutdown() -> None:
    """Tear down Serve and, if this process started it, the local Ray cluster."""
    global _refiller
    if _refiller is not None:
        _refiller.stop()
        _refiller = None
    if not ray.is_initialized():
        return  # nothing started (serve.shutdown would start a local Ray just to stop it)
    try:
        serve.shutdown()  # type: ignore[no-untyped-call]
    finally:
        if ray.is_initialized():
            ray.shutdown()


def _user_module_paths() -> list[str]:
    """Directories of user code on ``sys.path`` (cwd and app files), not site-packages."""
    paths: list[str] = []
    for entry in sys.path:
        if not entry or "site-packages" in entry or "dist-packages" in entry:
            continue
        path = Path(entry).resolve()
        is_user_dir = path.is_dir() and not str(path).startswith(sys.base_prefix)
        if is_user_dir and path != Path(sys.prefix).resolve() and str(path) not in paths:
            paths.append(str(path))
    return paths
