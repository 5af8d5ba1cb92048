"""Online first: how much batch work a replica shared with online traffic may take.

Two pure functions decide, so they are tested with a fake clock and no cluster:

* :func:`offline_batch_size` caps one offline call so that an online request arriving
  while it runs waits at most ``budget_fraction`` of the latency budget behind it. An
  online request can always arrive mid-batch; a cap on the batch is the only bound on its
  wait that does not depend on predicting arrivals.
* :func:`should_yield` stops sending batch work while online requests are in flight or
  queued, and for ``resume_after_s`` after they were last seen, so batch work backfills
  quiet periods instead of flapping on every lull.

:class:`Throttle` holds the little state those decisions need (last busy time, the
measured cost per item) and takes its clock as an argument.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ember.offline._config import ShareOptions

#: Weight of the newest sample in the cost per item; old samples fade over ~5 calls.
_COST_SMOOTHING = 0.3


def offline_batch_size(online_queue_depth: int, measured_item_s: float | None,
                       latency_budget_s: float, max_batch: int, *,
                       budget_fraction: float = 0.5) -> int:
    """The largest offline batch a shared replica may take now.

    The budget share is divided among the online requests already waiting, since each of
    them may wait for the batch. With no measurement yet, one item is sent to measure it.
    The answer is never below 1: an item that alone costs more than the budget still has
    to run once, when online traffic is quiet.

    Args:
        online_queue_depth: Online requests ongoing + queued on the deployment.
        measured_item_s: Seconds per item of recent offline calls, or None.
        latency_budget_s: Longest an online request may wait behind one batch.
        max_batch: Upper bound (the job's batch size).
        budget_fraction: Share of the budget a batch may use.

    Returns:
        A batch size between 1 and ``max_batch``.

    Raises:
        ValueError: when ``max_batch`` is below 1.

    Example:
        >>> offline_batch_size(0, 0.01, latency_budget_s=0.5, max_batch=256)
        25
        >>> offline_batch_size(4, 0.01, latency_budget_s=0.5, max_batch=256)
        5
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    if measured_item_s is None or measured_item_s <= 0:
        return 1
    allowed_s = latency_budget_s * budget_fraction / (1 + max(0, online_queue_depth))
    return max(1, min(max_batch, math.floor(allowed_s / measured_item_s + 1e-9)))


@dataclass(frozen=True)
class YieldContext:
    """What :func:`should_yield` looks at.

    Attributes:
        now_s: Current time (any monotonic clock).
        online_depth: Online ongoing + queued requests, or None when the status is unknown.
        max_online_depth: Depth above which batch work waits.
        last_busy_s: When the depth was last seen above ``max_online_depth``, if ever.
        resume_after_s: Quiet time required after that before batch work goes on.
    """

    now_s: float
    online_depth: int | None
    max_online_depth: int
    last_busy_s: float | None
    resume_after_s: float


def should_yield(ctx: YieldContext) -> bool:
    """Whether batch work should wait now.

    An unknown status counts as busy: online first means not guessing that it is idle.

    Example:
        >>> should_yield(YieldContext(now_s=10.0, online_depth=0, max_online_depth=0,
        ...                           last_busy_s=9.8, resume_after_s=0.5))
        True
    """
    if ctx.online_depth is None or ctx.online_depth > ctx.max_online_depth:
        return True
    return ctx.last_busy_s is not None and ctx.now_s - ctx.last_busy_s < ctx.resume_after_s


class Throttle:
    """The state behind the two decisions: status samples, busy times, cost per item.

    Args:
        options: Budget and thresholds.
        clock: Seconds from a monotonic clock; tests pass a fake one.

    Example:
        >>> t = Throttle(ShareOptions(url="http://x", resume_after_s=0), clock=lambda: 0.0)
        >>> t.observe(0); t.next_batch_size(64)
        1
        >>> t.record(items=1, seconds=0.01); t.next_batch_size(64)
        25
    """

    def __init__(self, options: ShareOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self._clock = clock
        self._depth: int | None = None
        self._last_busy_s: float | None = None
        self.item_s: float | None = None
        self.yields = 0

    def observe(self, online_depth: int | None) -> None:
        """Take a status sample (None when the status could not be read)."""
        self._depth = online_depth
        if online_depth is None or online_depth > self.options.max_online_depth:
            self._last_busy_s = self._clock()

    def record(self, items: int, seconds: float) -> None:
        """Take the duration of an offline call of ``items`` items."""
        if items <= 0:
            return
        sample = seconds / items
        self.item_s = sample if self.item_s is None else (
            _COST_SMOOTHING * sample + (1 - _COST_SMOOTHING) * self.item_s)

    def next_batch_size(self, max_batch: int) -> int:
        """Items to send now, or 0 to wait."""
        ctx = YieldContext(now_s=self._clock(), online_depth=self._depth,
                           max_online_depth=self.options.max_online_depth,
                           last_busy_s=self._last_busy_s,
                           resume_after_s=self.options.resume_after_s)
        if should_yield(ctx):
            self.yields += 1
            return 0
        return offline_batch_size(self._depth or 0, self.item_s, self.options.latency_budget_s,
                                  max_batch, budget_fraction=self.options.budget_fraction)
