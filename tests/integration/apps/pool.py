"""A slow-starting and a preloaded deployment, served through the warm pool at zero."""

from __future__ import annotations

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


app = ember.App([SlowStart, Preloaded], name="pool-tests", warm_pool=1)
