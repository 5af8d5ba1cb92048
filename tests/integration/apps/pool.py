"""A slow-starting and a preloaded deployment, served through the warm pool at zero."""

from __future__ import annotations

import asyncio
import os
import time

from pydantic import BaseModel

import ember


class Ask(BaseModel):
    question: str


@ember.deployment(route="/slow-start", warm_floor=0, max_replicas=1, num_cpus=0.1,
                  scaledown_after_s=2.0)
class SlowStart:
    def setup(self) -> None:
        self.pid = os.getpid()
        time.sleep(0.3)  # weights to load

    def warmup(self) -> None:
        self.warm = True

    def __call__(self, body: Ask) -> dict[str, object]:
        return {"answer": body.question[::-1], "pid": self.pid}


@ember.deployment(route="/preloaded", warm_floor=0, max_replicas=1, num_cpus=0.1,
                  scaledown_after_s=2.0, preload=True)
class Preloaded:
    def __call__(self, body: Ask) -> dict[str, object]:
        return {"answer": body.question.upper(), "pid": os.getpid()}


class Work(BaseModel):
    seconds: float


@ember.deployment(route="/busy", warm_floor=0, max_replicas=4, num_cpus=0.05,
                  target_queue_depth=2, max_ongoing_requests=8, scaledown_after_s=3.0)
class Busy:
    """Up to 8 at once in the pool: the pool can take a whole burst by itself."""

    def setup(self) -> None:
        time.sleep(1.0)  # slow enough that the pool serves for a while at zero

    async def __call__(self, body: Work) -> dict[str, object]:
        await asyncio.sleep(body.seconds)
        return {"pid": os.getpid()}


@ember.deployment(route="/capped", warm_floor=0, max_replicas=1, num_cpus=0.05,
                  max_ongoing_requests=2, scaledown_after_s=3.0)
class Capped:
    """Two at once in the pool (as in one of its replicas); the rest wait for its own."""

    async def __call__(self, body: Work) -> dict[str, object]:
        await asyncio.sleep(body.seconds)
        return {"pid": os.getpid()}


@ember.deployment(route="/broken-preload", warm_floor=0, max_replicas=1, num_cpus=0.05,
                  preload=True)
class BrokenPreload:
    def setup(self) -> None:
        raise OSError("weights not found")

    def __call__(self) -> str:
        return "never"


app = ember.App([SlowStart, Preloaded, Busy, Capped, BrokenPreload], name="pool-tests",
                warm_pool=1)
