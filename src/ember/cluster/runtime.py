"""Starting and stopping Ember on a Ray cluster.

``serve(app)`` joins ``RAY_ADDRESS`` when it is set, or starts an embedded local cluster,
then deploys the app with Ray Serve: one Serve deployment per Ember deployment, the warm
pool, and the edges that listen for HTTP. Nothing here schedules replicas; Ray Serve does.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve

from ember import settings
from ember.app.app import App
from ember.app.config import serve_logging, to_ray_options
from ember.control import snapshot_placement, warm_runtime
from ember.control.listeners import LOCAL_CLUSTER_ENV, LOOPBACK, use_loopback_node_ip
from ember.control.pool import GPU_POOL_DEPLOYMENT, POOL_DEPLOYMENT, EmberPool
from ember.control.replica import replica_class
from ember.edge.auth import ApiKeys
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

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

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

#: Serve's controller settings for the clusters Ember starts, for the own replica's cold start.
#: The controller walks a new replica through start -> allocated -> initialized -> running
#: one control-loop tick per step, plus one tick from the scale-up decision to the start:
#: four ticks of Serve's default 0.1 s sleep were 0.2-0.4 s of a 0.9 s own-replica cold start
#: on the flagship. At 0.05 s the idle controller costs 12% of one core instead of 8%
#: (measured with the flagship app on 2 cores). Values already in the environment win.
COLD_START_SETTINGS = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.05"}

#: Environment of a Ray worker that calls deployment handles from sync code.
SYNC_HANDLE_ENV = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}

#: CPUs each edge and each warm-pool replica reserves: small, so they fit beside the models
#: (cluster manifests size their nodes with these too, see ``cluster/k8s.py``).
EDGE_NUM_CPUS = 0.1
POOL_NUM_CPUS = 0.1


def default_port() -> int:
    """``EMBER_PORT`` or 8000."""
    return settings.load().port


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
        ray_actor_options={"num_cpus": EDGE_NUM_CPUS},
        logging_config=serve_logging(),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=DRAIN_S + 5,
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
    return edge.bind(host, default_port() if port is None else port, state_args)


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
    )(EmberPool)
    return pool.bind(specs, preload, app.warm_pool_bytes, app.name, gpu=gpu,
                     park_after_s=settings.load().gpu_pool_park_after_s)


#: Keeps the warm runtime's idle workers while this process's local cluster runs.
_refiller: warm_runtime.Refiller | None = None
#: How long ``serve_app`` waits for them before it returns (importing torch takes seconds).
_WARM_RUNTIME_WAIT_S = 60.0


def app_modules(app: App) -> list[str]:
    """Modules that define ``app``'s deployments (what a warm-runtime worker preloads)."""
    return sorted({spec.cls.__module__ for spec in app.specs})


def start_ray(*, address: str | None = None, num_cpus: float | None = None,
              preload: list[str] | None = None, warm: bool | None = None) -> bool:
    """Join ``address`` (or ``RAY_ADDRESS``), else start a local cluster; idempotent.

    Args:
        preload: Modules every worker of a local cluster imports before it takes work
            (the warm runtime); torch and Ember's replica code are always among them.
        warm: Whether a local cluster's workers preload at all; None reads
            ``EMBER_WARM_RUNTIME`` (off at 0).

    Returns:
        True if this call started a local cluster.
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    user_paths = _user_module_paths()
    if address is None and user_paths:
        # Local workers inherit this environment, so user modules import there by name.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [*user_paths, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
    if address is None:
        # Local workers and the Serve controller inherit this environment.
        local_env = {**THROUGHPUT_SETTINGS, **COLD_START_SETTINGS, **LOCAL_CLUSTER_ENV}
        for name, value in local_env.items():
            os.environ.setdefault(name, value)
        use_loopback_node_ip()
    runtime_env = {"working_dir": user_paths[0]} if address and user_paths else None
    warm = address is None and (settings.load().warm_runtime > 0 if warm is None else warm)
    ray.init(
        # "local": a cluster of its own. Given None, Ray joins the cluster the machine's
        # last `ray start` recorded in its temp dir, someone else's on a shared machine.
        address=address or "local",
        # A local cluster is reachable from this machine only (see control/listeners.py).
        _node_ip_address=None if address else LOOPBACK,
        num_cpus=None if address else (int(num_cpus) if num_cpus else None),
        include_dashboard=False,
        runtime_env=runtime_env,
        logging_level=logging.WARNING,
        configure_logging=True,
        _system_config=warm_runtime.system_config(preload or []) if warm else None,
    )
    return address is None


def serve_app(app: App, *, host: str = DEFAULT_HOST, port: int | None = None) -> str:
    """Deploy ``app`` and return its base URL; returns once the app is running.

    Example:
        >>> url = serve_app(my_app)            # doctest: +SKIP
        >>> httpx.post(f"{url}/mlp", json=...)  # doctest: +SKIP
    """
    global _refiller
    started_here = start_ray(preload=app_modules(app))
    port = default_port() if port is None else port
    # Ember's edges take the place of Serve's HTTP proxy (see edge/edge.py).
    serve.start(proxy_location="Disabled")
    serve.run(build_application(app, host=host, port=port), name=app.name, route_prefix=None,
              blocking=False)
    if started_here and _refiller is None:
        # The app's first replicas (edges, pool, floors) take idle workers as they start;
        # only the workers left after them, or started to replace them, are the warm runtime.
        _wait_deployed(app.name, _WARM_RUNTIME_WAIT_S)
        _refiller = warm_runtime.Refiller(settings.load().warm_runtime)
        _refiller.start()
        if not _refiller.wait_ready(_WARM_RUNTIME_WAIT_S):
            logger.warning("the warm runtime's workers are not up yet; the first cold starts "
                           "may start fresh processes")
    return f"http://{host}:{port}"


def _wait_deployed(name: str, timeout_s: float) -> None:
    """Wait until Serve is done starting ``name``'s replicas, however that ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(name)
        if app is not None and app.status not in ("NOT_STARTED", "DEPLOYING"):
            return
        time.sleep(0.2)


def shutdown() -> None:
    """Tear down Serve and, if this process started it, the local Ray cluster."""
    global _refiller
    if _refiller is not None:
        _refiller.stop()
        _refiller = None
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
