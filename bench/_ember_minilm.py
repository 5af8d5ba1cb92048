"""The flagship MiniLM app as the request-path benchmark's Ember contender serves it.

``bench/throughput.py`` runs ``ember run _ember_minilm:app`` as a subprocess (its own
embedded cluster, Ember's defaults). The deployment is ``ember.deployments.embeddings``'s
``MiniLM`` with its shipped options, changed only where every contender is set alike: the
batch (at most 32 texts, 5 ms wait, as the Ray Serve contenders' ``@serve.batch``), one
replica that stays up (``warm_floor=1``, ``max_replicas=1``) and ``BENCH_TORCH_THREADS``
torch threads. ``GET /embed/stats`` counts forward passes, texts and squared batch sizes,
as ``bench/_rayserve_minilm.py`` does.
"""

from __future__ import annotations

import os

import torch

import ember
from ember.app.decorator import get_spec
from ember.deployments.embeddings import Embedding, MiniLM

BATCH = ember.Batch(max_size=32, max_wait_ms=5)


def _options() -> dict[str, object]:
    shipped = get_spec(MiniLM).options
    # Only the options the decorator set: passing a default names it as set, and options that
    # apply only beside another (prefix_max_queue_gap with router='prefix') are then refused.
    options = {key: getattr(shipped, key) for key in shipped.model_fields_set}
    options.update(batch=BATCH, warm_floor=1, max_replicas=1)
    return options


@ember.deployment(**_options())  # type: ignore[call-overload]  # the shipped options, as kwargs
class MiniLMCounted(MiniLM):
    """The flagship, counting the batches its handler runs."""

    counts = {"calls": 0, "items": 0, "items_sq": 0}

    def setup(self) -> None:
        torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "1")))
        self.counts = {"calls": 0, "items": 0, "items_sq": 0}
        super().setup()

    def __call__(self, texts: list[str]) -> list[Embedding]:
        n = len(texts)
        self.counts["calls"] += 1
        self.counts["items"] += n
        self.counts["items_sq"] += n * n
        return super().__call__(texts)

    @ember.route("/embed/stats", method="GET")
    def stats(self) -> dict[str, int]:
        return dict(self.counts)


app = ember.App([MiniLMCounted], name="embeddings")
