"""Warm floors by schedule and lease: pure functions, fake clocks."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from ember.app import schedule
from ember.cli.serve import plan_rows
from ember.control import floors
from ember.control.ray_policy import EmberAutoscalingPolicy

UTC = UTC


def _at(day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 11, day, hour, minute, tzinfo=UTC)  # 2026-11-23 is a Monday


@pytest.mark.parametrize(("moment", "expected"), [
    (_at(23, 8), 1), (_at(23, 19, 59), 1), (_at(23, 20), 0), (_at(23, 7, 59), 0),
    (_at(27, 12), 1), (_at(28, 12), 0), (_at(22, 12), 0)])
def test_weekday_window(moment: datetime, expected: int) -> None:
    windows = schedule.parse_schedule(["Mon-Fri 08:00-20:00"])
    assert floors.scheduled_floor(moment, windows, 1) == expected


def test_overnight_window_belongs_to_the_day_it_starts() -> None:
    windows = schedule.parse_schedule(["Fri 22:00-06:00"])
    assert floors.scheduled_floor(_at(27, 23), windows, 2) == 2   # Friday night
    assert floors.scheduled_floor(_at(28, 5), windows, 2) == 2    # Saturday early morning
    assert floors.scheduled_floor(_at(28, 7), windows, 2) == 0
    assert floors.scheduled_floor(_at(23, 5), windows, 2) == 0    # Monday early: not after Fri


def test_day_lists_and_wraparound_ranges() -> None:
    windows = schedule.parse_schedule(["Sat-Mon 10:00-11:00", "Wed 10:00-11:00"])
    days = {moment.weekday() for moment in (_at(d, 10, 30) for d in range(22, 29))
            if floors.scheduled_floor(moment, windows, 1)}
    assert days == {5, 6, 0, 2}


@pytest.mark.parametrize("bad", ["Mon-Fri", "Funday 08:00-09:00", "Mon 25:00-26:00", "8-20"])
def test_bad_windows_are_refused_with_an_example(bad: str) -> None:
    with pytest.raises(ValueError, match=r"Mon-Fri 08:00-20:00|unknown day|bad time"):
        schedule.parse_schedule([bad])


def test_lease_holds_until_it_expires() -> None:
    lease = {"floor": 2, "until_s": 100.0}
    assert floors.leased_floor(99.9, lease) == 2
    assert floors.leased_floor(100.0, lease) == 0
    assert floors.leased_floor(0.0, None) == 0


@pytest.mark.parametrize(("text", "seconds"), [("600", 600), ("90s", 90), ("10m", 600),
                                               ("2h", 7200), ("1d", 86400), ("1.5m", 90)])
def test_durations(text: str, seconds: float) -> None:
    assert floors.parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["0", "-5", "ten minutes", "8d", ""])
def test_bad_durations(bad: str) -> None:
    with pytest.raises(ValueError):
        floors.parse_duration(bad)


def test_policy_floor_takes_the_highest_of_constant_lease_and_schedule() -> None:
    policy = EmberAutoscalingPolicy(scaledown_after_s=1, target_queue_depth=1,
                                    warm_schedule=["Mon-Sun 00:00-23:59"], scheduled_floor=3)
    ctx = SimpleNamespace(app_name=None, deployment_name="d", capacity_adjusted_min_replicas=1)
    assert policy.floor(ctx, 0.0) == 3
    ctx.capacity_adjusted_min_replicas = 5
    assert policy.floor(ctx, 0.0) == 5


def test_plan_flags_a_missed_budget_and_the_floor_that_fixes_it() -> None:
    status = {"deployments": [
        {"deployment": "a", "floor": 0, "cold_start_budget_s": 0.5,
         "last_cold_start": {"total_s": 4.2, "path": "replica"}},
        {"deployment": "b", "floor": 0, "cold_start_budget_s": 0.5,
         "last_cold_start": {"total_s": 0.2, "path": "pool"}},
        {"deployment": "c", "floor": 0, "cold_start_budget_s": None, "last_cold_start": None}]}
    rows = {r[0]: r for r in plan_rows(status)[1:]}
    assert rows["a"][3:] == ("misses", "warm_floor=1")
    assert rows["b"][3] == "meets"
    assert rows["c"][3] == "no budget"


class _LeaseInMemory(EmberAutoscalingPolicy):
    """The policy with its lease store replaced by a dict, to count and steer reads."""

    lease: dict[str, float] | None = None
    reads = 0

    def _read_lease(self, app: str, deployment: str) -> dict[str, float] | None:
        self.reads += 1
        return self.lease


def _tick(policy: EmberAutoscalingPolicy, now_s: float, target: int,
          state: dict[str, float]) -> tuple[int, dict[str, float]]:
    ctx = SimpleNamespace(app_name="a", deployment_name="d", deployment_id="a/d",
                          current_time=now_s,
                          target_num_replicas=target, total_num_requests=0.0,
                          capacity_adjusted_min_replicas=0, capacity_adjusted_max_replicas=4,
                          policy_state=state)
    return policy(ctx)


def test_a_lease_set_after_the_last_read_still_stops_the_scale_down_it_would_prevent() -> None:
    policy = _LeaseInMemory(scaledown_after_s=1.5, target_queue_depth=1)
    _, state = _tick(policy, 100.0, 1, {})                    # idle: the quiet window opens
    _, state = _tick(policy, 101.0, 1, state)                 # a second on: the lease is read
    assert policy.reads == 2
    policy.lease = {"floor": 1, "until_s": time.time() + 60}  # an operator's lease lands now
    replicas, _ = _tick(policy, 101.6, 1, state)              # the window has passed
    assert replicas == 1, "scaled to zero on a lease read before the lease was set"
    assert policy.reads == 3


def test_without_a_lease_the_quiet_window_still_scales_to_zero() -> None:
    policy = _LeaseInMemory(scaledown_after_s=1, target_queue_depth=1)
    _, state = _tick(policy, 100.0, 1, {})
    assert _tick(policy, 101.5, 1, state)[0] == 0
