"""The Ember deployments the batching benchmarks serve, and the requests they send.

One Ember app (``warm_pool=0``: a deployment's own replica serves every request), holding
only the deployments the benchmark at hand measures:

* ``mlp``: ``SeedMLP`` from ``examples/mlp_app.py`` as shipped (batched tensor handler,
  ``ember.Batch(max_size=512, max_wait_ms=2)``), over Open Inference v2 at
  ``POST /v2/models/mlp/infer``.
* ``batched`` (``POST /embed``): the MiniLM flagship with its shipped options
  (``ember.Batch(max_size=64, max_wait_ms=5)``...), changed only in ``warm_floor=1``,
  ``max_replicas=1`` and ``num_cpus=0.25`` (Ray accounting, so that every variant fits on two
  logical CPUs). It counts its handler calls and texts (``GET /embed/stats``). A benchmark
  that fixes the batch itself passes ``batch`` to :func:`start` (``bench/throughput.py``:
  :data:`THROUGHPUT_BATCH`, the settings every batching contender there gets); the
  deployment keeps its name, routes and other options (:func:`rebatched`).
* ``unbatched`` (``POST /embed-unbatched``): the same with ``batch=None`` and
  ``max_ongoing_requests=64``: each request runs its own forward pass.
* ``pipeline`` (``POST /embed-pipeline``): the flagship's three stages (``Tokenize ->
  Encode -> Pool``), one replica each, fractional CPUs.

Every replica calls ``torch.set_num_threads(1)``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Before Ray starts: local workers inherit the directories on sys.path as PYTHONPATH.
sys.path.insert(0, str(ROOT / "examples"))

import _harness as h  # noqa: E402
import _serving  # noqa: E402
import httpx  # noqa: E402
import torch  # noqa: E402
from _load import (  # noqa: E402, F401  # the bodies, re-exported for the scripts
    TEXTS,
    ember_single_body,
    ember_text_body,
    short_text,
    text_object_body,
)
from mlp_app import IN_FEATURES, OUT_FEATURES, SeedMLP  # noqa: E402
from mlp_app import app as mlp_app  # noqa: E402

import ember  # noqa: E402
from ember.deployments.embeddings import (  # noqa: E402
    DIMENSIONS,
    Embedding,
    Encode,
    MiniLM,
    Pool,
    Tokenize,
)

APP_NAME = "bench-batching"
MODEL_CPUS = 0.25  # Ray accounting per MiniLM replica; compute is torch's one thread
STAGE_CPUS = 0.1  # tokenize and pool stages
ONE_REPLICA = {"warm_floor": 1, "max_replicas": 1}
#: The batch of ``bench/throughput.py``'s batching contenders: 32 items, 5 ms wait.
THROUGHPUT_BATCH = ember.Batch(max_size=32, max_wait_ms=5)
JSON_HEADERS = {"content-type": "application/json"}


class _OneThread(MiniLM):
    def setup(self) -> None:
        torch.set_num_threads(1)
        super().setup()


@ember.deployment(**_serving.shipped_options(
    MiniLM, name="MiniLMBatched", route="/embed", num_cpus=MODEL_CPUS, **ONE_REPLICA))
class MiniLMBatched(_OneThread):
    """The flagship: items of concurrent requests share forward passes; counts them."""

    calls = 0
    items = 0

    def __call__(self, texts: list[str]) -> list[Embedding]:
        self.calls += 1
        self.items += len(texts)
        return super().__call__(texts)

    @ember.route("/embed/stats", method="GET")
    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "items": self.items}


@ember.deployment(**_serving.shipped_options(
    MiniLM, name="MiniLMUnbatched", route="/embed-unbatched", num_cpus=MODEL_CPUS, batch=None,
    max_ongoing_requests=64, **ONE_REPLICA))
class MiniLMUnbatched(_OneThread):
    """No ``ember.Batch``: every request runs its own forward pass."""

    def __call__(self, texts: list[str]) -> list[Embedding]:
        return super().__call__(texts)


@ember.deployment(**_serving.shipped_options(Tokenize, num_cpus=STAGE_CPUS, **ONE_REPLICA))
class BenchTokenize(Tokenize):
    def __call__(self, texts: list[str]) -> dict[str, Any]:
        return super().__call__(texts)


@ember.deployment(**_serving.shipped_options(Encode, num_cpus=MODEL_CPUS, **ONE_REPLICA))
class BenchEncode(Encode):
    def setup(self) -> None:
        torch.set_num_threads(1)
        super().setup()

    def __call__(self, value: dict[str, Any]) -> dict[str, Any]:
        return super().__call__(value)


@ember.deployment(**_serving.shipped_options(Pool, num_cpus=STAGE_CPUS, **ONE_REPLICA))
class BenchPool(Pool):
    def setup(self) -> None:
        torch.set_num_threads(1)

    def __call__(self, value: dict[str, Any]) -> list[Embedding]:
        return super().__call__(value)


def rebatched(cls: type, batch: ember.Batch) -> type:
    """Deployment ``cls`` under its own name, routes and options, but batching by ``batch``.

    A subclass decorated anew: ``@ember.deployment`` reads the routes from the class's own
    namespace, so the route methods are copied into it.
    """
    from ember.app.decorator import get_spec

    routes = {spec.attr: vars(cls)[spec.attr] for spec in get_spec(cls).routes}
    members = {**routes, "__module__": cls.__module__, "__doc__": cls.__doc__}
    options = _serving.shipped_options(cls, batch=batch)
    return ember.deployment(**options)(type(cls.__name__, (cls,), members))


def build_app(parts: tuple[str, ...], batch: ember.Batch | None = None) -> ember.App:
    """The bench app with ``parts`` (``mlp``, ``batched``, ``unbatched``, ``pipeline``);
    ``batch``, if given, replaces the ``batched`` flagship's shipped batch."""
    members: dict[str, Any] = {"mlp": SeedMLP, "unbatched": MiniLMUnbatched,
                               "batched": MiniLMBatched if batch is None
                               else rebatched(MiniLMBatched, batch)}
    chosen = [members[p] for p in parts if p in members]
    if "pipeline" in parts:
        chosen.append(ember.pipeline([BenchTokenize, BenchEncode, BenchPool],
                                     route="/embed-pipeline", name="embed-pipeline"))
    protocols = list(mlp_app.protocols) if "mlp" in parts else []
    return ember.App(chosen, name=APP_NAME, warm_pool=0, protocols=protocols)


PROBES = {"mlp": "/v2/models/mlp/infer", "batched": "/embed", "unbatched": "/embed-unbatched",
          "pipeline": "/embed-pipeline"}


def start(port: int, parts: tuple[str, ...], deadline: h.Deadline,
          batch: ember.Batch | None = None) -> str:
    """Serve the app with ``parts`` (``batch``: see :func:`build_app`); returns once each
    answers (its replica is up)."""
    base_url = _serving.start_serve(port)
    _serving.deploy_ember(build_app(parts, batch), deadline)
    h.wait_until(lambda: h.http_ok(base_url + "/healthz"), "the edges", deadline,
                 poll_s=0.5)
    with httpx.Client() as client:
        for part in parts:
            if part == "mlp":
                check_mlp(post(client, base_url + PROBES[part], mlp_body(1), deadline), 1)
            else:
                check_minilm(post(client, base_url + PROBES[part], minilm_body(1),
                                  deadline), 1)
    return base_url


def mlp_body(b: int) -> bytes:
    """An OIP v2 request with ``b`` rows of the seed MLP's input."""
    data = [round(((i * 37) % 101) / 101.0, 4) for i in range(b * IN_FEATURES)]
    body = {"inputs": [{"name": "INPUT", "shape": [b, IN_FEATURES], "datatype": "FP32",
                        "data": data}]}
    return json.dumps(body).encode()


def check_mlp(reply: Any, b: int) -> None:
    shape = reply["outputs"][0]["shape"]
    if shape != [b, OUT_FEATURES]:
        raise RuntimeError(f"MLP reply shape {shape}, expected {[b, OUT_FEATURES]}")


def minilm_body(b: int, start: int = 0) -> bytes:
    """A JSON array of ``b`` short texts."""
    return json.dumps([TEXTS[(start + i) % len(TEXTS)] for i in range(b)]).encode()


def check_minilm(reply: Any, b: int) -> None:
    if len(reply) != b or len(reply[0]["embedding"]) != DIMENSIONS:
        raise RuntimeError(f"MiniLM reply of {len(reply)} items, expected {b}")


def post(client: httpx.Client, url: str, body: bytes, deadline: h.Deadline) -> Any:
    """One POST of a JSON body; the parsed reply of a 200, else an error."""
    reply = client.post(url, content=body, headers=JSON_HEADERS, timeout=deadline.timeout())
    if reply.status_code != 200:
        raise RuntimeError(f"POST {url} -> {reply.status_code}: {reply.text[:300]}")
    return reply.json()
