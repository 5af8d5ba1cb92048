"""Deployments the core tests serve: echo, a bounded sleeper, a failing handler, a cold one."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from pydantic import BaseModel, Field

import ember


class EchoIn(BaseModel):
    text: str
    repeat: int = Field(default=1, ge=1, le=10)


class EchoOut(BaseModel):
    text: str
    replica_calls: int


@ember.deployment(route="/echo", warm_floor=1, num_cpus=0.1, max_request_bytes=1024,
                  scaledown_after_s=1.0)
class Echo:
    def setup(self) -> None:
        self.calls = 0

    async def __call__(self, body: EchoIn) -> EchoOut:
        self.calls += 1
        return EchoOut(text=body.text * body.repeat, replica_calls=self.calls)

    @ember.route("/echo/info", method="GET")
    def info(self) -> dict[str, str | None]:
        # num_gpus=0: the replica must not see a GPU, whatever the node has.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return {"deployment": "Echo", "cuda_visible_devices": visible}


class SleepIn(BaseModel):
    seconds: float = Field(ge=0, le=30)
    marker: str | None = None


@ember.deployment(route="/sleep", warm_floor=1, max_replicas=1, num_cpus=0.1, max_queue=3,
                  max_ongoing_requests=1, target_queue_depth=1, request_timeout_s=1.5,
                  scaledown_after_s=1.0)
class Sleeper:
    async def __call__(self, body: SleepIn) -> dict[str, float]:
        try:
            await asyncio.sleep(body.seconds)
        except asyncio.CancelledError:
            if body.marker:  # proves to the test that the work was cancelled, not abandoned
                Path(body.marker).write_text("cancelled")
            raise
        return {"slept": body.seconds}


class FaultIn(BaseModel):
    fail: bool


@ember.deployment(route="/fault", warm_floor=1, num_cpus=0.1, scaledown_after_s=1.0)
class Faulty:
    def __call__(self, body: FaultIn) -> dict[str, str]:
        if body.fail:
            raise ValueError("the handler failed on purpose")
        return {"ok": "yes"}


class WorkIn(BaseModel):
    item: int
    seconds: float = 0.3


@ember.deployment(route="/cold", warm_floor=0, max_replicas=8, num_cpus=0.05,
                  target_queue_depth=2, max_ongoing_requests=2, scaledown_after_s=2.0)
class Cold:
    async def __call__(self, body: WorkIn) -> dict[str, int]:
        await asyncio.sleep(body.seconds)
        return {"item": body.item}


# More CPU than the test cluster has: its replica can never be placed.
@ember.deployment(route="/huge", warm_floor=0, num_cpus=64, scaledown_after_s=10.0)
class Huge:
    def __call__(self) -> dict[str, str]:
        return {"placed": "somehow"}


# No warm pool: these tests are about the deployments' own replicas and the policy.
app = ember.App([Echo, Sleeper, Faulty, Cold, Huge], name="core-tests", warm_pool=0)
