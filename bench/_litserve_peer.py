"""LitServe serving MiniLM, the throughput peer: run as a subprocess by ``bench/throughput.py``.

The same model built by the same code as the other contenders (``_fastapi_peer.load_minilm``
and ``embed_items``: ``find_model_files``, ``Tokenizer``, ``build_model`` on ``safetensors``
``load_file``, ``embed``), one torch thread, batching on (``max_batch_size=32``,
``batch_timeout=0.005``, the batch settings every batching contender gets), one worker, one
API server, on 127.0.0.1 at ``POST /predict`` with ``{"text": ...}``; logs at WARNING.

``predict`` runs in LitServe's inference worker, a process of its own that no route of the
API server can read, so it counts its calls and texts into the file named by
``--stats-file`` (``{"calls", "items"}``, replaced atomically after every batch, a few
microseconds against a forward pass of milliseconds); :func:`read_counts` reads it.

Usage (by the benchmark): ``python bench/_litserve_peer.py --port N --stats-file PATH``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import _harness as h
import litserve
from _fastapi_peer import WARMUP_TEXT, embed_items, load_minilm

MAX_BATCH = 32
BATCH_TIMEOUT_S = 0.005
CONFIG = {"version": litserve.__version__, "max_batch_size": MAX_BATCH,
          "batch_timeout_s": BATCH_TIMEOUT_S, "workers": 1, "api_servers": 1}


class MiniLMLitAPI(litserve.LitAPI):  # type: ignore[misc]  # litserve is untyped
    """The same model and code as the other contenders, batched by LitServe; counts batches."""

    def __init__(self, stats_file: Path, **options: Any) -> None:
        super().__init__(**options)
        self.stats_file = stats_file  # pickled into the inference worker with the API

    def setup(self, device: Any) -> None:
        self.model, self.tokenizer = load_minilm()
        self.calls, self.items = 0, 0
        self.predict([WARMUP_TEXT])

    # LitServe types its endpoint from these two signatures: left unannotated, the body is
    # read as JSON and the reply is sent as returned.
    def decode_request(self, request, **kwargs):  # type: ignore[no-untyped-def]
        return str(request["text"])

    def batch(self, inputs: Any) -> list[str]:
        return list(inputs)

    def predict(self, x: Any, **kwargs: Any) -> list[dict[str, Any]]:
        texts = list(x)
        out = embed_items(self.model, self.tokenizer, texts)
        self.calls += 1
        self.items += len(texts)
        partial = self.stats_file.with_name(self.stats_file.name + ".part")
        partial.write_text(json.dumps({"calls": self.calls, "items": self.items}))
        os.replace(partial, self.stats_file)
        return out

    def unbatch(self, output: Any) -> list[Any]:
        return list(output)

    def encode_response(self, output, **kwargs):  # type: ignore[no-untyped-def]
        return output


def read_counts(stats_file: Path) -> tuple[int, int]:
    """(forward passes, texts) so far, as the inference worker last wrote them."""
    counts = json.loads(stats_file.read_text())
    return int(counts["calls"]), int(counts["items"])


def start(deadline: h.Deadline, stats_file: Path) -> tuple[h.ServerProcess, str]:
    """Start the LitServe subprocess and wait until it is healthy; it and its URL."""
    return h.start_peer(__file__, ["--stats-file", str(stats_file)], deadline)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stats-file", type=Path, required=True)
    args = parser.parse_args()
    api = MiniLMLitAPI(args.stats_file.resolve(), max_batch_size=MAX_BATCH,
                       batch_timeout=BATCH_TIMEOUT_S)
    server = litserve.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1,
                                timeout=120)
    server.run(host=h.HOST, port=args.port, num_api_servers=1, log_level="warning",
               generate_client_file=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
