"""The small apps of the overload, chaos and rollout scenarios, as one app on one server.

Each scenario drives its own deployment, and every deployment here sleeps instead of
computing, so its capacity does not depend on how busy the machine is and the scenarios do
not disturb each other. One server for the three saves two Ray clusters' starts and stops.

- ``Slow`` (overload): one request at a time and a queue of four, so a few dozen users
  overload it. Overloading the flagship would take more than its ``max_queue`` (64) of
  concurrent requests, more than a 2-core machine can send while also running the model.
- ``Sleeper`` (chaos): exactly two replicas, killed by PID and brought back. Each answer names
  the PID of the replica that served it (``GET /sleep/pid`` too), so the scenario can find
  the replica processes. A request caught on a killed replica is retried once on the other
  (``retry_on_replica_loss``): its handler has no side effects.
- ``Scorer`` (rollout): version 1 stable and kept warm; version 2, the candidate, starts at
  zero replicas, so the rollout must wake it before it takes traffic. Both answer the same,
  apart from the version they name.

The warm pool is off, so every answer comes from one of the deployment's own replicas.

    ember run loadtests/apps.py:app
"""

from __future__ import annotations

import asyncio
import os
import random

from pydantic import BaseModel, Field

import ember

MAX_QUEUE = 4
SLEEPER_REPLICAS = 2


class Work(BaseModel):
    sleep_ms: int = Field(default=200, ge=0, le=5000)


class Done(BaseModel):
    slept_ms: int


@ember.deployment(name="Slow", route="/slow", warm_floor=1, max_replicas=1,
                  max_queue=MAX_QUEUE, max_ongoing_requests=1, target_queue_depth=1,
                  num_cpus=0.1, request_timeout_s=30, graceful_shutdown_s=2)
class Slow:
    """Sleeps, so its capacity is known: one request per ``sleep_ms``."""

    async def __call__(self, body: Work) -> Done:
        await asyncio.sleep(body.sleep_ms / 1000)
        return Done(slept_ms=body.sleep_ms)


class Nap(BaseModel):
    sleep_ms: int | None = Field(default=None, ge=0, le=5000)


class Served(BaseModel):
    pid: int


@ember.deployment(name="Sleeper", route="/sleep", warm_floor=SLEEPER_REPLICAS,
                  max_replicas=SLEEPER_REPLICAS, num_cpus=0.1, target_queue_depth=8,
                  max_ongoing_requests=16, request_timeout_s=30, graceful_shutdown_s=2,
                  retry_on_replica_loss=True)
class Sleeper:
    """Sleeps 100-200 ms unless told otherwise, and names its process."""

    async def __call__(self, body: Nap) -> Served:
        sleep_ms = body.sleep_ms if body.sleep_ms is not None else random.randint(100, 200)
        await asyncio.sleep(sleep_ms / 1000)
        return Served(pid=os.getpid())

    @ember.route("/sleep/pid", method="GET")
    def pid(self) -> Served:
        """Which replica process answered: how the scenario finds the replicas to kill."""
        return Served(pid=os.getpid())


class Text(BaseModel):
    text: str = Field(max_length=1000)


class Scored(BaseModel):
    version: str
    length: int


def _scorer(label: str, floor: int) -> type:
    @ember.deployment(name="Scorer", version=label, route="/score", warm_floor=floor,
                      max_replicas=2, num_cpus=0.1, target_queue_depth=8,
                      max_ongoing_requests=32, request_timeout_s=30)
    class Scorer:
        async def __call__(self, body: Text) -> Scored:
            await asyncio.sleep(random.uniform(0.02, 0.04))
            return Scored(version=label, length=len(body.text))

    return Scorer


#: The deployments, also served beside others by ``loadtests/server_app.py``.
DEPLOYMENTS = [Slow, Sleeper, _scorer("1", 1), _scorer("2", 0)]

app = ember.App(DEPLOYMENTS, name="loadtests", warm_pool=0)
