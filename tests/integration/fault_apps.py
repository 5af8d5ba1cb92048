"""Deployments for the fault tests: killable, drainable, sickly and unstartable replicas."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from pydantic import BaseModel

import ember


class Work(BaseModel):
    seconds: float = 1.0


@ember.deployment(route="/fragile", warm_floor=2, max_replicas=2, num_cpus=0.1,
                  target_queue_depth=20, max_ongoing_requests=20, scaledown_after_s=0.5)
class Fragile:
    async def __call__(self, body: Work) -> dict[str, int]:
        await asyncio.sleep(body.seconds)
        return {"pid": os.getpid()}

    @ember.route("/fragile/pid", method="GET")
    def pid(self) -> dict[str, int]:
        return {"pid": os.getpid()}


@ember.deployment(route="/drain", warm_floor=0, max_replicas=2, num_cpus=0.1,
                  target_queue_depth=20, max_ongoing_requests=20, scaledown_after_s=0.5,
                  graceful_shutdown_s=15)
class Drainer:
    async def __call__(self, body: Work) -> dict[str, int]:
        await asyncio.sleep(body.seconds)
        return {"pid": os.getpid()}


SICK_FLAG = Path(os.environ.get("EMBER_TEST_SICK_FLAG", "/tmp/ember-test-sick-flag"))


@ember.deployment(route="/sickly", warm_floor=1, max_replicas=1, num_cpus=0.1)
class Sickly:
    def check_health(self) -> None:
        if SICK_FLAG.exists():
            raise RuntimeError("told to be sick")

    def __call__(self, body: Work) -> dict[str, int]:
        return {"pid": os.getpid()}


@ember.deployment(route="/broken", warm_floor=0, max_replicas=1, num_cpus=0.1,
                  max_start_attempts=2)
class Broken:
    def setup(self) -> None:
        raise FileNotFoundError("weights are nowhere: origin unreachable, no cached copy")

    def __call__(self, body: Work) -> dict[str, int]:
        return {}


@ember.deployment(route="/slow-setup", warm_floor=0, max_replicas=1, num_cpus=0.1,
                  health_check_period_s=0.5, health_check_timeout_s=0.5)
class SlowSetup:
    """Loads for far longer than its health-check timeout: that is a start, not a failure."""

    def setup(self) -> None:
        import time

        time.sleep(4)

    def __call__(self, body: Work) -> dict[str, int]:
        return {"pid": os.getpid()}


STARTED_MARKER = Path(os.environ.get("EMBER_TEST_STARTED", "/tmp/ember-test-started"))


@ember.deployment(route="/order", warm_floor=1, max_replicas=2, num_cpus=0.1,
                  scaledown_after_s=0.5)
class ScaleOrder:
    def setup(self) -> None:
        import time

        if STARTED_MARKER.exists():  # not the first replica: a slow load
            time.sleep(8)
        STARTED_MARKER.write_text(str(os.getpid()))

    def __call__(self, body: Work) -> dict[str, int]:
        return {"pid": os.getpid()}


app = ember.App([Fragile, Drainer, Sickly, Broken, SlowSetup, ScaleOrder], name="fault-tests",
                warm_pool=0)
