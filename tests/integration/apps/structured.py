"""A ``transformers`` causal LM behind the generation routes: the tiny character-level Llama
of ``support.char_llama``, built under ~/.cache/ember-bench, so structured output is served
through the same engine with a tokenizer of the transformers kind."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ember
from ember.deployments._textgen_engine import EngineConfig
from ember.deployments.textgen import Generator, load_backend
from ember.protocols import GenerateRequest, OpenAIGeneration

from support import char_llama

MODEL_DIR = Path.home() / ".cache" / "ember-bench" / "tiny-char-llama"
MODEL_NAME = "tiny-char-llama"


@ember.deployment(name="CharGen", warm_floor=0, max_replicas=1, num_cpus=0.25,
                  max_ongoing_requests=16, target_queue_depth=8, scaledown_after_s=60,
                  request_timeout_s=120)
class CharGen:
    def setup(self) -> None:
        self.generator = Generator(load_backend(str(char_llama(MODEL_DIR))),
                                   EngineConfig(max_num_seqs=4, name="CharGen"))

    def warmup(self) -> None:
        self.generator.warmup()

    @ember.route("/generate")
    async def generate(self, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self.generator.stream(body):
            yield chunk


app = ember.App([CharGen], name="structured-hf", protocols=[
    OpenAIGeneration(deployment="CharGen", attr="generate", model=MODEL_NAME)])
