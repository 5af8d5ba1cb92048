"""The cold-start report's ``route`` phase: from the new replica's ready to the edge's router
having it, measured on the own-replica path only."""

from __future__ import annotations

import pytest

from ember.control.coldstart import ReplicaTimeline, report


def _timeline(**marks: float | bool) -> ReplicaTimeline:
    base: dict[str, float | bool] = {"process_started_at": 1.0, "imported_at": 2.0,
                                     "init_started_at": 3.0, "setup_s": 0.5, "ready_at": 3.6}
    return ReplicaTimeline(**{**base, **marks})  # type: ignore[arg-type]


def test_route_runs_from_the_replicas_ready_to_the_router_having_it() -> None:
    cold = report(0.5, 4.2, _timeline(), "replica", placed_at=3.75)
    assert cold.phases["route"] == pytest.approx(0.15)
    assert cold.header().endswith(";route=150")


def test_a_request_that_arrived_after_ready_counts_route_from_its_arrival() -> None:
    late = report(3.7, 4.2, _timeline(init_started_at=3.0), "replica", placed_at=3.75)
    assert late.phases["route"] == pytest.approx(0.05)


@pytest.mark.parametrize(("path", "placed_at", "marks"), [
    ("replica", None, {}),  # the router's view could not be read
    ("replica", 3.75, {"ready_at": 0.0}),  # a replica that never said when it was ready
    ("pool", 3.75, {}),  # the pool served it: no route to a new replica
    ("replica", 3.75, {"prewarmed": True}),
])
def test_route_is_left_out_where_it_was_not_measured(
        path: str, placed_at: float | None, marks: dict[str, float | bool]) -> None:
    cold = report(0.5, 4.2, _timeline(**marks), path, placed_at=placed_at)
    assert "route" not in cold.phases and "route=" not in cold.header()
