"""The warm pool: pre-started replicas that serve any scaled-to-zero deployment at once.

A pool replica is an ordinary Ray Serve replica whose process has already imported torch and
the app's modules. When a request reaches a deployment with no running replica, the
edge sends it to the pool *and* wakes the deployment; the pool constructs the
deployment's class in its warm process (``setup()`` maps the weights from the node cache:
milliseconds, not the seconds of a process start and imports) and answers, while the
deployment's own replica starts. Once that replica runs, traffic goes to it. Deployments
marked ``preload=True`` are constructed when the pool starts, so even their first request
runs no ``setup()``.

The pool holds at most ``max_models`` constructed deployments, least recently used out, so
a forgotten pool does not keep every model of the app in memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from ember.platform.control.listeners import bind_replica_grpc_to_node_ip
from ember.platform.control.replica import ReplicaCore, instantiate
from ember.platform.decorator import DeploymentSpec

logger = logging.getLogger("ember.pool")

POOL_DEPLOYMENT = "ember-pool"


class EmberPool:
    """Ray Serve deployment class of the warm pool (one per app)."""

    async def __init__(self, specs: list[DeploymentSpec], preload: list[str],  # type: ignore[misc]
                       max_models: int = 4) -> None:
        bind_replica_grpc_to_node_ip()
        import torch  # noqa: F401  (the point of the pool: imports paid before any request)

        self._specs = {s.name: s for s in specs}
        self._max_models = max(1, max_models)
        self._cores: OrderedDict[str, asyncio.Task[ReplicaCore]] = OrderedDict()
        for name in preload:
            await self._core(name)

    async def _core(self, name: str) -> ReplicaCore:
        """The constructed deployment, built once even under concurrent first requests."""
        task = self._cores.get(name)
        if task is None:
            task = asyncio.ensure_future(instantiate(self._specs[name], prewarmed=True))
            self._cores[name] = task
            while len(self._cores) > self._max_models:
                evicted, _ = self._cores.popitem(last=False)
                logger.info("warm pool: evicting %s", evicted)
        self._cores.move_to_end(name)
        try:
            return await task
        except BaseException:
            self._cores.pop(name, None)  # a failed setup is retried by the next request
            raise

    async def ember_call(self, name: str, attr: str, body: Any) -> tuple[Any, dict[str, Any]]:
        """Serve one request of deployment ``name``; returns the result and its timeline."""
        if name not in self._specs:
            raise KeyError(f"the warm pool does not serve {name!r}")
        core = await self._core(name)
        return await core.call(attr, body), core.timeline.as_dict()

    async def ember_ping(self) -> dict[str, Any]:
        return {"models": list(self._cores)}
