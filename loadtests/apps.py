"""A small app for the overload scenario: one slow request at a time, a queue of four.

Overloading the flagship would take more than its ``max_queue`` (64) of concurrent
requests, more than a 2-core machine can send while also running the model; this
deployment is full at five requests in flight, so a few dozen users overload it.

    ember run loadtests/apps.py:app
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

import ember

MAX_QUEUE = 4


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


app = ember.App([Slow], name="loadtest-overload")
