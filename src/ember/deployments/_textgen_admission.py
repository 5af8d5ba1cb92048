"""Which waiting requests join the running batch at a step: priorities, aging, backfill and
deadlines, as one pure function of the waiting line, the batch and the clock.

The order is by *effective* priority, highest first, then arrival: a request's priority
(``-10..10``, or :data:`BATCH` below all of them) plus one level for every
``priority_aging_s`` it has waited, so a low-priority request is overtaken for a while but
never forever. Requests are admitted in that order while they fit (a free slot for each of
their ``n`` choices, and their tokens within ``max_num_batched_tokens``). When the head of the
order does not fit, a request behind it that does fit may run first (backfill), but only
while the head has been blocked for less than ``backfill_hold_s``: after that nothing passes
it, so the capacity that frees up goes to it. A request whose deadline has passed is never
admitted; the engine answers it with 504 without computing anything.

``mode="static"`` (the baseline of the benchmark) admits whole batches in order, without
backfill, as a padded batch does.

Example:
    >>> cfg = EngineConfig(max_num_seqs=1)
    >>> low, high = Waiting(Need(4, 8), priority=0, arrived_s=0), Waiting(Need(4, 8), 5, 1)
    >>> plan([low, high], running=0, reserved=0, config=cfg, max_len=64, now_s=2).admit
    [1]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt

#: The lowest priority: ``X-Ember-Priority: batch``, work that fills spare capacity.
BATCH = -11
#: The priorities a caller may give as a number.
MIN_PRIORITY, MAX_PRIORITY = -10, 10


class EngineConfig(BaseModel):
    """Limits and admission policy of one engine (one replica)."""

    model_config = ConfigDict(frozen=True)
    max_num_seqs: PositiveInt = 16
    #: Tokens (prompt + max_tokens, per choice) all running sequences may reserve together.
    max_num_batched_tokens: PositiveInt = 8192
    #: Requests that may wait for a slot; one more is refused with 503 at once.
    max_waiting_seqs: NonNegativeInt = 64
    mode: Literal["continuous", "static"] = "continuous"
    static_wait_s: NonNegativeFloat = 0.05
    #: A waiting request gains one priority level per this many seconds (0: no aging).
    priority_aging_s: NonNegativeFloat = 2.0
    #: Once the head of the order has been blocked this long, nothing is admitted past it.
    backfill_hold_s: NonNegativeFloat = 5.0
    name: str = Field("textgen", description="The deployment named in errors.")


@dataclass(frozen=True)
class Need:
    """What a waiting request asks of the schedule: ``n`` slots of prompt + output each."""

    prompt_tokens: int
    max_tokens: int
    n: int = 1

    @property
    def tokens(self) -> int:
        return (self.prompt_tokens + self.max_tokens) * self.n


@dataclass(frozen=True)
class Waiting:
    """One waiting request as the policy sees it (times on the engine's monotonic clock)."""

    need: Need
    priority: int = 0
    arrived_s: float = 0.0
    deadline_s: float | None = None
    #: When the request first headed the order without fitting (None: it never did).
    blocked_since_s: float | None = None


@dataclass
class Plan:
    """One step's decision: indexes into the waiting line."""

    #: Admit these, in this order (their slots follow the running batch's).
    admit: list[int] = field(default_factory=list)
    #: Past their deadline: answer 504, compute nothing.
    expire: list[int] = field(default_factory=list)
    #: The head of the order that did not fit (its block clock starts), or None.
    blocked: int | None = None


def effective_priority(item: Waiting, *, now_s: float, aging_s: float) -> int:
    """``item``'s priority plus one level per ``aging_s`` waited.

    Example:
        >>> effective_priority(Waiting(Need(1, 1), priority=BATCH), now_s=5, aging_s=2)
        -9
    """
    if aging_s <= 0:
        return item.priority
    return item.priority + math.floor(max(0.0, now_s - item.arrived_s) / aging_s)


def order(waiting: Sequence[Waiting], *, now_s: float, aging_s: float) -> list[int]:
    """Indexes of ``waiting``, highest effective priority first, then first come."""
    return sorted(range(len(waiting)), key=lambda i: (
        -effective_priority(waiting[i], now_s=now_s, aging_s=aging_s), waiting[i].arrived_s, i))


def plan(waiting: Sequence[Waiting], *, running: int, reserved: int, config: EngineConfig,
         max_len: int, now_s: float, oldest_wait_s: float = 0.0) -> Plan:
    """Which of ``waiting`` to admit (and to expire) at this step.

    Args:
        running: slots the running batch holds.
        reserved: tokens the running batch reserves.
        max_len: the longest prompt + output one slot holds (the static batch's limit).
        now_s: the engine's monotonic clock.
        oldest_wait_s: how long the oldest waiting request has waited (static gathering).
    """
    result = Plan(expire=[i for i, w in enumerate(waiting)
                          if w.deadline_s is not None and w.deadline_s <= now_s])
    live = [i for i in order(waiting, now_s=now_s, aging_s=config.priority_aging_s)
            if i not in result.expire]
    if config.mode == "static":
        result.admit = _static(waiting, live, running=running, config=config, max_len=max_len,
                               oldest_wait_s=oldest_wait_s)
        return result
    slots, tokens = config.max_num_seqs - running, config.max_num_batched_tokens - reserved
    for i in live:
        need = waiting[i].need
        if need.n <= slots and need.tokens <= tokens:
            result.admit.append(i)
            slots, tokens = slots - need.n, tokens - need.tokens
        elif result.blocked is None:
            result.blocked = i
            since = waiting[i].blocked_since_s
            if since is not None and now_s - since >= config.backfill_hold_s:
                break  # the head has waited long enough: keep what frees up for it
    return result


def _static(waiting: Sequence[Waiting], live: list[int], *, running: int, config: EngineConfig,
            max_len: int, oldest_wait_s: float) -> list[int]:
    """A whole batch at once, in order, once none runs and enough wait (or long enough)."""
    ready = len(live) >= config.max_num_seqs or oldest_wait_s >= config.static_wait_s
    if running or not ready:
        return []
    admitted: list[int] = []
    slots, tokens = config.max_num_seqs, config.max_num_batched_tokens
    longest_prompt, longest_output = 0, 0
    for i in live:
        need = waiting[i].need
        # Every member of a static batch runs as long as its longest one.
        longest_prompt = max(longest_prompt, need.prompt_tokens)
        longest_output = max(longest_output, need.max_tokens)
        if need.n > slots or need.tokens > tokens or longest_prompt + longest_output > max_len:
            break
        admitted.append(i)
        slots, tokens = slots - need.n, tokens - need.tokens
    return admitted
