"""Toy deployments for the offline (Ray Data) tests and the online-beside-offline test."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from pydantic import BaseModel

import ember

#: Seconds per item of the shared toy deployment: cost by sleeping, not by CPU.
ITEM_S = 0.02


class Doc(BaseModel):
    text: str
    weight: int = 1


class Scored(BaseModel):
    score: float
    tag: str


@ember.deployment(batch=ember.Batch(max_size=8), num_cpus=0.1)
class Lengths:
    def setup(self) -> None:
        self.pid = float(os.getpid())

    @ember.route("/lengths")
    def lengths(self, texts: list[str]) -> list[list[float]]:
        if "boom" in texts:
            raise ValueError("boom is not a text")
        for text in texts:
            if text.startswith("die:") and not Path(text[4:]).exists():
                Path(text[4:]).write_text("killed once")  # the retried call then succeeds
                os.kill(os.getpid(), signal.SIGKILL)
        return [[float(len(t)), self.pid] for t in texts]

    @ember.route("/lengths/slow")
    async def slow(self, texts: list[str]) -> list[int]:
        await asyncio.sleep(0.03 * len(texts))
        return [len(t) for t in texts]


@ember.deployment(num_cpus=0.1)
class Scorer:
    @ember.route("/score")
    async def score(self, docs: list[Doc]) -> list[Scored]:
        return [Scored(score=len(d.text) * d.weight, tag=d.text[:1]) for d in docs]


app = ember.App([Lengths, Scorer], name="offline-toys")


@ember.deployment(route="/shared", warm_floor=1, max_replicas=1, num_cpus=0.1,
                  batch=ember.Batch(max_size=32, max_wait_ms=2), scaledown_after_s=60)
class Shared:
    def setup(self) -> None:
        self.items = 0

    async def __call__(self, items: list[str]) -> list[int]:
        await asyncio.sleep(ITEM_S * len(items))
        self.items += len(items)
        return [len(t) for t in items]

    @ember.route("/shared/items", method="GET")
    def count(self) -> dict[str, int]:
        return {"items": self.items}


share_app = ember.App([Shared], name="offline-share")
