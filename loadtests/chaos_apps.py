"""A small app for the chaos scenario: two replicas that are killed and must come back.

``Sleeper`` keeps exactly two replicas (``warm_floor=2``, ``max_replicas=2``), each cheap
(0.1 CPU), and answers after 100-200 ms with the PID of the replica that served it, so
the scenario can find the replica processes through ``GET /sleep/pid`` and SIGKILL one.
A request caught on the killed replica is retried once on the other one
(``retry_on_replica_loss``): handlers here have no side effects. The warm pool is off, so
every answer comes from one of the deployment's own replicas.

    ember run loadtests/chaos_apps.py:app
"""

from __future__ import annotations

import asyncio
import os
import random

from pydantic import BaseModel, Field

import ember

DEPLOYMENT = "Sleeper"
REPLICAS = 2


class Work(BaseModel):
    # None: a random 100-200 ms, so replicas hold overlapping requests when one is killed.
    sleep_ms: int | None = Field(default=None, ge=0, le=5000)


class Served(BaseModel):
    pid: int


@ember.deployment(name=DEPLOYMENT, route="/sleep", warm_floor=REPLICAS, max_replicas=REPLICAS,
                  num_cpus=0.1, target_queue_depth=8, max_ongoing_requests=16,
                  request_timeout_s=30, graceful_shutdown_s=2, retry_on_replica_loss=True)
class Sleeper:
    """Sleeps (no CPU), so its capacity does not depend on how busy the machine is."""

    async def __call__(self, body: Work) -> Served:
        sleep_ms = body.sleep_ms if body.sleep_ms is not None else random.randint(100, 200)
        await asyncio.sleep(sleep_ms / 1000)
        return Served(pid=os.getpid())

    @ember.route("/sleep/pid", method="GET")
    def pid(self) -> Served:
        """Which replica process answered: how the scenario finds the replicas to kill."""
        return Served(pid=os.getpid())


app = ember.App([Sleeper], name="loadtest-chaos", warm_pool=0)
