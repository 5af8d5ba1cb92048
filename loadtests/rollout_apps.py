"""A small app for the rollout scenario: two versions of one deployment.

Version 1 is stable and kept warm; version 2, the candidate, starts at zero replicas, so
the rollout must wake it before it takes traffic. Both answer after 20-40 ms of sleep (no
CPU), so the machine's load does not decide the verdict; they answer the same, apart from
the version they name.

    ember run loadtests/rollout_apps.py:app
"""

from __future__ import annotations

import asyncio
import random

from pydantic import BaseModel, Field

import ember

DEPLOYMENT = "Scorer"


class Work(BaseModel):
    text: str = Field(max_length=1000)


class Scored(BaseModel):
    version: str
    length: int


def _version(label: str, floor: int) -> type:
    @ember.deployment(name=DEPLOYMENT, version=label, route="/score", warm_floor=floor,
                      max_replicas=2, num_cpus=0.1, target_queue_depth=8,
                      max_ongoing_requests=32, request_timeout_s=30)
    class Scorer:
        async def __call__(self, body: Work) -> Scored:
            await asyncio.sleep(random.uniform(0.02, 0.04))
            return Scored(version=label, length=len(body.text))

    return Scorer


app = ember.App([_version("1", 1), _version("2", 0)], name="loadtest-rollout", warm_pool=0)
