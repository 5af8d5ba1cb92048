"""Plain Ray Serve serving MiniLM with ``@serve.batch``, the peer Ember is built on.

Written the way Ray Serve's batching guide writes it: one deployment behind
``@serve.ingress(FastAPI)``, ``POST /embed`` with ``{"text": ...}`` awaiting an
``async def`` method under ``@serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)``
(the batch settings every batching contender gets) that runs the forward pass inline, one
replica (``num_replicas=1``), ``max_ongoing_requests=32`` (one full batch; Serve's batcher
warns below ``max_batch_size``), the same Ray CPU accounting as Ember's MiniLM replica and the
same model code as the other peers (``_fastapi_peer.load_minilm`` / ``embed_items``), one
torch thread. ``GET /stats`` says how many forward passes ran and how many texts they held.

It runs in the benchmark's own Ray cluster behind Serve's HTTP proxy
(``_serving.plain_url()`` + :data:`PREFIX`): a request crosses one Ray hop, proxy -> replica,
as an Ember request does edge -> replica.
"""

from __future__ import annotations

from typing import Any

import _harness as h
import _serving
from _fastapi_peer import WARMUP_TEXT, TextIn, embed_items, load_minilm
from fastapi import FastAPI
from ray import serve

APP_NAME = "bench-rayserve"
DEPLOYMENT = "MiniLMRayServe"
PREFIX = "/rayserve"
MAX_BATCH = 32
BATCH_WAIT_S = 0.005
CONFIG = {"max_batch_size": MAX_BATCH, "batch_wait_timeout_s": BATCH_WAIT_S,
          "max_ongoing_requests": MAX_BATCH, "num_replicas": 1}

api = FastAPI()


@serve.deployment(name=DEPLOYMENT, num_replicas=1, max_ongoing_requests=MAX_BATCH)
@serve.ingress(api)
class MiniLMRayServe:
    """One replica; concurrent requests share forward passes through ``@serve.batch``."""

    def __init__(self) -> None:
        self.model, self.tokenizer = load_minilm()
        self.calls, self.items = 0, 0
        embed_items(self.model, self.tokenizer, [WARMUP_TEXT])

    @api.post("/embed")
    @_serving.resolved_hints
    async def embed(self, body: TextIn) -> dict[str, Any]:
        result: dict[str, Any] = await self.embed_batch(body.text)
        return result

    @api.get("/stats")
    @_serving.resolved_hints
    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "items": self.items}

    @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=BATCH_WAIT_S)
    async def embed_batch(self, texts: list[str]) -> list[dict[str, Any]]:
        self.calls += 1
        self.items += len(texts)
        return embed_items(self.model, self.tokenizer, texts)


def start(num_cpus: float, deadline: h.Deadline) -> str:
    """Deploy the peer in the running Serve instance; its URL once ``/stats`` answers."""
    bound = MiniLMRayServe.options(  # type: ignore[attr-defined]  # a Serve Deployment
        ray_actor_options={"num_cpus": num_cpus})
    _serving.deploy_plain(bound.bind(), APP_NAME, PREFIX)
    url = _serving.plain_url() + PREFIX
    h.wait_until(lambda: _serving.app_status(APP_NAME) == "RUNNING", f"{APP_NAME} running",
                 deadline)
    h.wait_until(lambda: h.http_ok(url + "/stats"), "the Ray Serve peer", deadline,
                 poll_s=0.5)
    return url
