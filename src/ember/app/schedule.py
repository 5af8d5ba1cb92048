"""Warm schedules: weekly windows such as ``"Mon-Fri 08:00-20:00"``, parsed and tested.

Declared with a deployment (``warm_schedule``) and checked when it is declared, so the parser
lives beside the options; the floor policy that applies a schedule is ``control/floors.py``.

Example:
    >>> from datetime import datetime
    >>> [w] = parse_schedule(["Mon-Fri 08:00-20:00"])
    >>> w.contains(datetime(2026, 11, 23, 9, 0))
    True
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import time as clock_time

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_WINDOW = re.compile(r"^(?P<days>[A-Za-z]{3}(?:-[A-Za-z]{3})?(?:,[A-Za-z]{3}(?:-[A-Za-z]{3})?)*)"
                     r"\s+(?P<start>\d{2}:\d{2})-(?P<end>\d{2}:\d{2})$")


@dataclass(frozen=True)
class Window:
    """Days of the week (0 = Monday) and a daily time range; the end may pass midnight."""

    days: frozenset[int]
    start: clock_time
    end: clock_time

    def contains(self, moment: datetime) -> bool:
        t = moment.timetz().replace(tzinfo=None)
        if self.start <= self.end:
            return moment.weekday() in self.days and self.start <= t < self.end
        # Overnight (22:00-06:00): the late part belongs to the listed day, the early part
        # to the morning after it.
        yesterday = (moment - timedelta(days=1)).weekday()
        return (moment.weekday() in self.days and t >= self.start) or (
            yesterday in self.days and t < self.end)


def parse_schedule(windows: list[str]) -> list[Window]:
    """Parse ``["Mon-Fri 08:00-20:00", "Sat 10:00-14:00"]``.

    Raises:
        ValueError: naming the window that does not parse.
    """
    return [_parse_window(w) for w in windows]


def _parse_window(text: str) -> Window:
    match = _WINDOW.match(text.strip())
    if match is None:
        raise ValueError(f"warm schedule window {text!r} must look like 'Mon-Fri 08:00-20:00'")
    days: set[int] = set()
    for part in match["days"].lower().split(","):
        first, _, last = part.partition("-")
        if first not in DAYS or (last and last not in DAYS):
            raise ValueError(f"unknown day in {text!r}; use {', '.join(d.title() for d in DAYS)}")
        lo, hi = DAYS.index(first), DAYS.index(last or first)
        days.update(range(lo, hi + 1) if lo <= hi else [*range(lo, 7), *range(0, hi + 1)])
    try:
        start = clock_time.fromisoformat(match["start"])
        end = clock_time.fromisoformat(match["end"])
    except ValueError:
        raise ValueError(f"bad time of day in {text!r}") from None
    return Window(frozenset(days), start, end)
