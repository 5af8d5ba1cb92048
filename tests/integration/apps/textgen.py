"""The generation deployment with small limits: two sequences running, one waiting, quick
scale-down, so that admission, disconnects and scale-to-zero show within seconds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import ember
from ember.deployments._textgen_engine import EngineConfig
from ember.deployments.textgen import MODEL_NAME, Generator, load_backend
from ember.protocols import GenerateRequest, OpenAIGeneration

LIMITS = EngineConfig(max_num_seqs=2, max_waiting_seqs=1, name="SmallGen")
#: The same engine scheduling whole batches (a batch runs until its last sequence ends).
STATIC = EngineConfig(max_num_seqs=2, max_waiting_seqs=1, mode="static", name="StaticGen")


@ember.deployment(name="SmallGen", warm_floor=0, max_replicas=1, num_cpus=0.25,
                  max_ongoing_requests=16, target_queue_depth=8, scaledown_after_s=2.0,
                  request_timeout_s=60)
class SmallGen:
    def setup(self) -> None:
        self.generator = Generator(load_backend(), LIMITS)

    def warmup(self) -> None:
        self.generator.warmup()

    @ember.route("/generate")
    async def generate(self, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self.generator.stream(body):
            yield chunk


@ember.deployment(name="StaticGen", warm_floor=0, max_replicas=1, num_cpus=0.1,
                  max_ongoing_requests=16, target_queue_depth=8, scaledown_after_s=2.0,
                  request_timeout_s=60)
class StaticGen:
    """SmallGen on the static schedule: the peer the continuous-batching test must fail on."""

    def setup(self) -> None:
        self.generator = Generator(load_backend(), STATIC)

    @ember.route("/generate-static")
    async def generate(self, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self.generator.stream(body):
            yield chunk


app = ember.App([SmallGen, StaticGen], name="textgen-small", protocols=[
    OpenAIGeneration(deployment="SmallGen", attr="generate", model=MODEL_NAME)])
