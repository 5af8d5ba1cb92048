"""The textgen deployment's own class over a tiny Llama with two LoRA adapters, on two
replicas behind the prefix router; a GET route says which replica answered and what it holds.

The models are written under ``$EMBER_TEST_STATE_DIR`` (set before Ray starts, so every
worker sees it) by the test, before the app is served.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ray import serve

import ember
from ember.deployments.textgen import ENGINE, Generator, TextGen, load_backend
from ember.protocols import GenerateRequest, OpenAIGeneration

#: Adapter name -> the folder ``lora_models.model_dirs`` writes it to.
ADAPTERS = {"sql": "a", "chat": "b"}
BASE = "tiny-llama"


def model_root() -> Path:
    """Where the base model and the adapters are written."""
    return Path(os.environ["EMBER_TEST_STATE_DIR"]) / "lora-models"


@ember.deployment(name="LoraGen", warm_floor=2, max_replicas=2, num_cpus=0.25,
                  router="prefix", max_ongoing_requests=32, scaledown_after_s=600,
                  request_timeout_s=120)
class LoraGen(TextGen):
    """TextGen's generation (``generate`` and its ``@serve.multiplexed`` registration) as
    shipped; only the model and adapters come from the test's folder, not the environment."""

    def setup(self) -> None:
        root = model_root()
        adapters = {name: (root / folder).as_uri() for name, folder in ADAPTERS.items()}
        self.generator = Generator(load_backend(str(root / "base")), ENGINE,
                                   adapters=adapters, max_adapters=len(ADAPTERS))
        self.replica = serve.get_replica_context().replica_id.unique_id

    @ember.route("/lora-gen/generate")  # routes are declared per class: TextGen's, as is
    async def generate(self, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        async for chunk in super().generate(body):
            yield chunk

    @ember.route("/lora-gen/held", method="GET")
    def held(self) -> dict[str, str | list[str]]:
        """This replica's id and the adapters its store holds."""
        return {"replica": self.replica, "adapters": self.generator.store.names()}


app = ember.App([LoraGen], name="lora-routing", warm_pool=0, protocols=[
    OpenAIGeneration(deployment="LoraGen", attr="generate", model=BASE,
                     adapters=tuple(ADAPTERS))])
