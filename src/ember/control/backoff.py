"""How soon a background poller looks again: often while what it watches changes, seldom
while it stands still.

Ember's processes poll what Ray offers no push for: the edges read the server's phase and
the replica counts, the serving process counts its warm workers, the watchdog records the
process tree. A fixed fast period costs CPU on every node all day for an app that is idle
(``bench/idle_cpu.py`` measures it); a fixed slow one makes a change wait. Each poller
starts fast, goes back to fast on any change it sees, and doubles its period while nothing
changes, up to a cap that bounds how stale its view may grow.

Example:
    >>> next_interval_s(0.2, changed=False, fast_s=0.2, slow_s=1.0)
    0.4
    >>> next_interval_s(0.8, changed=False, fast_s=0.2, slow_s=1.0)
    1.0
    >>> next_interval_s(1.0, changed=True, fast_s=0.2, slow_s=1.0)
    0.2
"""

from __future__ import annotations


def next_interval_s(current_s: float, *, changed: bool, fast_s: float, slow_s: float) -> float:
    """``fast_s`` after a change; else twice ``current_s``, between ``fast_s`` and ``slow_s``."""
    if changed:
        return fast_s
    return min(slow_s, max(fast_s, 2.0 * current_s))


def idle_push_due(*, idle: bool, idle_when_pushed: bool, since_push_s: float,
                  keepalive_s: float) -> bool:
    """Whether a handle's periodic queue report should go to Serve's controller now.

    A handle reports its queue every ``metrics_interval_s`` (0.25 s for Ember's
    deployments, so queue-depth scaling reacts fast). While the handle is idle and its last
    report said so, another report of zeros tells the controller nothing new: it goes only
    every ``keepalive_s``, so the controller never drops the handle as silent. Any request,
    queued or running, and the first idle report after one, go at once.

    Example:
        >>> idle_push_due(idle=True, idle_when_pushed=True, since_push_s=1.0, keepalive_s=4.0)
        False
        >>> idle_push_due(idle=True, idle_when_pushed=False, since_push_s=0.25, keepalive_s=4.0)
        True
        >>> idle_push_due(idle=False, idle_when_pushed=True, since_push_s=0.25, keepalive_s=4.0)
        True
    """
    return not (idle and idle_when_pushed) or since_push_s >= keepalive_s
