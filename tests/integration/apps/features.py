"""Deployments for the batching, pipeline, streaming and protocol tests."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from pydantic import BaseModel

import ember
from ember.protocols import (
    OpenAIEmbeddings,
    OpenInferenceProtocol,
    TensorModel,
    TensorSpec,
)


class Item(BaseModel):
    values: list[float]
    fail: bool = False


class Total(BaseModel):
    total: float
    batch_size: int


@ember.deployment(route="/sum", warm_floor=1, num_cpus=0.1, max_replicas=1,
                  batch=ember.Batch(max_size=64, max_wait_ms=50))
class Summer:
    def setup(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, items: list[Item]) -> list[Total]:
        self.sizes.append(len(items))
        if any(item.fail for item in items):
            raise ValueError("an item asked to fail")
        return [Total(total=sum(item.values), batch_size=len(items)) for item in items]

    @ember.route("/sum/batches", method="GET")
    def batches(self) -> dict[str, int]:
        return {"max": max(self.sizes, default=0), "calls": len(self.sizes)}


@ember.deployment(name="Doubler", warm_floor=1, num_cpus=0.1, max_replicas=1,
                  batch=ember.Batch(max_size=32, max_wait_ms=20))
class Doubler:
    @ember.route()  # internal: reached through the Open Inference Protocol
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Embedding(BaseModel):
    embedding: list[float]
    tokens: int


@ember.deployment(name="FakeEmbedder", warm_floor=1, num_cpus=0.1, max_replicas=1,
                  batch=ember.Batch(max_size=16, max_wait_ms=10))
class FakeEmbedder:
    """Deterministic 8-dim vectors from a hash: protocol tests need no model."""

    @ember.route()
    def embed(self, texts: list[str]) -> list[Embedding]:
        out = []
        for text in texts:
            digest = hashlib.sha256(text.encode()).digest()
            out.append(Embedding(embedding=[b / 255 for b in digest[:8]],
                                 tokens=len(text.split())))
        return out

    @ember.route("/fake/embed")
    def embed_route(self, texts: list[str]) -> list[Embedding]:
        return self.embed(texts)


class CountIn(BaseModel):
    n: int
    delay_s: float = 0.0


@ember.deployment(route="/count", warm_floor=1, num_cpus=0.1, max_replicas=1)
class Counter:
    async def __call__(self, body: CountIn) -> AsyncIterator[dict[str, int]]:
        for i in range(body.n):
            yield {"i": i}
            await asyncio.sleep(body.delay_s)


class Text(BaseModel):
    text: str


def _window(started: float) -> dict[str, float]:
    return {"setup_started": started, "setup_done": time.time()}


def _staged(value: dict[str, object], stage: str, window: dict[str, float]) -> dict[str, object]:
    """``value`` with ``stage`` appended to its stages and that stage's setup window."""
    stages = value["stages"]
    assert isinstance(stages, list)
    return {**value, "stages": [*stages, stage], stage: window}


@ember.deployment(warm_floor=1, num_cpus=0.1, max_replicas=1)
class Pre:
    def __call__(self, body: Text) -> dict[str, object]:
        return {"text": body.text.upper(), "stages": ["pre"]}


@ember.deployment(warm_floor=0, num_cpus=0.1, max_replicas=1, scaledown_after_s=1.0)
class Mid:
    async def setup(self) -> None:
        started = time.time()
        await asyncio.sleep(2.0)  # a slow model load
        self.window = _window(started)

    def __call__(self, value: dict[str, object]) -> dict[str, object]:
        return _staged(value, "mid", self.window)


@ember.deployment(warm_floor=0, num_cpus=0.1, max_replicas=1, scaledown_after_s=1.0)
class Post:
    async def setup(self) -> None:
        started = time.time()
        await asyncio.sleep(2.0)
        self.window = _window(started)

    def __call__(self, value: dict[str, object]) -> dict[str, object]:
        return _staged(value, "post", self.window)


pipe = ember.pipeline([Pre, Mid, Post], route="/pipe", name="pipe")


class Marked(BaseModel):
    marker: str


@ember.deployment(warm_floor=1, num_cpus=0.1, max_replicas=1)
class Forward:
    def __call__(self, body: Marked) -> str:
        return body.marker


@ember.deployment(warm_floor=1, num_cpus=0.1, max_replicas=1)
class Stuck:
    async def __call__(self, marker: str) -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            Path(marker).write_text("cancelled")  # the downstream stage saw the deadline
            raise
        return "never"


stuck_pipe = ember.pipeline([Forward, Stuck], route="/stuck", name="stuck",
                            request_timeout_s=1.5)

app = ember.App(
    [Summer, Doubler, FakeEmbedder, Counter, pipe, stuck_pipe],
    name="feature-tests",
    protocols=[
        OpenAIEmbeddings(deployment="FakeEmbedder", attr="embed", model="fake-8",
                         dimensions=8),
        OpenInferenceProtocol([TensorModel(
            name="doubler", deployment="Doubler", attr="forward",
            input=TensorSpec("INPUT0", "FP32", (-1, 4)),
            output=TensorSpec("OUTPUT0", "FP32", (-1, 4)))]),
    ],
)
