"""Warm floors beyond a constant: leases ("warm for 10 minutes") and schedules.

The floor a deployment's policy respects at any moment is the largest of its constant
``warm_floor``, any unexpired lease, and its schedule. Everything here is a pure function
of the clock except :class:`LeaseStore`, which keeps leases in Ray's cluster-wide key-value
store so that the edges (which grant them) and the controller (whose policy reads them)
agree without a new service.

Example:
    >>> from datetime import datetime, timezone
    >>> windows = parse_schedule(["Mon-Fri 08:00-20:00"])
    >>> scheduled_floor(datetime(2026, 11, 23, 9, 0, tzinfo=timezone.utc), windows, 1)
    1
    >>> scheduled_floor(datetime(2026, 11, 22, 9, 0, tzinfo=timezone.utc), windows, 1)
    0
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import time as clock_time
from typing import Any
from zoneinfo import ZoneInfo

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_WINDOW = re.compile(r"^(?P<days>[A-Za-z]{3}(?:-[A-Za-z]{3})?(?:,[A-Za-z]{3}(?:-[A-Za-z]{3})?)*)"
                     r"\s+(?P<start>\d{2}:\d{2})-(?P<end>\d{2}:\d{2})$")
_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<unit>s|m|h|d)?$")
MAX_LEASE_S = 7 * 24 * 3600.0


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


def scheduled_floor(now: datetime, windows: list[Window], floor: int) -> int:
    """``floor`` while ``now`` is inside any window, else 0."""
    return floor if any(w.contains(now) for w in windows) else 0


def leased_floor(now_s: float, lease: dict[str, Any] | None) -> int:
    """The floor an unexpired lease (``{"floor", "until_s"}``) holds, else 0."""
    if not lease or float(lease.get("until_s", 0)) <= now_s:
        return 0
    return max(0, int(lease.get("floor", 0)))


def parse_duration(text: str) -> float:
    """``600``, ``90s``, ``10m``, ``2h`` or ``1d`` as seconds.

    Raises:
        ValueError: if it does not parse or is outside (0, 7 days].
    """
    match = _DURATION.match(text.strip())
    if match is None:
        raise ValueError(f"duration {text!r} must look like 600, 90s, 10m, 2h or 1d")
    seconds = float(match["n"]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match["unit"] or "s"]
    if not 0 < seconds <= MAX_LEASE_S:
        raise ValueError(f"duration must be more than 0 and at most 7 days, got {text!r}")
    return seconds


def now_in(timezone_name: str, now_s: float | None = None) -> datetime:
    """The wall clock in ``timezone_name`` (schedules are written in local time)."""
    return datetime.fromtimestamp(time.time() if now_s is None else now_s,
                                  tz=ZoneInfo(timezone_name))


class LeaseStore:
    """Leases in Ray's internal key-value store, one key per app and deployment."""

    NAMESPACE = "ember"

    def __init__(self, app: str) -> None:
        self.app = app

    def _key(self, deployment: str) -> str:
        return f"lease:{self.app}:{deployment}"

    def put(self, deployment: str, floor: int, until_s: float) -> None:
        from ray.experimental import internal_kv

        value = json.dumps({"floor": floor, "until_s": until_s}).encode()
        internal_kv._internal_kv_put(self._key(deployment), value, overwrite=True,
                                     namespace=self.NAMESPACE)

    def get(self, deployment: str) -> dict[str, Any] | None:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(self._key(deployment), namespace=self.NAMESPACE)
        if not raw:
            return None
        try:
            value = json.loads(raw)
        except ValueError:  # a foreign or damaged value: no lease rather than a crash
            return None
        return value if isinstance(value, dict) else None

    def delete(self, deployment: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self._key(deployment), namespace=self.NAMESPACE)
