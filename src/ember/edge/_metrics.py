"""Prometheus metrics exported by the edges at ``/metrics``.

Each edge owns a private registry so that tests and several apps in one process never
collide on metric names; :class:`EdgeBoard` merges the edges' metrics for a scrape.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ember.control.edge_reports import EdgeReports

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_PHASE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32)
_COLD_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60)


class Metrics:
    """The metric families of one edge."""

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
            ["deployment", "route", "status", "version"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.rejected = Counter(
            "ember_requests_rejected_total",
            "Requests refused before or instead of reaching user code",
            ["deployment", "reason"],
            registry=r,
        )
        self.shadow = Counter(
            "ember_shadow_requests_total",
            "Requests copied to a candidate version, by how its answer compared",
            ["deployment", "version", "outcome"], registry=r,
        )
        self.shadow_latency_ratio = Histogram(
            "ember_shadow_latency_ratio", "Candidate's latency over the served request's",
            ["deployment", "version"], buckets=(0.25, 0.5, 0.8, 1, 1.25, 1.5, 2, 4, 8),
            registry=r,
        )
        self.shadow_distance = Histogram(
            "ember_shadow_distance", "Euclidean distance between candidate and served answers",
            ["deployment", "version"], buckets=(0, 1e-6, 1e-4, 1e-3, 0.01, 0.1, 1, 10),
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
            "Cold start phases: queue, start, import, weights, warmup, route (own replica), "
            "device (GPU pool)",
            ["deployment", "phase", "path"],
            buckets=_PHASE_BUCKETS_S,
            registry=r,
        )

    def render(self) -> bytes:
        """Prometheus text exposition of every family."""
        return generate_latest(self.registry)


class EdgeBoard(EdgeReports):
    """Every edge's metrics and status in one answer: each edge publishes, any edge answers.

    The kernel spreads connections over the edges, so a scrape or a status call reaches one
    of them at random. Each edge publishes its exposition and its status to Ray's internal
    key-value store once a second while they change. ``/metrics`` merges the fresh
    expositions, every sample labelled with its ``edge``, as Prometheus labels per-instance
    series; ``/-/status`` adds up the edges' request counts. An edge silent for ``STALE_S``
    is dropped.
    """

    def render_all(self, own: bytes) -> bytes:
        """This edge's ``own`` exposition merged with every other edge's fresh one."""
        texts = {self.edge: own.decode(),
                 **{edge: str(value["text"]) for edge, value in self._others().items()}}
        merged: dict[str, Metric] = {}
        for edge, text in sorted(texts.items()):
            for family in text_string_to_metric_families(text):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation,
                                                             family.type))
                for sample in family.samples:
                    into.samples.append(sample._replace(labels={**sample.labels, "edge": edge}))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Fixed(list(merged.values())))
        return generate_latest(registry)

    def status_all(self, own: dict[str, Any]) -> dict[str, Any]:
        """This edge's ``own`` status with every other fresh edge's requests added in."""
        others = [value["status"] for value in self._others().values()]
        rows = {row["deployment"]: dict(row) for row in own["deployments"]}
        for status in others:
            for row in status.get("deployments", []):
                mine = rows.get(row.get("deployment"))
                if mine is not None:
                    _add_counts(mine, row)
        edges = {**own["edges"], "answering": 1 + len(others)}
        return {**own, "deployments": list(rows.values()), "edges": edges}

    def _others(self) -> dict[str, dict[str, Any]]:
        return {edge: value for edge, value in self.published().items() if edge != self.edge}


def _add_counts(mine: dict[str, Any], other: dict[str, Any]) -> None:
    """Add another edge's request counts to ``mine``; keep the latest cold start."""
    for key in ("ongoing", "queued", "cold_starts"):
        mine[key] = int(mine.get(key) or 0) + int(other.get(key) or 0)
    theirs = other.get("last_cold_start")
    if theirs and (not mine.get("last_cold_start")
                   or float(theirs["at"]) > float(mine["last_cold_start"]["at"])):
        mine["last_cold_start"] = theirs


class _Fixed(Collector):
    """A collector that yields families already built (the merged ones)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families
