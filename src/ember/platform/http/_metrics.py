"""Prometheus metrics exported by the ingress at ``/metrics``.

Each ingress replica owns a private registry so that tests and several apps in one
process never collide on metric names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_PHASE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32)
_COLD_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60)


class Metrics:
    """The metric families of one ingress."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.replicas = Gauge(
            "ember_replicas", "Replicas by state", ["deployment", "state"], registry=r
        )
        self.floor = Gauge("ember_warm_floor", "Current replica floor", ["deployment"], registry=r)
        self.ongoing = Gauge(
            "ember_requests_ongoing", "Requests being processed", ["deployment"], registry=r
        )
        self.queued = Gauge(
            "ember_requests_queued", "Requests waiting for a replica", ["deployment"], registry=r
        )
        self.latency = Histogram(
            "ember_request_duration_seconds",
            "End-to-end request latency at the ingress",
            ["deployment", "route", "status"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.rejected = Counter(
            "ember_requests_rejected_total",
            "Requests refused before or instead of reaching user code",
            ["deployment", "reason"],
            registry=r,
        )
        self.cold_starts = Counter(
            "ember_cold_starts_total", "Requests that met zero running replicas",
            ["deployment", "path"], registry=r,
        )
        self.cold_start_s = Histogram(
            "ember_cold_start_duration_seconds",
            "Request sent at zero replicas until its response",
            ["deployment", "path"],
            buckets=_COLD_BUCKETS_S,
            registry=r,
        )
        self.cold_start_phase_s = Histogram(
            "ember_cold_start_phase_seconds",
            "Cold start phases: queue, start, import, weights, warmup",
            ["deployment", "phase", "path"],
            buckets=_PHASE_BUCKETS_S,
            registry=r,
        )

    def render(self) -> bytes:
        """Prometheus text exposition of every family."""
        return generate_latest(self.registry)
