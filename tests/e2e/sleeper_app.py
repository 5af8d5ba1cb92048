"""A deployment whose requests take as long as they ask: requests in flight on demand.

``ember run tests/e2e/sleeper_app.py:app``; ``POST /sleep {"seconds": 3}`` answers after
three seconds. One replica is always up (``warm_floor=1``), so ``/readyz`` waits for it.
"""

from __future__ import annotations

import asyncio
import os

from pydantic import BaseModel, Field

import ember


class Nap(BaseModel):
    seconds: float = Field(ge=0, le=60)


class Woke(BaseModel):
    pid: int
    seconds: float


@ember.deployment(route="/sleep", warm_floor=1, max_replicas=1, num_cpus=0.1,
                  max_ongoing_requests=64, target_queue_depth=64, graceful_shutdown_s=30)
class Sleeper:
    async def __call__(self, body: Nap) -> Woke:
        await asyncio.sleep(body.seconds)
        return Woke(pid=os.getpid(), seconds=body.seconds)


app = ember.App([Sleeper], name="sleeper", warm_pool=0)
