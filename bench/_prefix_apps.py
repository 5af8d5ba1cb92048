"""Two replicas of a small Llama behind Ember's prefix router, and the same behind Ray's.

The two deployments differ in ``router`` only; each replica runs Ember's generation engine
(``Generator``) on the model ``bench/prefix_routing.py`` builds under ``~/.cache/ember-bench``,
with its prefix cache, on one torch thread. Ray workers import this module by name.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ember
from ember.protocols import GenerateRequest

#: Llamas small enough for four replicas, two per app, on a shared 2-core machine: at 6M
#: parameters a 600-token prefill costs about what the HTTP around it does; at 27M it costs
#: several times more, as a real model's does. ``EMBER_BENCH_PREFIX_MODEL`` picks one.
MODELS = {
    "6m": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6,
           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1024},
    "27m": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1024},
}
MODEL = os.environ.get("EMBER_BENCH_PREFIX_MODEL", "27m")
SIZES = MODELS[MODEL]
MODEL_DIR = Path.home() / ".cache" / "ember-bench" / f"llama-prefix-{MODEL}"
#: Logical CPUs: 0.2 a replica, so both apps fit a local cluster of 2.
OPTIONS: dict[str, Any] = {"warm_floor": 2, "max_replicas": 2, "num_cpus": 0.2,
                           "max_ongoing_requests": 16, "scaledown_after_s": 600,
                           "request_timeout_s": 120, "warm_pool": False}


class _Engine:
    """The replica: Ember's engine on the model directory, one torch thread."""

    def setup(self) -> None:
        import torch

        from ember.deployments._textgen_engine import EngineConfig
        from ember.deployments._textgen_hf import TransformersBackend
        from ember.deployments.textgen import Generator

        torch.set_num_threads(1)
        backend = TransformersBackend.from_directory(MODEL_DIR, max_len=1024)
        backend.eos_token_id = None  # forced lengths: every request makes its tokens
        self.generator = Generator(backend, EngineConfig(max_num_seqs=8, max_waiting_seqs=64))

    def warmup(self) -> None:
        self.generator.warmup()


#: The router's queue gap (``EMBER_BENCH_PREFIX_GAP``; Ember's default is 8).
GAP = int(os.environ.get("EMBER_BENCH_PREFIX_GAP", "8"))


@ember.deployment(name="GenPrefix", router="prefix", prefix_max_queue_gap=GAP, **OPTIONS)
class GenPrefix(_Engine):
    @ember.route("/gen")
    async def generate(self, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self.generator.stream(body):
            yield chunk


@ember.deployment(name="GenDefault", **OPTIONS)
class GenDefault(_Engine):
    @ember.route("/gen")
    async def generate(self, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self.generator.stream(body):
            yield chunk


prefix_app = ember.App([GenPrefix], name="bench-prefix-router", warm_pool=0)
default_app = ember.App([GenDefault], name="bench-default-router", warm_pool=0)
