"""Streamed generation as a plain Ray Serve user writes it, for ``bench/textgen_coldstart.py``.

``serve run _rayserve_textgen:build model_dir=/models/llama`` serves ``POST /`` (JSON
``{"prompt": ..., "max_tokens": n}``): the deployment loads the folder with
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` in its
constructor and streams greedy ``model.generate()`` tokens as they come (a streamer that
hands on every token at once: ``TextIteratorStreamer`` would hold text back to word
boundaries and so delay the first token). Autoscaling as Ray Serve documents scale to zero:
``min_replicas: 0``, everything else at Ray's defaults; one CPU and one torch thread, as
Ember's TextGen replica.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import StreamingResponse


class _TokenQueue:
    """A ``generate()`` streamer: each new token's text onto an asyncio queue."""

    def __init__(self, tokenizer: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.tokenizer, self.loop = tokenizer, loop
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:  # generate() first puts the prompt's ids
            self.prompt_seen = True
            return
        text = self.tokenizer.decode(value.reshape(-1).tolist(), skip_special_tokens=True)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, text)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


@serve.deployment(autoscaling_config={"min_replicas": 0, "max_replicas": 1},
                  ray_actor_options={"num_cpus": 1})
class Generate:
    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "1")))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        self.model.eval()

    async def __call__(self, request: Request) -> StreamingResponse:
        import torch

        body = await request.json()
        ids = torch.tensor([self.tokenizer(body["prompt"])["input_ids"]])
        streamer = _TokenQueue(self.tokenizer, asyncio.get_running_loop())
        n = int(body.get("max_tokens", 8))

        def run() -> None:
            try:
                with torch.inference_mode():
                    self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        pad_token_id=0, streamer=streamer)
            finally:
                streamer.end()

        threading.Thread(target=run, daemon=True).start()

        async def chunks() -> AsyncIterator[str]:
            while (text := await streamer.queue.get()) is not None:
                yield text

        return StreamingResponse(chunks(), media_type="text/plain")


def build(args: dict[str, str]) -> Any:
    return Generate.bind(args["model_dir"])
