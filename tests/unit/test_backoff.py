"""The idle pollers' period: fast on change, doubling while still, capped."""

from ember.control.backoff import next_interval_s


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
