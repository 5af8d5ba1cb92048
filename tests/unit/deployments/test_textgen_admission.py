"""The admission policy as a pure function of the waiting line and a fake clock."""

from __future__ import annotations

from ember.deployments._textgen_admission import (
    BATCH,
    EngineConfig,
    Need,
    Waiting,
    effective_priority,
    plan,
)

SMALL, BIG = Need(4, 12), Need(40, 60)


def admit(line: list[Waiting], now_s: float, *, running: int = 0, reserved: int = 0,
          **config: object) -> list[int]:
    cfg = EngineConfig.model_validate({"max_num_seqs": 1, **config})
    return plan(line, running=running, reserved=reserved, config=cfg, max_len=512,
                now_s=now_s).admit


def test_higher_priority_goes_first_and_equal_priorities_keep_their_order() -> None:
    line = [Waiting(SMALL, 0, arrived_s=0), Waiting(SMALL, 5, arrived_s=1),
            Waiting(SMALL, 5, arrived_s=2), Waiting(SMALL, -3, arrived_s=0)]
    assert admit(line, 2, max_num_seqs=4, priority_aging_s=0) == [1, 2, 0, 3]
    assert admit(line, 2, max_num_seqs=1, priority_aging_s=0) == [1]


def test_batch_is_below_every_number() -> None:
    line = [Waiting(SMALL, BATCH, arrived_s=0), Waiting(SMALL, -10, arrived_s=5)]
    assert admit(line, 5, priority_aging_s=0) == [1]


def test_aging_lifts_a_waiting_request_one_level_per_period_so_it_never_starves() -> None:
    old = Waiting(SMALL, 0, arrived_s=0)
    assert effective_priority(old, now_s=9.9, aging_s=2) == 4
    assert effective_priority(old, now_s=10, aging_s=2) == 5
    # A level-5 request arriving at t=10 still loses to one that waited since t=0 (tie: the
    # earlier one first); one arriving at t=9 would have passed it a second earlier.
    line = [old, Waiting(SMALL, 5, arrived_s=10)]
    assert admit(line, 10, priority_aging_s=2) == [0]
    assert admit(line, 9.9, priority_aging_s=2) == [1]
    assert admit(line, 10, priority_aging_s=0) == [1]  # without aging: priority alone
    assert effective_priority(Waiting(SMALL, BATCH, 0), now_s=22, aging_s=2) == 0


def test_backfill_admits_a_request_behind_a_head_that_does_not_fit() -> None:
    # 100 tokens of budget, 60 reserved: the head (100 tokens) waits, the small one fits.
    line = [Waiting(BIG, 5, arrived_s=0), Waiting(SMALL, 0, arrived_s=1)]
    decision = plan(line, running=1, reserved=60, config=EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=100, priority_aging_s=0), max_len=512, now_s=2)
    assert decision.admit == [1] and decision.blocked == 0


def test_backfill_stops_once_the_head_has_been_blocked_for_the_hold() -> None:
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=100, priority_aging_s=0,
                       backfill_hold_s=3)
    small = Waiting(SMALL, 0, arrived_s=1)

    def at(now_s: float) -> list[int]:
        head = Waiting(BIG, 5, arrived_s=0, blocked_since_s=2)
        return plan([head, small], running=1, reserved=60, config=cfg, max_len=512,
                    now_s=now_s).admit

    assert at(4.9) == [1]
    assert at(5) == []  # the capacity that frees up now goes to the head


def test_a_request_past_its_deadline_is_expired_never_admitted() -> None:
    line = [Waiting(SMALL, 0, arrived_s=0, deadline_s=1.0), Waiting(SMALL, 0, arrived_s=0.5)]
    decision = plan(line, running=0, reserved=0, config=EngineConfig(max_num_seqs=2),
                    max_len=512, now_s=1.0)
    assert decision.expire == [0] and decision.admit == [1]
    early = plan(line, running=0, reserved=0, config=EngineConfig(max_num_seqs=2),
                 max_len=512, now_s=0.99)
    assert early.expire == [] and early.admit == [0, 1]


def test_n_choices_need_n_slots_and_n_times_the_tokens() -> None:
    assert Need(10, 20, n=3).tokens == 90
    line = [Waiting(Need(4, 12, n=3), 0, arrived_s=0), Waiting(SMALL, 0, arrived_s=1)]
    assert admit(line, 1, max_num_seqs=3, priority_aging_s=0) == [0]
    assert admit(line, 1, running=1, max_num_seqs=3, priority_aging_s=0) == [1]  # backfill


def test_static_mode_admits_in_order_without_backfill() -> None:
    # Together A and B would run 400 + 400 tokens in a padded batch, over max_len (512): the
    # static batch stops at B and C, which would fit, does not pass it.
    line = [Waiting(Need(4, 400), 0, arrived_s=0), Waiting(Need(400, 4), 0, arrived_s=1),
            Waiting(SMALL, 0, arrived_s=2)]
    cfg = {"max_num_seqs": 3, "static_wait_s": 0, "priority_aging_s": 0}
    assert admit(line, 2, mode="static", **cfg) == [0]
    assert admit(line, 2, **cfg) == [0, 1, 2]
