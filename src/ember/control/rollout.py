"""Stepped rollouts of a candidate version, judged against stable, rolled back on harm.

``PUT /-/rollout/Embed`` with ``{"to": "2", "steps": [5, 25, 50, 100], "every_s": 60,
"max_error_rate": 0.01, "max_p99_ratio": 1.5}`` (or ``ember rollout Embed --to 2 ...``)
moves traffic to version 2 in steps, as KServe's ``canaryTrafficPercent`` and Flagger's
stepped analysis do. Each step goes:

1. **wake**: the candidate is given a warm floor sized for the share it is about to take
   (``ceil(replicas of the group * share)``, at least one), and the step waits until that
   many of its replicas run, so the step's requests meet a warm candidate;
2. **hold** for ``every_s``: the weights are ``{stable: 100 - share, to: share}``; while the
   step holds, the candidate's 5xx rate over the step is compared with stable's; more than
   ``max_error_rate`` above it sends all traffic back to stable and marks the rollout failed
   with the reason, at once, not at the end of the step. At the step's end, so does a p99
   latency over the step above ``max_p99_ratio`` times stable's;
3. after the last step (100%) has held, the rollout has succeeded.

The rollout is judged only on evidence: a version with fewer than ``min_requests`` requests
in the window is not compared. At 100% stable takes no requests, so from then on (and
whenever stable's step window is too thin) the candidate is compared with stable's figures
since the rollout began.

Everything here is pure: :func:`tick` takes the rollout, the clock and what the edges
counted, and returns the next rollout and what to change. The driver that runs it in the
cluster (``edge/rollouts.py``) reads the edges' counters and applies the changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ember.errors import BadRequest

#: How long a step waits for the candidate's replicas before the rollout fails.
WAKE_TIMEOUT_S = 120.0
#: Events kept in a rollout's history (steps, the verdict), oldest dropped first.
HISTORY_LIMIT = 20
#: Requests of each version below which a step's p99 is not compared (the p99 of fewer is
#: little more than their maximum).
P99_MIN_REQUESTS = 100
#: The states a rollout ends in.
ENDED = ("succeeded", "failed", "rolled_back")


@dataclass(frozen=True)
class Tally:
    """Requests counted by the edges: how many, how many were 5xx, and their latency
    histogram as cumulative counts per upper bound in seconds (Prometheus' ``le``)."""

    requests: float = 0.0
    errors: float = 0.0
    buckets: tuple[tuple[float, float], ...] = ()

    def plus(self, other: Tally) -> Tally:
        bounds = dict(self.buckets)
        for le, count in other.buckets:
            bounds[le] = bounds.get(le, 0.0) + count
        return Tally(self.requests + other.requests, self.errors + other.errors,
                     tuple(sorted(bounds.items())))

    def since(self, earlier: Tally) -> Tally:
        """What was counted after ``earlier``; all of it if the counters restarted (an edge
        that was replaced counts from zero again)."""
        if self.requests < earlier.requests:
            return self
        before = dict(earlier.buckets)
        return Tally(self.requests - earlier.requests, self.errors - earlier.errors,
                     tuple((le, count - before.get(le, 0.0)) for le, count in self.buckets))

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def quantile(self, q: float) -> float:
        """The ``q`` quantile in seconds, interpolated within its bucket as Prometheus'
        ``histogram_quantile`` does; the largest finite bound when it lies beyond them.

        Example:
            >>> Tally(100, 0, ((0.01, 50.0), (0.02, 100.0))).quantile(0.99)
            0.0198
        """
        rank, lower, below = q * self.requests, 0.0, 0.0
        for le, count in self.buckets:
            if count >= rank and count > below:
                return lower + (le - lower) * (rank - below) / (count - below)
            lower, below = le, count
        return lower

    def as_json(self) -> list[Any]:
        return [self.requests, self.errors, [list(b) for b in self.buckets]]

    @classmethod
    def from_json(cls, value: Any) -> Tally:
        requests, errors, buckets = value
        return cls(float(requests), float(errors),
                   tuple((float(le), float(count)) for le, count in buckets))


#: What the edges counted: edge id -> version label -> tally.
Counts = dict[str, dict[str, Tally]]


def window(now: Counts, then: Counts) -> dict[str, Tally]:
    """Per version, what every edge counted since ``then``; an edge new since is counted
    whole, an edge gone since is not counted."""
    out: dict[str, Tally] = {}
    for edge, versions in now.items():
        for version, tally in versions.items():
            earlier = then.get(edge, {}).get(version, Tally())
            out[version] = out.get(version, Tally()).plus(tally.since(earlier))
    return out


@dataclass(frozen=True)
class RolloutSpec:
    """What the operator asked for (see the module doc)."""

    group: str
    to: str
    stable: str
    steps: tuple[int, ...] = (5, 25, 50, 100)
    every_s: float = 60.0
    max_error_rate: float = 0.01
    max_p99_ratio: float = 1.5
    min_requests: int = 20


def parse_rollout(group: str, versions: Sequence[str], weights: Mapping[str, int],
                  body: Any) -> RolloutSpec:
    """Validate a rollout request for ``group``; stable is the version with the most traffic
    now, other than the candidate.

    Raises:
        BadRequest: naming the field that is wrong.
    """
    if not isinstance(body, Mapping):
        raise BadRequest(f"a rollout of {group!r} must be an object like "
                         f"{{\"to\": \"{versions[-1]}\", \"steps\": [5, 25, 50, 100]}}",
                         param="body")
    unknown = sorted(set(body) - {"to", "steps", "every_s", "max_error_rate",
                                  "max_p99_ratio", "min_requests"})
    if unknown:
        raise BadRequest(f"unknown rollout field {unknown[0]!r}", param=unknown[0])
    to = body.get("to")
    if to not in versions:
        raise BadRequest(f"{group!r} has no version {to!r} to roll out; it has "
                         f"{', '.join(versions)}", param="to")
    others = sorted((v for v in versions if v != to), key=lambda v: -weights.get(v, 0))
    if not others:
        raise BadRequest(f"{group!r} has only version {to!r}: nothing to roll out from",
                         param="to")
    defaults = RolloutSpec(group, str(to), others[0])
    return replace(defaults, steps=_steps(body.get("steps", list(defaults.steps))),
                   every_s=_number(body, "every_s", defaults.every_s, 0.0, 86400.0),
                   max_error_rate=_number(body, "max_error_rate", defaults.max_error_rate,
                                          0.0, 1.0, low_open=False),
                   max_p99_ratio=_number(body, "max_p99_ratio", defaults.max_p99_ratio,
                                         1.0, 1000.0, low_open=False),
                   min_requests=int(_number(body, "min_requests", defaults.min_requests,
                                            1.0, 1e6, low_open=False, whole=True)))


def _steps(value: Any) -> tuple[int, ...]:
    ok = (isinstance(value, list) and value
          and all(isinstance(s, int) and not isinstance(s, bool) for s in value))
    if not ok or not all(a < b for a, b in zip([0, *value], value, strict=False)) \
            or value[-1] != 100:
        raise BadRequest(f"steps must be rising whole percents ending at 100, e.g. "
                         f"[5, 25, 50, 100]; got {value!r}", param="steps")
    return tuple(value)


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float, *,
            low_open: bool = True, whole: bool = False) -> float:
    value = body.get(name, default)
    fits = isinstance(value, int | float) and not isinstance(value, bool) and (
        not whole or float(value).is_integer())
    if not fits or not (low < value if low_open else low <= value) or value > high:
        bound = f"{'over' if low_open else 'at least'} {low:g} and at most {high:g}"
        raise BadRequest(f"{name} must be a {'whole ' if whole else ''}number {bound}, "
                         f"got {value!r}", param=name)
    return float(value)


@dataclass(frozen=True)
class Rollout:
    """One rollout's state, as stored in the cluster's key-value store."""

    spec: RolloutSpec
    max_replicas: int
    began_s: float
    state: str = "running"  # then one of ENDED
    phase: str = "waking"  # or "holding"
    step: int = -1  # index into spec.steps of the step holding; -1 before the first
    phase_started_s: float = 0.0
    wake_floor: int = 1
    reason: str = ""
    #: When the driver last wrote it: a running rollout that stops beating lost its driver.
    beat_s: float = 0.0
    #: The operator's lease on the candidate when the rollout began, given back at its end.
    prior_lease: dict[str, float] | None = None
    step_counts: Counts = field(default_factory=dict)
    first_counts: Counts = field(default_factory=dict)
    #: The last judgement: per role ("stable", "candidate"), requests, 5xx rate and p99.
    judged: dict[str, dict[str, float]] = field(default_factory=dict)
    history: tuple[str, ...] = ()

    @property
    def share(self) -> int:
        """The candidate's percent of the traffic now."""
        return self.spec.steps[self.step] if self.step >= 0 and self.state in (
            "running", "succeeded") else 0

    def noted(self, now: float, event: str) -> tuple[str, ...]:
        return (*self.history, f"{now - self.began_s:.1f}s {event}")[-HISTORY_LIMIT:]

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["spec"]["steps"] = list(self.spec.steps)
        for key in ("step_counts", "first_counts"):
            counts: Counts = getattr(self, key)
            out[key] = {e: {v: t.as_json() for v, t in vs.items()} for e, vs in counts.items()}
        out["history"] = list(self.history)
        out["share"] = self.share
        return out

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Rollout:
        spec = RolloutSpec(**{**value["spec"], "steps": tuple(value["spec"]["steps"])})
        def counts(key: str) -> Counts:
            return {e: {v: Tally.from_json(t) for v, t in vs.items()}
                    for e, vs in value[key].items()}

        plain: dict[str, Any] = {k: v for k, v in value.items() if k not in (
            "spec", "share", "history", "step_counts", "first_counts")}
        return cls(spec=spec, history=tuple(value["history"]),
                   step_counts=counts("step_counts"), first_counts=counts("first_counts"),
                   **plain)


@dataclass(frozen=True)
class Change:
    """What the driver applies after a tick: new weights, and the candidate's floor
    (0 ends the rollout's lease on it)."""

    weights: dict[str, int] | None = None
    floor: int | None = None


def weights_at(spec: RolloutSpec, share: int) -> dict[str, int]:
    return {spec.stable: 100 - share, spec.to: share}


def start(spec: RolloutSpec, max_replicas: int, now: float,
          running: Mapping[str, int]) -> tuple[Rollout, Change]:
    """A new rollout, waking the candidate for its first step."""
    rollout = Rollout(spec, max_replicas, began_s=now, phase_started_s=now)
    floor = wake_floor(rollout, running)
    began = replace(rollout, wake_floor=floor,
                    history=rollout.noted(now, f"began: v{spec.stable} -> v{spec.to}"))
    return began, Change(floor=floor)


def tick(rollout: Rollout, now: float, counts: Counts, running: Mapping[str, int]) -> tuple[
        Rollout, Change]:
    """One look at a running rollout.

    Args:
        counts: what the edges counted so far (cumulative).
        running: replicas running per version label of the group.
    """
    if rollout.state != "running":
        return rollout, Change()
    if rollout.phase == "waking":
        return _wake(rollout, now, counts, running)
    over = now - rollout.phase_started_s >= rollout.spec.every_s
    verdict = judge(rollout, counts, step_over=over)
    if verdict is not None:
        return end(rollout, now, "failed", verdict)
    if not over:
        return rollout, Change()
    if rollout.step == len(rollout.spec.steps) - 1:
        done = replace(rollout, state="succeeded",
                       history=rollout.noted(now, f"succeeded: v{rollout.spec.to} at 100%"))
        return done, Change(floor=0)
    floor = wake_floor(rollout, running)
    return replace(rollout, phase="waking", phase_started_s=now, wake_floor=floor), Change(
        floor=floor)


def _wake(rollout: Rollout, now: float, counts: Counts, running: Mapping[str, int]) -> tuple[
        Rollout, Change]:
    spec = rollout.spec
    if running.get(spec.to, 0) >= rollout.wake_floor:
        step = rollout.step + 1
        share = spec.steps[step]
        moved = replace(rollout, phase="holding", step=step, phase_started_s=now,
                        step_counts=counts, first_counts=rollout.first_counts or counts,
                        history=rollout.noted(now, f"step {step + 1}/{len(spec.steps)}: "
                                                   f"v{spec.to} at {share}%"))
        return moved, Change(weights=weights_at(spec, share))
    if now - rollout.phase_started_s > WAKE_TIMEOUT_S:
        return end(rollout, now, "failed",
                   f"v{spec.to} had {running.get(spec.to, 0)} of {rollout.wake_floor} "
                   f"replicas running after {WAKE_TIMEOUT_S:g} s")
    return rollout, Change()


def wake_floor(rollout: Rollout, running: Mapping[str, int]) -> int:
    """Replicas the candidate needs for its next share: its part of what the group runs."""
    share = rollout.spec.steps[rollout.step + 1]
    need = math.ceil(sum(running.values()) * share / 100)
    return max(1, min(need, rollout.max_replicas))


def judge(rollout: Rollout, counts: Counts, *, step_over: bool) -> str | None:
    """Why the candidate must be rolled back; None while it holds.

    Errors are judged all through the step: a failing candidate is pulled at once. The p99
    is judged once, over the whole step, from at least ``P99_MIN_REQUESTS`` requests of each
    version: a tail quantile re-read on every tick of a growing window would, by chance
    alone, cross any bound sooner or later.
    """
    spec = rollout.spec
    step, since_first = window(counts, rollout.step_counts), window(counts, rollout.first_counts)
    candidate = step.get(spec.to, Tally())
    stable = step.get(spec.stable, Tally())
    if stable.requests < spec.min_requests:
        stable = since_first.get(spec.stable, Tally())
    if candidate.requests < spec.min_requests:
        return None
    if candidate.error_rate > stable.error_rate + spec.max_error_rate:
        return (f"v{spec.to} answered {candidate.error_rate:.1%} of {candidate.requests:.0f} "
                f"requests with 5xx, over v{spec.stable}'s {stable.error_rate:.1%} + "
                f"{spec.max_error_rate:.1%}")
    if not step_over or min(stable.requests, candidate.requests) < max(
            spec.min_requests, P99_MIN_REQUESTS):
        return None
    mine, theirs = candidate.quantile(0.99), stable.quantile(0.99)
    if theirs > 0 and mine > spec.max_p99_ratio * theirs:
        return (f"v{spec.to}'s p99 of {mine * 1000:.1f} ms is over {spec.max_p99_ratio:g}x "
                f"v{spec.stable}'s {theirs * 1000:.1f} ms")
    return None


def end(rollout: Rollout, now: float, state: str, reason: str) -> tuple[Rollout, Change]:
    """Stop the rollout: all traffic back to stable, the candidate's lease ended."""
    word = "rolled back" if state == "rolled_back" else state
    ended = replace(rollout, state=state, reason=reason,
                    history=rollout.noted(now, f"{word}: {reason}"))
    return ended, Change(weights=weights_at(rollout.spec, 0), floor=0)


def summary(rollout: Rollout, counts: Counts) -> dict[str, dict[str, float]]:
    """Requests, 5xx rate and p99 (ms) of both versions over the step so far."""
    step = window(counts, rollout.step_counts)
    out = {}
    for role, version in (("stable", rollout.spec.stable), ("candidate", rollout.spec.to)):
        tally = step.get(version, Tally())
        out[role] = {"requests": tally.requests, "error_rate": round(tally.error_rate, 4),
                     "p99_ms": round(tally.quantile(0.99) * 1000, 2)}
    return out
