"""Ray Serve pieces the serving benchmarks share: the cluster, deployments, replica states.

Everything listens on 127.0.0.1. Serve's controller, proxy and every app log at WARNING
without access logs, Ember and plain Ray Serve alike. The plain Ray Serve peers scale from
zero with Ray's default up-path timers ("default") or with every timer at its fastest
("shrunk"); see :func:`plain_autoscaling`.

Replicas started by a benchmark leave "marks" (when their process started, when their
constructor or ``setup`` began, when it ended) as files in ``BENCH_MARKS_DIR``, which the
driver sets before Ray starts so that every local worker inherits it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
from _harness import HOST, Deadline, free_port, wait_until

F = TypeVar("F", bound=Callable[..., Any])
LOGGING = {"log_level": "WARNING", "enable_access_log": False}
SCALEDOWN_S = 2.0  # Ember variants and the peers' down path: back to zero between trials
REPLICA_CPUS = 0.5  # Ray accounting per measured replica, so that a 2-core node holds them
os.environ.setdefault("BENCH_MARKS_DIR",
                      str(Path(tempfile.gettempdir()) / f"bench-marks-{os.getpid()}"))
# The benchmarks read /-/status from loopback on their own local cluster: the operator's
# opt-in for local development, set before any app is served.
os.environ.setdefault("EMBER_ADMIN_LOOPBACK", "1")
MARK_KEYS = ("process_start", "init_start", "setup_done")
#: Operator settings that would skew a benchmark that fixes them itself.
OVERRIDES = ("EMBER_SCALEDOWN_AFTER_S", "EMBER_WARM_POOL", "EMBER_API_KEYS",
             "EMBER_API_KEYS_FILE", "EMBER_RATE_LIMIT_RPS", "EMBER_RATE_LIMIT_BURST")


def clear_overrides() -> None:
    """Drop operator settings (:data:`OVERRIDES`) the benchmarks fix themselves."""
    for name in OVERRIDES:
        os.environ.pop(name, None)


def resolved_hints(fn: F) -> F:
    """Replace string annotations (``from __future__``) by the objects they name.

    Ray pickles a script's classes by value; an unpickled copy of a method keeps only the
    globals its code uses, so neither FastAPI in a replica nor a later decorator here could
    resolve ``"list[str]"``-style annotations any more.
    """
    fn.__annotations__ = typing.get_type_hints(fn, include_extras=True)
    return fn


def shipped_options(cls: type, **changes: Any) -> dict[str, Any]:
    """The ``@ember.deployment`` options ``cls`` ships with, with ``changes``."""
    from ember.app.decorator import get_spec

    shipped = get_spec(cls).options
    # Only the options the decorator set (see bench/_ember_minilm.py).
    options = {key: getattr(shipped, key) for key in shipped.model_fields_set}
    options.update(changes)
    return options


def plain_autoscaling(shrunk: bool) -> dict[str, Any]:
    """Autoscaling of a plain Ray Serve peer: from zero, at most two replicas.

    Ray's default ``downscale_delay_s`` is 600 s, so only the down path (not measured) is
    set small in both; ``upscale_delay_s``, ``metrics_interval_s`` and
    ``look_back_period_s`` keep Ray's defaults unless ``shrunk`` sets them to the fastest.
    """
    config: dict[str, Any] = {"min_replicas": 0, "max_replicas": 2, "initial_replicas": 0,
                              "downscale_delay_s": SCALEDOWN_S,
                              "downscale_to_zero_delay_s": SCALEDOWN_S}
    if shrunk:
        config.update(upscale_delay_s=0.0, metrics_interval_s=0.1, look_back_period_s=0.2)
    return config


_PORTS: dict[str, int] = {}


#: Runtime environment of replicas that must start in a fresh process, as on plain Ray: Ray
#: gives a new actor a pre-started idle worker only if their runtime environments match, and
#: the warm runtime's workers have none.
FRESH_PROCESS_ENV = {"env_vars": {"EMBER_BENCH_FRESH_PROCESS": "1"}}
_REFILLERS: list[Any] = []


def start_serve(port: int, preload: tuple[str, ...] = ()) -> str:
    """Start Ray through Ember and Serve; Ember's base URL, ``127.0.0.1:port``.

    Ember's edges listen on ``port``; Serve's HTTP proxy, which only the plain Ray Serve
    peers use, listens on a port of its own (:func:`plain_url`). The local cluster's workers
    preload torch and ``preload``, and idle ones are kept for new replicas (the warm runtime,
    as ``ember run`` has it).
    """
    from ray import serve
    from ray.serve.config import HTTPOptions

    from ember import settings
    from ember.cluster.runtime import start_ray
    from ember.control import warm_runtime

    start_ray(preload=list(preload))
    _PORTS.update(ember=port, plain=free_port())
    serve.start(http_options=HTTPOptions(host=HOST, port=_PORTS["plain"]),
                proxy_location="HeadOnly", logging_config=LOGGING)
    refiller = warm_runtime.Refiller(settings.load().warm_runtime)
    refiller.start()
    _REFILLERS.append(refiller)
    return f"http://{HOST}:{port}"


@contextlib.contextmanager
def fresh_process_replicas() -> Iterator[None]:
    """Ember deployments deployed inside start their replicas in fresh processes."""
    from ember.cluster import runtime

    original = runtime.to_ray_options

    def fresh(options: Any, **kwargs: Any) -> dict[str, Any]:
        # Every keyword passes through: the wrapper must not fall behind the one it wraps.
        ray_options = original(options, **kwargs)
        ray_options["ray_actor_options"] = {**ray_options["ray_actor_options"],
                                            "runtime_env": FRESH_PROCESS_ENV}
        return ray_options

    runtime.to_ray_options = fresh  # type: ignore[assignment]
    try:
        yield
    finally:
        runtime.to_ray_options = original  # type: ignore[assignment]


def idle_worker_rss_mb() -> list[float]:
    """Resident memory of each idle pre-started worker (torch loaded) on this machine, MB."""
    sizes = []
    for process in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.Error, OSError):
            if process.info["name"] == "ray::IDLE" and "libtorch" in Path(
                    f"/proc/{process.pid}/maps").read_text():
                sizes.append(round(process.memory_info().rss / 2**20, 1))
    return sorted(sizes)


def plain_url() -> str:
    """Base URL of Serve's HTTP proxy, in front of the plain Ray Serve peers."""
    return f"http://{HOST}:{_PORTS['plain']}"


def deploy_ember(app: Any, deadline: Deadline, pool_settle_s: float = 1.5) -> None:
    """Deploy Ember ``app`` on its edges and wait until it runs (and its warm pool, if any)."""
    from ray import serve

    from ember.cluster.runtime import build_application
    from ember.control.pool import POOL_DEPLOYMENT

    serve.run(build_application(app, host=HOST, port=_PORTS["ember"]), name=app.name,
              route_prefix=None, blocking=False, logging_config=LOGGING)
    wait_until(lambda: app_status(app.name) == "RUNNING", f"{app.name} running", deadline)
    if app.warm_pool:
        wait_until(lambda: replica_states(app.name, POOL_DEPLOYMENT).get("RUNNING", 0) >= 1,
                   "the warm pool", deadline)
        time.sleep(pool_settle_s)  # the edges poll replica states every 0.25-1 s
    wait_refilled(deadline)


def wait_refilled(deadline: Deadline) -> None:
    """Wait until the idle pre-started workers just taken are back and done importing.

    The app's edges and pool replicas (or a cold start) took idle workers as they started;
    the refiller replaces them a few seconds later, and the next cold start must not meet
    a worker that is still importing torch (as ``ember run`` waits before it says it is up).
    """
    from ember import settings

    if settings.load().warm_runtime:
        time.sleep(4.0)  # past the refiller's grace period, so the used workers are missed
        wait_warm_runtime(deadline)


def wait_warm_runtime(deadline: Deadline) -> None:
    """Wait until the node holds its idle pre-started workers, each done importing.

    A cold trial right after another would otherwise come while the worker that replaces the
    one the last trial took still imports, and time that import as its queue (it meets that
    worker, or shares the cores with it; the replica's phases cannot tell which): the steady
    state between cold starts is what a trial measures.
    """
    from ember import settings
    from ember.control import warm_runtime

    wanted = settings.load().warm_runtime
    if wanted:
        wait_until(lambda: warm_runtime.settled_idle_workers() >= wanted,
                   "the warm runtime's idle workers", deadline)


def deploy_plain(bound: Any, app: str, prefix: str) -> None:
    """Deploy a plain Ray Serve application (already bound) at ``prefix``."""
    from ray import serve

    serve.run(bound, name=app, route_prefix=prefix, blocking=False, logging_config=LOGGING)


def replica_states(app: str, deployment: str) -> dict[str, int]:
    """Replica count per state of ``deployment`` in ``app`` (empty if it does not exist)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return {}
    states = status.deployments[deployment].replica_states
    return {str(getattr(k, "value", k)): int(v) for k, v in states.items()}


def replicas(app: str, deployment: str) -> int:
    """Replicas of ``deployment`` in any state."""
    return sum(replica_states(app, deployment).values())


def app_status(app: str) -> str | None:
    """``RUNNING``, ``DEPLOYING``... of ``app``, None if it is not deployed."""
    from ray import serve

    status = serve.status().applications.get(app)
    return None if status is None else str(getattr(status.status, "value", status.status))


def ingress_view(base_url: str, deployment: str) -> int | None:
    """Running + starting replicas of ``deployment`` as an Ember edge sees them."""
    try:
        reply = httpx.get(f"{base_url}/-/status", timeout=5)
        reply.raise_for_status()
        loads = reply.json()["deployments"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    for load in loads:
        if load["deployment"] == deployment:
            return int(load["replicas_running"]) + int(load["replicas_starting"])
    return None


def wait_woken(app: str, deployment: str, deadline: Deadline, cap_s: float = 15.0) -> None:
    """After a pool-served request: let the own replica it woke show up (a later wait for
    zero then sees it scale down), so that it does not start during the next trial."""
    try:
        wait_until(lambda: replicas(app, deployment) > 0, f"{deployment}'s own replica",
                   deadline, cap_s=cap_s)
    except RuntimeError:
        print(f"  note: no own replica of {deployment} seen after a pool answer", flush=True)


def cold_header(reply: httpx.Response) -> tuple[str | None, dict[str, float]]:
    """``X-Ember-Cold-Start`` of ``reply`` -> (path, phases in seconds, with ``total``)."""
    value = reply.headers.get("x-ember-cold-start")
    if not value:
        return None, {}
    parts = dict(part.split("=", 1) for part in value.split(";") if "=" in part)
    path = parts.pop("path", None)
    return path, {k: float(v) / 1000.0 for k, v in parts.items()}


def write_mark(deployment: str, init_start: float) -> None:
    """In a replica: when its process started, its setup began (imports done) and ended."""
    mark = {"process_start": psutil.Process().create_time(), "init_start": init_start,
            "setup_done": time.time()}
    marks = Path(os.environ["BENCH_MARKS_DIR"])
    marks.mkdir(parents=True, exist_ok=True)
    (marks / f"{deployment}-{os.getpid()}.json").write_text(json.dumps(mark))


def marks_since(deployment: str, sent: float) -> dict[str, float]:
    """Seconds after ``sent`` of the first replica of ``deployment`` set up after it.

    A negative process start means Ray reused a worker started earlier. Only replicas on
    this host leave marks; none gives an empty dict.
    """
    marks_dir = Path(os.environ["BENCH_MARKS_DIR"])
    marks = [json.loads(p.read_text()) for p in marks_dir.glob(f"{deployment}-*.json")]
    fresh = [m for m in marks if m["init_start"] >= sent]
    if not fresh:
        return {}
    mark = min(fresh, key=lambda m: m["init_start"])
    return {k: mark[k] - sent for k in MARK_KEYS}


def shutdown() -> None:
    """Stop Serve and the local Ray cluster this process started; drop the marks."""
    import ray

    import ember

    for refiller in _REFILLERS:  # before the raylet it watches goes away
        refiller.stop()
    _REFILLERS.clear()
    try:
        if ray.is_initialized():
            ember.shutdown()
    finally:
        shutil.rmtree(os.environ["BENCH_MARKS_DIR"], ignore_errors=True)
