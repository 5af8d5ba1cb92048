"""Bare FastAPI serving MiniLM, the no-batching peer: a subprocess of ``bench/throughput.py``.

What a team writes without a serving framework: one uvicorn worker, one FastAPI app, a plain
``def`` endpoint (FastAPI runs it in its thread pool), one forward pass per request, one
torch thread, on 127.0.0.1 at ``POST /embed`` with ``{"text": ...}``. ``GET /stats`` says
how many forward passes ran and how many texts they held (``{"calls", "items"}``); logs at
WARNING without access logs.

The model helpers here (:func:`load_minilm`, :func:`embed_items`) are the one copy of the
peers' model code, so that bare FastAPI, LitServe and plain Ray Serve run the same calls as
Ember's deployment (``find_model_files``, ``Tokenizer``, ``build_model`` over ``safetensors``
``load_file``, ``embed``).

Usage (by the benchmark): ``python bench/_fastapi_peer.py --port N``
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

import _harness as h
import torch
from fastapi import FastAPI
from pydantic import BaseModel
from safetensors.torch import load_file

from ember.deployments._minilm import (
    MiniLMConfig,
    MiniLMEncoder,
    Tokenizer,
    build_model,
    embed,
    find_model_files,
)

WARMUP_TEXT = "warm up the kernels before the server reports ready"


class TextIn(BaseModel):
    """One text per request, the body the peers share."""

    text: str


def load_minilm() -> tuple[MiniLMEncoder, Tokenizer]:
    """The model (weights mapped by ``load_file``) and its tokenizer, on one torch thread."""
    torch.set_num_threads(1)
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


def build_api() -> FastAPI:
    """The app: the model loaded and warmed up once, then one forward pass per request."""
    model, tokenizer = load_minilm()
    embed_items(model, tokenizer, [WARMUP_TEXT])
    counts = {"calls": 0, "items": 0}
    lock = threading.Lock()  # the endpoint runs in FastAPI's thread pool
    api = FastAPI()

    @api.post("/embed")
    def embed_one(body: TextIn) -> dict[str, Any]:
        result = embed_items(model, tokenizer, [body.text])[0]
        with lock:
            counts["calls"] += 1
            counts["items"] += 1
        return result

    @api.get("/stats")
    def stats() -> dict[str, int]:
        with lock:
            return dict(counts)

    @api.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return api


def start(deadline: h.Deadline) -> tuple[h.ServerProcess, str]:
    """Start the FastAPI subprocess and wait until it is healthy; it and its URL."""
    return h.start_peer(__file__, [], deadline)


def main() -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(build_api(), host=h.HOST, port=args.port, workers=1, log_level="warning",
                access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
