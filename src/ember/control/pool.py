"""The warm pool: pre-started replicas that serve any scaled-to-zero deployment at once.

A pool replica is an ordinary Ray Serve replica whose process has already imported torch and
the app's modules. When a request reaches a deployment with no running replica, the
edge sends it to the pool *and* wakes the deployment; the pool constructs the
deployment's class in its warm process (``setup()`` maps the weights from the node cache:
milliseconds, not the seconds of a process start and imports) and answers, while the
deployment's own replica starts. Once that replica runs, traffic goes to it. Deployments
marked ``preload=True`` are constructed when the pool starts, so even their first request
runs no ``setup()``: for the caller that is a warm hit in a shared process, not a cold start.

The pool is a bridge, not a second home:

* **Bounded in memory.** Constructed deployments are kept while their model memory (the
  bytes of their torch parameters and buffers) fits ``max_bytes``, least recently used out.
* **Bounded in concurrency.** Each pool replica serves a deployment as one of its own
  replicas would, up to the deployment's ``max_ongoing_requests``; past that it answers
  "busy" at once and the edge holds the request for the deployment's own replica, where its
  ``max_queue`` applies.
* **A failing preload is that deployment's problem.** The pool starts anyway and publishes
  the reason; the edge stops sending that deployment to the pool and its status says why.

GPU deployments have a pool of their own (``GPU_POOL_DEPLOYMENT``), so that the CPU pool can
keep its GPUs hidden: a ``num_gpus=0`` deployment never touches a GPU, in the pool either.
The GPU pool reserves no GPU from Ray (a reservation would keep the deployment's own replica
off the device); it keeps each model parked in pinned host memory and borrows the device
only while it serves (``device_snapshot.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.app.decorator import DeploymentSpec
from ember.control.listeners import bind_replica_grpc_to_node_ip
from ember.control.replica import ReplicaCore, hide_gpus_unless_asked, instantiate

if TYPE_CHECKING:  # imports torch: the edges import this module and need no torch
    from ember.control.device_snapshot import DeviceSnapshot

logger = logging.getLogger("ember.pool")

POOL_DEPLOYMENT = "ember-pool"
GPU_POOL_DEPLOYMENT = "ember-pool-gpu"
#: Ray's key-value store namespace where pool replicas publish preloads that failed.
_KV_NAMESPACE = "ember"


@dataclass
class PoolAnswer:
    """What one pool call returns: the result, or ``busy`` when the pool is at its cap."""

    busy: bool
    value: Any = None
    timeline: dict[str, Any] | None = None


def model_bytes(impl: Any) -> int:
    """Bytes of the torch tensors a constructed deployment holds (shared storage once).

    Looks at the instance's attributes: modules (parameters and buffers) and bare tensors.
    A deployment without torch state counts as 0 bytes and never pushes others out.
    """
    import torch

    seen: set[int] = set()
    total = 0

    def add(tensor: torch.Tensor) -> None:
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for value in vars(impl).values():
        if isinstance(value, torch.nn.Module):
            for tensor in [*value.parameters(), *value.buffers()]:
                add(tensor)
        elif isinstance(value, torch.Tensor):
            add(value)
    return total


def failures_key(app_name: str, gpu: bool = False) -> str:
    return f"pool-failures{'-gpu' if gpu else ''}:{app_name}"


def read_failures(app_name: str) -> dict[str, str]:
    """Deployments whose preload failed in a pool of ``app_name``, with the reason."""
    from ray.experimental import internal_kv

    failures: dict[str, str] = {}
    for gpu in (False, True):
        raw = internal_kv._internal_kv_get(failures_key(app_name, gpu), namespace=_KV_NAMESPACE)
        failures.update(json.loads(raw) if raw else {})
    return failures


def _publish_failures(app_name: str, failures: dict[str, str], gpu: bool) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(failures_key(app_name, gpu), json.dumps(failures).encode(),
                                 overwrite=True, namespace=_KV_NAMESPACE)


class EmberPool:
    """Ray Serve deployment class of the warm pool (one per app)."""

    async def __init__(self, specs: list[DeploymentSpec], preload: list[str],  # type: ignore[misc]
                       max_bytes: int, app_name: str = "", *, gpu: bool = False,
                       park_after_s: float = 10.0) -> None:
        bind_replica_grpc_to_node_ip()
        if not gpu:
            hide_gpus_unless_asked(0)  # the CPU pool serves num_gpus=0 deployments only
        import torch  # noqa: F401  (the point of the pool: imports paid before any request)

        self._gpu = gpu
        self._park_after_s = park_after_s
        self._snapshots: dict[str, DeviceSnapshot] = {}
        self._moving: dict[str, asyncio.Lock] = {}
        self._last_used: dict[str, float] = {}
        self._moves: dict[str, dict[str, float]] = {}
        self._specs = {s.name: s for s in specs}
        self._caps = {s.name: s.options.with_env_overrides().ongoing_limit() for s in specs}
        self._max_bytes = max_bytes
        self._cores: OrderedDict[str, asyncio.Task[ReplicaCore]] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self._ongoing: Counter[str] = Counter()
        self._failed: dict[str, str] = {}
        for name in preload:
            try:
                await self._core(name)
            except Exception as exc:  # one bad model must not keep the pool (and app) down
                logger.exception("warm pool: preloading %s failed", name)
                self._failed[name] = f"warm pool preload failed: {type(exc).__name__}: {exc}"
        if app_name:
            _publish_failures(app_name, self._failed, gpu)
        self._parker = asyncio.ensure_future(self._park_idle()) if gpu else None

    async def _core(self, name: str) -> ReplicaCore:
        """The constructed deployment, built once even under concurrent first requests."""
        task = self._cores.get(name)
        if task is None:
            task = asyncio.ensure_future(instantiate(self._specs[name], prewarmed=True))
            self._cores[name] = task
        self._cores.move_to_end(name)
        try:
            core = await task
        except BaseException:
            self._cores.pop(name, None)  # a failed setup is retried by the next request
            raise
        if name not in self._bytes:
            if self._gpu:  # park it before it is counted: the pool keeps the host copy
                from ember.control.device_snapshot import DeviceSnapshot

                self._snapshots[name] = await asyncio.to_thread(DeviceSnapshot, core.impl)
            self._bytes[name] = model_bytes(core.impl)
            self._evict(keep=name)
        return core

    def _evict(self, keep: str) -> None:
        """Drop least recently used models until the rest fit ``max_bytes``."""
        for name in list(self._cores):
            if sum(self._bytes.get(n, 0) for n in self._cores) <= self._max_bytes:
                return
            if name != keep:
                del self._cores[name]
                self._snapshots.pop(name, None)
                logger.info("warm pool: evicting %s (%d bytes)", name, self._bytes.pop(name, 0))

    async def ember_call(self, name: str, attr: str, body: Any) -> PoolAnswer:
        """Serve one request of deployment ``name``, or answer busy at its cap."""
        if name not in self._specs:
            raise KeyError(f"the warm pool does not serve {name!r}")
        if name in self._failed or self._ongoing[name] >= self._caps[name]:
            return PoolAnswer(busy=True)
        self._ongoing[name] += 1
        try:
            core = await self._core(name)
            device_s = await self._to_device(name)
            timeline = {**core.timeline.as_dict(), "device_s": device_s}
            return PoolAnswer(False, await core.call(attr, body), timeline)
        finally:
            self._ongoing[name] -= 1
            self._last_used[name] = time.monotonic()

    async def _to_device(self, name: str) -> float:
        """Move a parked GPU model to its device for this request: the seconds it took."""
        snapshot = self._snapshots.get(name)
        if snapshot is None:
            return 0.0
        async with self._moving.setdefault(name, asyncio.Lock()):
            move = await asyncio.to_thread(snapshot.to_device)
        if move is None:
            return 0.0
        self._moves[name] = {**move.as_dict(), "staged_copies": snapshot.staged_copies}
        logger.info("warm pool: %s moved to %s: %d bytes at %.2f GB/s", name,
                    snapshot.device, move.nbytes, move.gb_per_s)
        return move.seconds

    async def _park_idle(self) -> None:
        """Free the device copy of every GPU model idle for ``park_after_s``."""
        while True:
            await asyncio.sleep(min(1.0, max(self._park_after_s / 4, 0.05)))
            now = time.monotonic()
            for name, snapshot in list(self._snapshots.items()):
                idle = now - self._last_used.get(name, now) >= self._park_after_s
                if not (snapshot.on_device and idle):
                    continue
                async with self._moving.setdefault(name, asyncio.Lock()):
                    # Checked under the lock: a request that got in first is computing on
                    # the device copy; one that comes after waits here and moves it back.
                    if self._ongoing[name] == 0:
                        await asyncio.to_thread(snapshot.park)

    async def ember_ping(self) -> dict[str, Any]:
        return {"models": list(self._cores), "bytes": dict(self._bytes),
                "failed": dict(self._failed), "moves": dict(self._moves),
                "on_device": [n for n, s in self._snapshots.items() if s.on_device]}
