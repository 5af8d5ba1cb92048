"""What the rollout driver reads from the edges' published metrics and status: no cluster."""

from __future__ import annotations

from ember.edge._metrics import Metrics
from ember.edge.rollouts import counts_from, running_from


def _exposition(observations: list[tuple[str, str, str, float]]) -> str:
    metrics = Metrics()
    for deployment, status, version, seconds in observations:
        metrics.latency.labels(deployment, "/embed", status, version).observe(seconds)
    return metrics.render().decode()


def test_counts_add_routes_and_statuses_per_version_and_count_5xx_only() -> None:
    text = _exposition([("Embed@1", "200", "1", 0.004), ("Embed@1", "200", "1", 0.02),
                        ("Embed@2", "500", "2", 0.004), ("Embed@2", "400", "2", 0.004),
                        ("Embed@2", "200", "2", 0.2), ("Other", "500", "1", 0.004)])
    counts = counts_from({"edge-a": text, "edge-b": _exposition([])}, "Embed")
    assert set(counts) == {"edge-a", "edge-b"} and counts["edge-b"] == {}
    one, two = counts["edge-a"]["1"], counts["edge-a"]["2"]
    assert (one.requests, one.errors, two.requests, two.errors) == (2, 0, 3, 1)
    assert dict(two.buckets)[0.005] == 2 and dict(two.buckets)[0.25] == 3
    assert dict(one.buckets)[0.01] == 1 and dict(one.buckets)[0.025] == 2


def test_running_replicas_come_from_the_newest_edge_status() -> None:
    def status(at: float, running: int) -> dict[str, object]:
        rows = [{"deployment": "Embed@1", "group": "Embed", "version": "1",
                 "replicas_running": 2},
                {"deployment": "Embed@2", "group": "Embed", "version": "2",
                 "replicas_running": running},
                {"deployment": "Other", "group": "Other", "version": "1",
                 "replicas_running": 5}]
        return {"at": at, "status": {"deployments": rows}}

    assert running_from([status(10.0, 0), status(11.0, 3)], "Embed") == {"1": 2, "2": 3}
    assert running_from([], "Embed") == {}
