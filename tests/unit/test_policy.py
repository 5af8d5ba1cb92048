"""The autoscaling policy as a pure function, driven by a fake clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ember.control.policy import PolicyContext, clamp, decide, demand


@dataclass
class FakeDeployment:
    """Feeds decisions back in as Ray's controller would, on a clock the test moves."""

    floor: int = 0
    max_replicas: int = 8
    target_queue_depth: float = 2.0
    scaledown_after_s: float = 30.0
    now_s: float = 0.0
    replicas: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    history: list[int] = field(default_factory=list)

    def tick(self, total_requests: float, dt_s: float = 0.1) -> int:
        self.now_s += dt_s
        decision = decide(PolicyContext(
            now_s=self.now_s, target_replicas=self.replicas, total_requests=total_requests,
            floor=self.floor, max_replicas=self.max_replicas,
            target_queue_depth=self.target_queue_depth,
            scaledown_after_s=self.scaledown_after_s, state=self.state))
        self.replicas, self.state = decision.replicas, decision.state
        self.history.append(self.replicas)
        return self.replicas


@pytest.mark.parametrize(("total", "target", "expected"),
                         [(0, 2, 0), (1, 2, 1), (2, 2, 1), (3, 2, 2), (20, 2, 10), (4, 2.0, 2)])
def test_demand_is_ceil_of_queue_over_target(total: float, target: float, expected: int) -> None:
    assert demand(total, target) == expected


def test_clamp_respects_floor_and_cap() -> None:
    assert clamp(0, 1, 4) == 1
    assert clamp(9, 0, 4) == 4
    assert clamp(3, 6, 4) == 4  # a floor above the cap is capped


def test_from_zero_starts_what_the_queue_needs_in_one_decision() -> None:
    dep = FakeDeployment(max_replicas=16, target_queue_depth=4)
    assert dep.tick(total_requests=20) == 5
    assert dep.history == [5]


def test_from_zero_is_capped_by_max_replicas() -> None:
    dep = FakeDeployment(max_replicas=3)
    assert dep.tick(total_requests=100) == 3


def test_scale_to_zero_only_after_quiet_window() -> None:
    dep = FakeDeployment(scaledown_after_s=10)
    dep.tick(total_requests=2)
    assert dep.replicas == 1
    for _ in range(99):  # 9.9 s of silence
        dep.tick(total_requests=0)
    assert dep.replicas == 1
    dep.tick(total_requests=0, dt_s=0.5)
    assert dep.replicas == 0


def test_never_below_floor() -> None:
    dep = FakeDeployment(floor=2, scaledown_after_s=1)
    for _ in range(100):
        dep.tick(total_requests=0)
    assert set(dep.history) == {2}


def test_below_floor_goes_to_floor_at_once() -> None:
    dep = FakeDeployment(floor=2, replicas=0)
    assert dep.tick(total_requests=0) == 2


def test_request_during_quiet_window_resets_it() -> None:
    dep = FakeDeployment(scaledown_after_s=5)
    dep.tick(total_requests=1)
    for _ in range(40):
        dep.tick(total_requests=0)
    dep.tick(total_requests=1)  # 4.1 s in: the window restarts
    for _ in range(40):
        dep.tick(total_requests=0)
    assert dep.replicas == 1


def test_steady_noisy_load_does_not_oscillate() -> None:
    dep = FakeDeployment(scaledown_after_s=3, target_queue_depth=2)
    loads = [7.9, 8.0, 6.5, 8.0, 7.2, 8.0] * 200  # 120 s around 4 replicas' worth
    for load in loads:
        dep.tick(total_requests=load)
    changes = sum(1 for a, b in zip(dep.history, dep.history[1:], strict=False) if a != b)
    assert dep.replicas == 4
    assert changes == 0


def test_scale_down_goes_to_window_peak_not_instant_demand() -> None:
    dep = FakeDeployment(scaledown_after_s=2, target_queue_depth=1, replicas=8)
    for i in range(30):  # 3 s where demand swings between 2 and 5
        dep.tick(total_requests=5 if i % 10 == 0 else 2)
    assert dep.replicas == 5


def test_scale_up_is_immediate_even_during_quiet_window() -> None:
    dep = FakeDeployment(scaledown_after_s=30, replicas=2)
    dep.tick(total_requests=0)
    assert dep.tick(total_requests=12) == 6


def test_a_replica_in_a_pre_started_worker_reports_no_start_or_import() -> None:
    from ember.control.coldstart import ReplicaTimeline, report

    # The worker existed (torch imported) 60 s before the request; Serve made it the
    # replica 0.4 s after the request arrived; setup took 0.1 s.
    timeline = ReplicaTimeline(process_started_at=40.0, imported_at=41.0, init_started_at=100.4,
                               setup_s=0.1, warmup_s=0.02)
    phases = report(100.0, 100.9, timeline, "replica").phases
    assert phases == pytest.approx({"queue": 0.4, "start": 0.0, "import": 0.0, "weights": 0.1,
                                    "warmup": 0.02})
