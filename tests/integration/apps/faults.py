"""Deployments for the fault tests: killable, drainable, sickly and unstartable replicas.

Files shared with the test process live in the session's own directory,
``EMBER_TEST_STATE_DIR`` (set by ``conftest.py`` before Ray starts, so that the workers
inherit it), so that two test sessions on one machine never see each other's flags. The
paths are read when used: the test process imports this module before the fixture sets it.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel

import ember


def sick_flag() -> Path:
    """While this file exists, Sickly fails its health checks."""
    return _state_dir() / "ember-test-sick-flag"


def started_marker() -> Path:
    """Written by the first ScaleOrder replica; later ones find it and load slowly."""
    return _state_dir() / "ember-test-started"


def _state_dir() -> Path:
    return Path(os.environ.get("EMBER_TEST_STATE_DIR", tempfile.gettempdir()))


class Work(BaseModel):
    seconds: float = 1.0


class TaggedWork(BaseModel):
    """Work that leaves a trace: the file ``<journal>/<tag>@<pid>`` when a replica starts it."""

    seconds: float = 1.0
    tag: str = ""
    journal: str | None = None


class Served(BaseModel):
    """Which replica process served a request, and when (``time.time()``) it ran there."""

    pid: int
    started: float
    finished: float


@ember.deployment(route="/fragile", warm_floor=2, max_replicas=2, num_cpus=0.1,
                  target_queue_depth=20, max_ongoing_requests=20, scaledown_after_s=0.5)
class Fragile:
    async def __call__(self, body: TaggedWork) -> Served:
        started = time.time()
        if body.journal:
            (Path(body.journal) / f"{body.tag}@{os.getpid()}").touch()
        await asyncio.sleep(body.seconds)
        return Served(pid=os.getpid(), started=started, finished=time.time())

    @ember.route("/fragile/pid", method="GET")
    def pid(self) -> dict[str, int]:
        return {"pid": os.getpid()}


@ember.deployment(route="/drain", warm_floor=0, max_replicas=2, num_cpus=0.1,
                  target_queue_depth=20, max_ongoing_requests=20, scaledown_after_s=0.5,
                  graceful_shutdown_s=15)
class Drainer:
    async def __call__(self, body: Work) -> Served:
        started = time.time()
        await asyncio.sleep(body.seconds)
        return Served(pid=os.getpid(), started=started, finished=time.time())


@ember.deployment(route="/sickly", warm_floor=1, max_replicas=1, num_cpus=0.1)
class Sickly:
    def check_health(self) -> None:
        if sick_flag().exists():
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
        time.sleep(4)

    def __call__(self, body: Work) -> dict[str, int]:
        return {"pid": os.getpid()}


@ember.deployment(route="/order", warm_floor=1, max_replicas=2, num_cpus=0.1,
                  scaledown_after_s=0.5)
class ScaleOrder:
    def setup(self) -> None:
        if started_marker().exists():  # not the first replica: a slow load
            time.sleep(8)
        started_marker().write_text(str(os.getpid()))

    def __call__(self, body: Work) -> dict[str, int]:
        return {"pid": os.getpid()}


app = ember.App([Fragile, Drainer, Sickly, Broken, SlowSetup, ScaleOrder], name="fault-tests",
                warm_pool=0)
