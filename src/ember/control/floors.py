"""Warm floors beyond a constant: leases ("warm for 10 minutes") and schedules.

The floor a deployment's policy respects at any moment is the largest of its constant
``warm_floor``, any unexpired lease, and its schedule. Everything here is a pure function
of the clock except :class:`LeaseStore`, which keeps leases in the app's durable store
(``store.py``) so that the edges (which grant them) and the controller (whose policy reads them)
agree without a new service.

Example:
    >>> from datetime import datetime, timezone
    >>> from ember.app.schedule import parse_schedule
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
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from ember.app.schedule import Window
from ember.control.store import open_store

_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<unit>s|m|h|d)?$")
MAX_LEASE_S = 7 * 24 * 3600.0


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
    """Leases in the app's durable store (``store.py``), one key per deployment."""

    def __init__(self, app: str) -> None:
        self.app = app

    def _key(self, deployment: str) -> str:
        return f"lease:{self.app}:{deployment}"

    def put(self, deployment: str, floor: int, until_s: float) -> None:
        value = json.dumps({"floor": floor, "until_s": until_s}).encode()
        open_store(self.app).put(self._key(deployment), value)

    def get(self, deployment: str) -> dict[str, Any] | None:
        raw = open_store(self.app).get(self._key(deployment))
        if not raw:
            return None
        try:
            value = json.loads(raw)
        except ValueError:  # a foreign or damaged value: no lease rather than a crash
            return None
        return value if isinstance(value, dict) else None

    def delete(self, deployment: str) -> None:
        open_store(self.app).delete(self._key(deployment))
