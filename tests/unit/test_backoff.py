"""The idle pollers' period: fast on change, doubling while still, capped; and when an idle
handle's queue report is worth sending."""

from ember.control.backoff import idle_push_due, next_interval_s


def test_the_period_doubles_while_nothing_changes_up_to_the_cap() -> None:
    period, seen = 0.2, []
    for _ in range(5):
        period = next_interval_s(period, changed=False, fast_s=0.2, slow_s=1.0)
        seen.append(period)
    assert seen == [0.4, 0.8, 1.0, 1.0, 1.0]


def test_a_change_brings_the_period_back_to_fast_at_once() -> None:
    assert next_interval_s(1.0, changed=True, fast_s=0.2, slow_s=1.0) == 0.2


def test_a_period_below_fast_is_raised_to_it() -> None:
    assert next_interval_s(0.01, changed=False, fast_s=0.5, slow_s=4.0) == 0.5


def _sent(ticks: list[bool], *, tick_s: float = 0.25, keepalive_s: float = 4.0) -> list[int]:
    """The ticks (one per metrics interval, idle or not) whose report goes."""
    sent, last = [], None
    for index, idle in enumerate(ticks):
        now = index * tick_s
        if last is None or idle_push_due(idle=idle, idle_when_pushed=last[1],
                                         since_push_s=now - last[0], keepalive_s=keepalive_s):
            sent.append(index)
            last = (now, idle)
    return sent


def test_an_idle_handle_reports_once_then_every_keepalive() -> None:
    assert _sent([True] * 40) == [0, 16, 32]  # 0 s, 4 s, 8 s


def test_a_busy_handle_reports_every_tick() -> None:
    assert _sent([False] * 6) == [0, 1, 2, 3, 4, 5]


def test_a_request_after_quiet_goes_at_once_and_so_does_the_first_idle_report_after_it() -> None:
    # Idle 1 s, busy for two ticks, idle again: the busy ticks and the first idle one go.
    assert _sent([True] * 4 + [False] * 2 + [True] * 4) == [0, 4, 5, 6]
