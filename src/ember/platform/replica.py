"""The Ray Serve deployment class that hosts one user class per replica.

``replica_class(spec)`` builds a small wrapper that constructs the user's class, runs its
``setup()`` before Ray Serve marks the replica ready (so a replica is never routable before
its weights are loaded), and dispatches ``ember_call(attr, body)`` to the handler. Sync
handlers run in a worker thread so the replica's event loop keeps answering health checks
and cancellations while the model computes.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any

from ember.platform.decorator import DeploymentSpec


def replica_class(spec: DeploymentSpec) -> type:
    """Return the class Ray Serve deploys for ``spec``."""
    user_cls = spec.cls
    async_attrs = frozenset(r.attr for r in spec.routes if r.is_async)
    served_attrs = frozenset(r.attr for r in spec.routes)

    class EmberReplica:
        async def __init__(self) -> None:  # type: ignore[misc]  # Ray Serve awaits it
            started = time.monotonic()
            self._impl = user_cls()
            setup = getattr(self._impl, "setup", None)
            if setup is not None:
                if inspect.iscoroutinefunction(setup):
                    await setup()
                else:
                    await asyncio.to_thread(setup)
            self._setup_s = time.monotonic() - started
            self._ready_at = time.time()

        async def ember_call(self, attr: str, body: Any) -> Any:
            if attr not in served_attrs:  # only routes, never arbitrary attributes
                raise AttributeError(f"{spec.name} has no route handler {attr!r}")
            fn = getattr(self._impl, attr)
            args = () if body is None else (body,)
            if attr in async_attrs:
                return await fn(*args)
            return await asyncio.to_thread(fn, *args)

        def ember_info(self) -> dict[str, float]:
            return {"setup_s": self._setup_s, "ready_at": self._ready_at}

        async def check_health(self) -> None:
            check = getattr(self._impl, "check_health", None)
            if check is None:
                return
            if inspect.iscoroutinefunction(check):
                await check()
            else:
                await asyncio.to_thread(check)

    EmberReplica.__name__ = EmberReplica.__qualname__ = f"EmberReplica_{spec.name}"
    return EmberReplica
