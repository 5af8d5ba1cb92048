"""The rollout policy with a fake clock and made-up edge counters: no cluster."""

from __future__ import annotations

import pytest

from ember.control import rollout as ro
from ember.control.rollout import Rollout, RolloutSpec, Tally
from ember.errors import BadRequest

SPEC = RolloutSpec("Embed", to="2", stable="1", steps=(5, 25, 50, 100), every_s=60,
                   max_error_rate=0.01, max_p99_ratio=1.5, min_requests=20)


def tally(requests: int, errors: int = 0, p99_s: float = 0.01) -> Tally:
    """``requests`` all at ``p99_s`` or under: half in the bucket below, half in it."""
    return Tally(requests, errors, ((p99_s / 2, requests / 2), (p99_s, float(requests))))


class Edges:
    """Cumulative counters of one edge, added to as requests are 'served'."""

    def __init__(self) -> None:
        self.seen: dict[str, Tally] = {}

    def serve(self, version: str, more: Tally) -> ro.Counts:
        self.seen[version] = self.seen.get(version, Tally()).plus(more)
        return {"edge-a": dict(self.seen)}


def begun(running: dict[str, int] | None = None) -> tuple[Rollout, ro.Change]:
    return ro.start(SPEC, max_replicas=4, now=0.0, running=running or {"1": 2, "2": 0})


def held_first_step(edges: Edges) -> Rollout:
    rollout, _ = begun()
    rollout, change = ro.tick(rollout, 1.0, edges.serve("1", Tally()), {"1": 2, "2": 1})
    assert change.weights == {"1": 95, "2": 5} and rollout.phase == "holding"
    return rollout


def test_start_wakes_the_candidate_with_a_floor_sized_for_its_first_share() -> None:
    rollout, change = begun({"1": 30, "2": 0})
    # 5% of the 30 replicas the group runs: ceil(1.5) = 2, before any traffic moves.
    assert change == ro.Change(floor=2) and change.weights is None
    assert rollout.phase == "waking" and rollout.share == 0


def test_no_traffic_moves_until_the_candidate_runs_the_floor_then_the_step_holds() -> None:
    rollout, _ = begun({"1": 30, "2": 0})
    waiting, change = ro.tick(rollout, 5.0, {}, {"1": 30, "2": 1})
    assert change == ro.Change() and waiting.phase == "waking"
    holding, change = ro.tick(waiting, 6.0, {}, {"1": 30, "2": 2})
    assert change.weights == {"1": 95, "2": 5}
    assert (holding.phase, holding.step, holding.share, holding.phase_started_s) == (
        "holding", 0, 5, 6.0)


def test_a_candidate_that_never_wakes_fails_the_rollout_and_leaves_stable_whole() -> None:
    rollout, _ = begun()
    failed, change = ro.tick(rollout, ro.WAKE_TIMEOUT_S + 1, {}, {"1": 2, "2": 0})
    assert failed.state == "failed" and "0 of 1 replicas running" in failed.reason
    assert change == ro.Change(weights={"1": 100, "2": 0}, floor=0)


def test_a_healthy_candidate_walks_every_step_and_succeeds() -> None:
    edges = Edges()
    rollout = held_first_step(edges)
    now, shares = 1.0, []
    while rollout.state == "running":
        now += 30.0
        counts = edges.serve("2", tally(50))
        counts = edges.serve("1", tally(500))
        rollout, change = ro.tick(rollout, now, counts, {"1": 2, "2": 4})
        if change.weights:
            shares.append(change.weights["2"])
    assert shares == [25, 50, 100]
    assert rollout.state == "succeeded" and rollout.share == 100
    assert change == ro.Change(floor=0)  # the lease ends; traffic stays on the candidate


def test_the_step_advances_only_after_every_s() -> None:
    edges = Edges()
    rollout = held_first_step(edges)
    early, change = ro.tick(rollout, 60.9, edges.serve("2", tally(50)), {"1": 2, "2": 1})
    assert change == ro.Change() and early.step == 0
    waking, change = ro.tick(early, 61.0, edges.serve("2", tally(1)), {"1": 2, "2": 1})
    assert waking.phase == "waking" and change.floor == 1  # ceil(3 * 0.25) = 1


def test_a_candidate_failing_30_percent_is_rolled_back_within_its_step() -> None:
    edges = Edges()
    rollout = held_first_step(edges)
    edges.serve("1", tally(400))
    failed, change = ro.tick(rollout, 10.0, edges.serve("2", tally(20, errors=6)),
                             {"1": 2, "2": 1})
    assert failed.state == "failed" and failed.share == 0
    assert change == ro.Change(weights={"1": 100, "2": 0}, floor=0)
    assert failed.reason == "v2 answered 30.0% of 20 requests with 5xx, over v1's 0.0% + 1.0%"


def test_errors_are_judged_against_stable_not_against_zero() -> None:
    edges = Edges()
    rollout = held_first_step(edges)
    edges.serve("1", tally(1000, errors=50))  # stable itself fails 5%
    held, _ = ro.tick(rollout, 10.0, edges.serve("2", tally(100, errors=5)), {"1": 2, "2": 1})
    assert held.state == "running"
    failed, _ = ro.tick(held, 11.0, edges.serve("2", tally(100, errors=10)), {"1": 2, "2": 1})
    assert failed.state == "failed"  # 15 of 200 = 7.5% > 5% + 1%


def test_too_few_requests_are_not_judged() -> None:
    edges = Edges()
    rollout = held_first_step(edges)
    edges.serve("1", tally(400))
    held, change = ro.tick(rollout, 10.0, edges.serve("2", tally(19, errors=19)),
                           {"1": 2, "2": 1})
    assert held.state == "running" and change == ro.Change()


def test_a_slow_candidate_is_rolled_back_on_its_p99_over_the_whole_step() -> None:
    edges = Edges()
    rollout = held_first_step(edges)
    edges.serve("1", tally(400, p99_s=0.010))
    held, _ = ro.tick(rollout, 10.0, edges.serve("2", tally(100, p99_s=0.020)),
                      {"1": 2, "2": 1})
    assert held.state == "running"  # the p99 waits for the step's end
    slow, _ = ro.tick(held, 61.0, edges.serve("2", tally(0)), {"1": 2, "2": 1})
    assert slow.state == "failed" and "p99 of 19.8 ms is over 1.5x v1's 9.9 ms" in slow.reason


def test_a_p99_from_fewer_than_100_requests_is_not_judged() -> None:
    edges = Edges()
    rollout = held_first_step(edges)
    edges.serve("1", tally(400, p99_s=0.010))
    moved, _ = ro.tick(rollout, 61.0, edges.serve("2", tally(99, p99_s=0.050)),
                       {"1": 2, "2": 1})
    assert moved.state == "running" and moved.phase == "waking"


def test_at_100_percent_the_candidate_is_judged_against_stable_since_the_start() -> None:
    edges = Edges()
    rollout = held_first_step(edges)
    edges.serve("1", tally(400, p99_s=0.010))
    last = Rollout.from_json({**rollout.as_json(), "step": 3})  # holding 100%: no stable now
    last = ro.tick(last, 2.0, edges.serve("2", tally(0)), {"2": 2})[0]
    failed, _ = ro.tick(last, 63.0, edges.serve("2", tally(100, p99_s=0.030)), {"2": 2})
    assert failed.state == "failed" and "v1's 9.9 ms" in failed.reason


def test_an_edge_that_restarts_counts_from_zero_without_negative_windows() -> None:
    before = {"edge-a": {"2": Tally(100, 10, ((0.01, 100.0),))}}
    after = {"edge-a": {"2": Tally(30, 0, ((0.01, 30.0),))}, "edge-b": {"2": Tally(5, 1)}}
    assert ro.window(after, before)["2"].requests == 35
    assert ro.window(after, before)["2"].errors == 1


def test_the_p99_interpolates_within_its_bucket() -> None:
    t = Tally(200, 0, ((0.005, 100.0), (0.01, 180.0), (0.025, 200.0)))
    # Rank 198 lies 18 of 20 into (0.01, 0.025].
    assert t.quantile(0.99) == pytest.approx(0.01 + 0.015 * 18 / 20)
    assert Tally(10, 0, ((0.005, 5.0),)).quantile(0.99) == 0.005  # beyond the finite bounds


def test_a_rollout_survives_its_json_round_trip() -> None:
    edges = Edges()
    rollout = held_first_step(edges)
    rollout = ro.tick(rollout, 5.0, edges.serve("2", tally(7)), {"1": 2, "2": 1})[0]
    assert Rollout.from_json(rollout.as_json()) == rollout


def test_the_operator_rolls_back() -> None:
    rollout = held_first_step(Edges())
    back, change = ro.end(rollout, 9.0, "rolled_back", "rolled back by the operator")
    assert back.state == "rolled_back" and change.weights == {"1": 100, "2": 0}
    assert back.history[-1] == "9.0s rolled back: rolled back by the operator"


@pytest.mark.parametrize(("body", "param"), [
    ({"to": "3"}, "to"),
    ({"to": "2", "steps": [5, 25, 50]}, "steps"),
    ({"to": "2", "steps": [25, 5, 100]}, "steps"),
    ({"to": "2", "steps": [0, 100]}, "steps"),
    ({"to": "2", "steps": [5.5, 100]}, "steps"),
    ({"to": "2", "steps": []}, "steps"),
    ({"to": "2", "every_s": 0}, "every_s"),
    ({"to": "2", "every_s": "60"}, "every_s"),
    ({"to": "2", "max_error_rate": -0.1}, "max_error_rate"),
    ({"to": "2", "max_p99_ratio": 0.5}, "max_p99_ratio"),
    ({"to": "2", "min_requests": 2.5}, "min_requests"),
    ({"to": "2", "stepz": [100]}, "stepz"),
    (["2"], "body"),
])
def test_bad_rollouts_are_refused_naming_the_field(body: object, param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        ro.parse_rollout("Embed", ["1", "2"], {"1": 100, "2": 0}, body)
    assert caught.value.fields["param"] == param


def test_stable_is_the_version_with_the_most_traffic_now() -> None:
    spec = ro.parse_rollout("Embed", ["1", "2", "3"], {"1": 10, "2": 90, "3": 0},
                            {"to": "3", "steps": [50, 100], "every_s": 5})
    assert (spec.stable, spec.to, spec.steps, spec.every_s) == ("2", "3", (50, 100), 5.0)
