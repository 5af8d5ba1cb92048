"""The Ray Serve deployment class that hosts one user class per replica.

``replica_class(spec)`` builds a small wrapper that constructs the user's class, runs its
``setup()`` before Ray Serve marks the replica ready (so a replica is never routable before
its weights are loaded), and dispatches ``ember_call(attr, body)`` to the handler. Sync
handlers run in a worker thread so the replica's event loop keeps answering health checks,
batching and cancellations while the model computes.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import math
import os
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ember.app.batching import LIST_CODEC, TENSOR_CODEC, BatchFn, make_batcher
from ember.app.decorator import DeploymentSpec
from ember.control import coldstart
from ember.control.coldstart import ReplicaTimeline
from ember.control.listeners import bind_replica_grpc_to_node_ip

_DONE = object()

logger = logging.getLogger("ember.replica")


def hide_gpus_unless_asked(num_gpus: float) -> None:
    """Give a process that reserved no GPU an empty ``CUDA_VISIBLE_DEVICES``.

    Ray stopped doing this itself (2.4x): a ``num_gpus=0`` replica on a GPU node would see
    every GPU, and code that picks CUDA when available would run there, on memory another
    replica reserved. Set before anything initializes CUDA in the process; torch reads the
    variable then, not at import.
    """
    if num_gpus > 0:
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        logger.warning("CUDA was initialized before the replica started; GPUs stay visible")
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def match_torch_threads(num_cpus: float) -> int:
    """Size torch's intra-op thread pool to the CPUs the replica reserved (at least one).

    Ray sets ``OMP_NUM_THREADS`` from ``num_cpus`` when a worker takes an actor, but a
    pre-started warm-runtime worker imported torch and ran it before that, so its pool
    already holds a thread per core of the node: a ``num_cpus=1`` replica would compute on
    every core, crowding the replicas beside it. Runs before ``setup()``, which may still
    choose its own count. Returns the count set.
    """
    threads = max(1, math.floor(num_cpus))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for a torch imported later
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    return threads


def freeze_imported_heap() -> None:
    """Move every object the process holds now out of the collector's reach.

    What a replica's process imported before its constructor (Ray, Serve, torch, the app)
    lives as long as the process, but the collector's full passes walk it all: in a process
    that imported torch and transformers that is hundreds of thousands of objects, a pass
    of tenths of a second holding the GIL, and where it lands in the middle of the weights'
    load every range read waits for it. ``gc.freeze()`` alone is cheap (no collection: the
    little garbage the imports left stays), and Serve's own ``gc.collect()`` and
    ``gc.freeze()`` after the constructor then walk only what the constructor made. A
    warm-runtime worker has done this already, while idle (``settle_heap``).
    """
    gc.freeze()


async def call_user(fn: Callable[..., Any], *args: Any) -> Any:
    """Await an async handler, or run a sync one in a worker thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await asyncio.to_thread(fn, *args)


def _batch_runner(fn: Callable[..., Any]) -> BatchFn:
    async def run(batch: Any) -> Any:
        return await call_user(fn, batch)

    return run


class ReplicaCore:
    """The per-replica dispatcher, kept apart from Ray so it can be unit-tested."""

    timeline: ReplicaTimeline

    def __init__(self, spec: DeploymentSpec, impl: Any) -> None:
        self.spec = spec
        self.impl = impl
        self.routes = {r.attr: r for r in spec.routes}
        self._submit: dict[str, Callable[[Any], Awaitable[Any]]] = {}
        batch = spec.options.batch
        if batch is not None:
            for route in spec.routes:
                if route.kind in ("batch", "tensor"):
                    runner = _batch_runner(getattr(impl, route.attr))
                    codec = TENSOR_CODEC if route.kind == "tensor" else LIST_CODEC
                    self._submit[route.attr] = make_batcher(runner, batch, codec)

    def _handler(self, attr: str) -> Callable[..., Any]:
        if attr not in self.routes:  # only routes, never arbitrary attributes
            raise AttributeError(f"{self.spec.name} has no route handler {attr!r}")
        return getattr(self.impl, attr)  # type: ignore[no-any-return]

    async def call(self, attr: str, body: Any) -> Any:
        fn = self._handler(attr)
        submit = self._submit.get(attr)
        if submit is None:
            return await call_user(fn, *(() if body is None else (body,)))
        return await submit(body)

    async def routing_stats(self) -> dict[str, Any]:
        """``{"warm": ...}`` and whatever the user's ``routing_stats()`` adds or overrides.

        A replica is warm once setup and warmup ran (before that Serve does not route to
        it); a class whose caches can go cold later (reloaded weights, a cache dropped)
        says so with ``routing_stats() -> {"warm": False}``, and the prefix router stops
        choosing it for its prefixes alone.
        """
        stats: dict[str, Any] = {"warm": True}
        own = getattr(self.impl, "routing_stats", None)
        if own is not None:
            stats.update(await call_user(own))
        return stats

    async def stream(self, attr: str, body: Any) -> AsyncIterator[Any]:
        fn = self._handler(attr)
        produced = fn(*(() if body is None else (body,)))
        if inspect.isasyncgen(produced):
            async for chunk in produced:
                yield chunk
            return
        while (chunk := await asyncio.to_thread(next, produced, _DONE)) is not _DONE:
            yield chunk


async def instantiate(spec: DeploymentSpec, *, prewarmed: bool = False) -> ReplicaCore:
    """Construct the user's class, run ``setup()`` then ``warmup()``, timing each."""
    timeline = ReplicaTimeline(process_started_at=coldstart.process_started_at(),
                               imported_at=coldstart.IMPORTED_AT, init_started_at=time.time(),
                               prewarmed=prewarmed)
    started, imported = time.monotonic(), set(sys.modules)
    impl = spec.cls()
    setup = getattr(impl, "setup", None)
    if setup is not None:
        await call_user(setup)
    timeline.setup_s = time.monotonic() - started
    if not prewarmed:  # a pool process builds several deployments at once: no fair count
        _tell_setup_imports(spec.name, imported)
    warmup = getattr(impl, "warmup", None)
    if warmup is not None:  # first forward pass, before the replica reports ready
        started = time.monotonic()
        await call_user(warmup)
        timeline.warmup_s = time.monotonic() - started
    timeline.ready_at = time.time()
    core = ReplicaCore(spec, impl)
    core.timeline = timeline
    return core


#: A constructor and ``setup()`` that import this many modules are told so in the log.
SETUP_IMPORTS_TOLD = 20


def _tell_setup_imports(name: str, before: set[str]) -> None:
    """A warning when the constructor and ``setup()`` imported
    :data:`SETUP_IMPORTS_TOLD` modules or more.

    Those imports run on every cold start, however warm the process: a library whose names
    are lazy (transformers) loads its code in the first call.
    """
    new = set(sys.modules) - before
    if len(new) >= SETUP_IMPORTS_TOLD:
        top = Counter(m.partition(".")[0] for m in new).most_common(3)
        logger.warning(
            "%s: its constructor and setup() imported %d modules (mostly %s), on the path of "
            "every cold start; import them at module level in the deployment's module, or "
            "name them in ember.App(preload_modules=[...]), and the warm runtime imports "
            "them before a request", name, len(new), ", ".join(p for p, _ in top))


def replica_class(spec: DeploymentSpec) -> type:
    """Return the class Ray Serve deploys for ``spec``."""

    class EmberReplica:
        async def __init__(self) -> None:  # type: ignore[misc]  # Ray Serve awaits it
            freeze_imported_heap()
            bind_replica_grpc_to_node_ip()
            hide_gpus_unless_asked(spec.options.num_gpus)
            match_torch_threads(spec.options.num_cpus)
            self._core = await instantiate(spec)

        async def ember_call(self, attr: str, body: Any) -> Any:
            return await self._core.call(attr, body)

        async def ember_stream(self, attr: str, body: Any) -> AsyncIterator[Any]:
            async for chunk in self._core.stream(attr, body):
                yield chunk

        async def ember_ping(self) -> dict[str, Any]:
            """Cheap call that wakes a cold deployment and reports how its replica started."""
            return self._core.timeline.as_dict()

        async def check_health(self) -> None:
            check = getattr(self._core.impl, "check_health", None)
            if check is not None:
                await call_user(check)

        async def __del__(self) -> None:
            """Serve's graceful shutdown: finish the node-cache writes and seals this
            replica's loads left behind them (a fresh node's first fill), so the next
            replica finds the blobs published; bounded by ``graceful_shutdown_s``."""
            writes = sys.modules.get("ember.loaders._writebehind")  # none if no load ran
            if writes is not None:
                await asyncio.to_thread(writes.wait_all, spec.options.graceful_shutdown_s)

    if spec.options.router == "prefix":
        # Serve polls a replica's routing stats only when its class defines this method;
        # the other routers read none, so their replicas are not asked.
        async def record_routing_stats(self: Any) -> dict[str, Any]:
            """What the prefix router reads about this replica (``{"warm": ...}``)."""
            return await self._core.routing_stats()  # type: ignore[no-any-return]

        EmberReplica.record_routing_stats = record_routing_stats  # type: ignore[attr-defined]
    EmberReplica.__name__ = EmberReplica.__qualname__ = f"EmberReplica_{spec.name}"
    return EmberReplica
