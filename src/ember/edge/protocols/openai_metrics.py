"""The generation metrics, named like vLLM's, and one request's timing observed into them.

Measured at the edge, so what the caller sees: queueing at the replica is inside the time
to first token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_TPS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)
_LOAD_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class GenerationMetrics:
    """The generation families, named like vLLM's, in the edge's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, labels = registry, ["model"]
        self.ttft = Histogram("ember_time_to_first_token_seconds",
                              "Request received until its first token left the replica",
                              labels, buckets=_TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("ember_inter_token_latency_seconds",
                             "Time between two consecutive tokens of one request",
                             labels, buckets=_ITL_BUCKETS_S, registry=r)
        self.tpot = Histogram("ember_time_per_output_token_seconds",
                              "A request's time after its first token over its other tokens",
                              labels, buckets=_ITL_BUCKETS_S, registry=r)
        self.tps = Histogram("ember_generation_tokens_per_second",
                             "A request's output tokens over its end-to-end time",
                             labels, buckets=_TPS_BUCKETS, registry=r)
        self.generated = Counter("ember_generation_tokens", "Output tokens", labels,
                                 registry=r)
        self.prompted = Counter("ember_prompt_tokens", "Prompt tokens", labels, registry=r)
        # Hit rate = ember_prefix_cache_hit_tokens_total / ember_prompt_tokens_total.
        self.cached = Counter("ember_prefix_cache_hit_tokens",
                              "Prompt tokens found in the replica's prefix cache", labels,
                              registry=r)
        self.running = Gauge("ember_num_requests_running",
                             "Sequences in the running batch, as last reported", labels,
                             registry=r)
        self.waiting = Gauge("ember_num_requests_waiting",
                             "Sequences waiting for a slot, as last reported", labels,
                             registry=r)
        self.adapter_load = Histogram("ember_lora_adapter_load_seconds",
                                      "A LoRA adapter's cold load on a replica (fetch, check, "
                                      "put into the model), met by the request it was for",
                                      labels, buckets=_LOAD_BUCKETS_S, registry=r)


@dataclass
class RequestTiming:
    """One request's token times, observed into the metrics as they come."""

    metrics: GenerationMetrics
    model: str
    n: int = 1
    started: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float = 0.0
    tokens: int = 0
    #: Output tokens of each choice so far, and the choices that finished.
    choices: dict[int, int] = field(default_factory=dict)
    finished: int = 0

    def chunk(self, chunk: dict[str, Any]) -> None:
        now = time.monotonic()
        self.choices[int(chunk.get("index", 0))] = int(chunk["completion_tokens"])
        tokens = sum(self.choices.values())
        if self.first is None:
            self.first = now
            self.metrics.ttft.labels(self.model).observe(now - self.started)
        elif tokens > self.tokens:
            # A chunk may carry several tokens (the replica merges what waited for a slow
            # stream); each counts once, with its share of the gap.
            new = tokens - self.tokens
            for _ in range(new):
                self.metrics.itl.labels(self.model).observe((now - self.last) / new)
        self.last, self.tokens = now, tokens
        self.metrics.running.labels(self.model).set(chunk["running"])
        self.metrics.waiting.labels(self.model).set(chunk["waiting"])
        self.finished += chunk["finish_reason"] is not None
        if chunk["finish_reason"] is not None and self.finished == self.n:
            self._finish(chunk)

    def _finish(self, chunk: dict[str, Any]) -> None:
        labels = (self.model,)
        if self.first is not None and self.tokens > 1:
            self.metrics.tpot.labels(*labels).observe((self.last - self.first)
                                                      / (self.tokens - 1))
        self.metrics.tps.labels(*labels).observe(self.tokens / max(self.last - self.started,
                                                                   1e-9))
        self.metrics.generated.labels(*labels).inc(self.tokens)
        self.metrics.prompted.labels(*labels).inc(int(chunk["prompt_tokens"]))
        self.metrics.cached.labels(*labels).inc(int(chunk.get("cached_tokens", 0)))
