"""LitServe serving MiniLM, the throughput peer: run as a subprocess by ``bench/throughput.py``.

The same model built by the same code as Ember's deployments (``find_model_files``,
``Tokenizer``, ``build_model`` on ``safetensors`` ``load_file``, ``embed``), one torch
thread, batching on (``max_batch_size=64``, ``batch_timeout=0.005``), one worker, one API
server, on 127.0.0.1 at ``POST /predict`` with ``{"text": ...}``; logs at WARNING.

Usage (by the benchmark): ``python bench/_litserve_peer.py --port N``
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import _harness as h
import litserve
import torch
from safetensors.torch import load_file

from ember.deployments._minilm import (
    MiniLMConfig,
    Tokenizer,
    build_model,
    embed,
    find_model_files,
)

MAX_BATCH = 64
BATCH_TIMEOUT_S = 0.005
CONFIG = {"version": litserve.__version__, "max_batch_size": MAX_BATCH,
          "batch_timeout_s": BATCH_TIMEOUT_S, "workers": 1, "api_servers": 1}


class MiniLMLitAPI(litserve.LitAPI):  # type: ignore[misc]  # litserve is untyped
    """The same model and code as the Ember deployments, batched by LitServe."""

    def setup(self, device: Any) -> None:
        torch.set_num_threads(1)
        files = find_model_files()
        config = MiniLMConfig.from_file(files.config)
        self.model = build_model(load_file(str(files.weights), device="cpu"), config)
        self.tokenizer = Tokenizer(files.tokenizer)
        self.predict(["warm up the kernels before the server reports ready"])

    # LitServe types its endpoint from these two signatures: left unannotated, the body is
    # read as JSON and the reply is sent as returned.
    def decode_request(self, request, **kwargs):  # type: ignore[no-untyped-def]
        return str(request["text"])

    def batch(self, inputs: Any) -> list[str]:
        return list(inputs)

    def predict(self, x: Any, **kwargs: Any) -> list[tuple[list[float], int]]:
        vectors = embed(self.model, self.tokenizer, x, batch_size=64)
        counts = self.tokenizer.token_counts(x)
        return list(zip(vectors.tolist(), counts, strict=True))

    def unbatch(self, output: Any) -> list[Any]:
        return list(output)

    def encode_response(self, output, **kwargs):  # type: ignore[no-untyped-def]
        return {"embedding": output[0], "tokens": output[1]}


def text_body(i: int) -> bytes:
    """LitServe ``/predict``'s body: one text (the same texts as Ember's)."""
    from _batching_apps import TEXTS

    return json.dumps({"text": TEXTS[i % len(TEXTS)]}).encode()


def start(deadline: h.Deadline) -> tuple[h.ServerProcess, str]:
    """Start the LitServe subprocess and wait until it is healthy; it and its URL."""
    port = h.free_port()
    server = h.ServerProcess([sys.executable, __file__, "--port", str(port)],
                             env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    url = f"http://{h.HOST}:{port}"
    try:
        server.wait_ready(url + "/health", deadline)
    except BaseException:
        server.stop()
        raise
    return server, url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    api = MiniLMLitAPI(max_batch_size=MAX_BATCH, batch_timeout=BATCH_TIMEOUT_S)
    server = litserve.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1,
                                timeout=120)
    server.run(host=h.HOST, port=args.port, num_api_servers=1, log_level="warning",
               generate_client_file=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
