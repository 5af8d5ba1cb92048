"""The warm pool answers at zero replicas while the deployment's own replica starts."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from apps import pool
from serving import ServeApp
from support import deployment_status, every_edge_sees, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(pool.app) as base:
        yield base


def _phases(header: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in header.split(";"))


def _ask_at_zero(url: str, deployment: str, path: str, question: str) -> httpx.Response:
    """One request sent while ``deployment`` has no replica at all, as every edge sees it."""
    wait_for(lambda: every_edge_sees(url, deployment, 0), 30, what=f"{deployment} at zero")
    return httpx.post(f"{url}{path}", json={"question": question}, timeout=60)


def test_cold_request_is_served_by_the_pool_then_by_the_own_replica(url: str) -> None:
    first = _ask_at_zero(url, "SlowStart", "/slow-start", "abc")
    assert first.status_code == 200 and first.json()["answer"] == "cba"
    phases = _phases(first.headers["x-ember-cold-start"])
    assert phases["path"] == "pool"
    assert int(phases["weights"]) >= 250  # the pool ran setup() for this request
    assert int(phases["start"]) == 0 and int(phases["import"]) == 0
    # The request also woke the deployment: its own replica comes up and takes over.
    wait_for(lambda: deployment_status(url, "SlowStart")["replicas_running"] == 1, 60,
             what="the deployment's own replica")
    later = wait_for(lambda: _served_by_other(url, first.json()["pid"]), 30,
                     what="traffic to move to the deployment's replica")
    assert "x-ember-cold-start" not in later.headers
    status = deployment_status(url, "SlowStart")
    assert status["last_cold_start"]["path"] == "pool"


def _served_by_other(url: str, pool_pid: int) -> httpx.Response | None:
    reply = httpx.post(f"{url}/slow-start", json={"question": "x"}, timeout=30)
    return reply if reply.json()["pid"] != pool_pid else None


def test_preloaded_deployment_runs_no_setup_on_its_first_request(url: str) -> None:
    reply = _ask_at_zero(url, "Preloaded", "/preloaded", "hi")
    assert reply.json()["answer"] == "HI"
    phases = _phases(reply.headers["x-ember-cold-start"])
    assert phases["path"] == "pool" and phases["weights"] == "0"


def test_cold_start_phases_are_exported(url: str) -> None:
    reply = _ask_at_zero(url, "SlowStart", "/slow-start", "xyz")
    assert _phases(reply.headers["x-ember-cold-start"])["path"] == "pool"

    def weights_phases() -> float:
        """Pool-path weights phases of SlowStart counted in one scrape, over every edge."""
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples
                   if sample.name == "ember_cold_start_phase_seconds_count"
                   and sample.labels.get("deployment") == "SlowStart"
                   and sample.labels.get("path") == "pool"
                   and sample.labels.get("phase") == "weights")

    # The edge that answered publishes its metrics within about a second.
    wait_for(weights_phases, 15, what="the pool's weights phase in a scrape")
