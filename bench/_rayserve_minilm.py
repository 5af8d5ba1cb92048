"""MiniLM on Ray Serve as its users write it: the request-path benchmark's Ray contenders.

``bench/throughput.py`` starts it with ``serve run <config.yaml>`` in a fresh local Ray
cluster of its own (``--address local``), in a process tree of its own, with a filtered
environment (no ``RAY_*``/``EMBER_*`` variable but the ones the contender names):

* ``stock``: Ray Serve's batching guide as written: a plain ``@serve.deployment`` whose
  ``async def __call__`` awaits an ``@serve.batch`` method, every other option at Ray's
  default (``max_ongoing_requests=5``, one replica, Serve's HTTP proxy, the dashboard).
* ``tuned``: the same code with only settings Ray documents: ``max_ongoing_requests=64``
  (the performance guide: at least the batch size, so one batch can queue behind the
  running one) and ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` (Ray 2.56+'s high-throughput mode).

The batch is the model's contract, the same in every contender (at most 32 texts, 5 ms
wait), and so is the model code: Ember's MiniLM implementation (``ember.deployments._minilm``,
the same calls as the flagship's handler), on ``BENCH_TORCH_THREADS`` torch threads.
``POST /embed`` takes ``{"text": ...}`` and answers ``{"embedding", "tokens"}``;
``GET /embed/stats`` counts forward passes (``calls``), texts (``items``) and the sum of
squared batch sizes (``items_sq``), so that the mean batch a request rode in is
``items_sq / items``, counted as in Ember's contender.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from ray import serve
from safetensors.torch import load_file
from starlette.requests import Request

from ember.deployments._minilm import (
    MiniLMConfig,
    MiniLMEncoder,
    Tokenizer,
    build_model,
    embed,
    find_model_files,
)

MAX_BATCH = 32
BATCH_WAIT_S = 0.005
WARMUP_TEXT = "warm up the kernels before the server reports ready"


def load_minilm() -> tuple[MiniLMEncoder, Tokenizer]:
    """The model (weights mapped by ``load_file``) and its tokenizer."""
    torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "1")))
    files = find_model_files()
    config = MiniLMConfig.from_file(files.config)
    model = build_model(load_file(str(files.weights), device="cpu"), config)
    return model, Tokenizer(files.tokenizer)


def embed_items(model: MiniLMEncoder, tokenizer: Tokenizer,
                texts: list[str]) -> list[dict[str, Any]]:
    """One forward pass over ``texts``: ``{"embedding", "tokens"}`` per text, as Ember answers."""
    vectors = embed(model, tokenizer, texts, batch_size=64)
    counts = tokenizer.token_counts(texts)
    return [{"embedding": v, "tokens": n}
            for v, n in zip(vectors.tolist(), counts, strict=True)]


@serve.deployment
class MiniLMServe:
    """One replica; concurrent requests share forward passes through ``@serve.batch``."""

    def __init__(self) -> None:
        self.model, self.tokenizer = load_minilm()
        self.counts = {"calls": 0, "items": 0, "items_sq": 0}
        embed_items(self.model, self.tokenizer, [WARMUP_TEXT])

    async def __call__(self, request: Request) -> Any:
        if request.method == "GET" and request.url.path.endswith("/stats"):
            return dict(self.counts)
        body = await request.json()
        return await self.embed_batch(body["text"])

    @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=BATCH_WAIT_S)
    async def embed_batch(self, texts: list[str]) -> list[dict[str, Any]]:
        n = len(texts)
        self.counts["calls"] += 1
        self.counts["items"] += n
        self.counts["items_sq"] += n * n
        return embed_items(self.model, self.tokenizer, texts)


app = MiniLMServe.bind()  # type: ignore[attr-defined]  # a Serve Deployment
