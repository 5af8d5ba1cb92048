"""Shadow traffic: a sample of a deployment's requests copied to a candidate version.

``PUT /-/shadow/Embed`` with ``{"to": "2", "percent": 20}`` (or ``ember shadow Embed --to 2
--percent 20``) copies one request in five, after the caller's answer is on its way, to
version 2. The copy's answer is compared with the one the caller got and thrown away: the
status, the latency ratio and, for numeric answers, a distance, all exported to /metrics.
The caller never waits for the copy. The setting lives in the cluster's key-value store
beside the weights (``traffic.py``). This module holds the pure parts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ember.errors import BadRequest


@dataclass(frozen=True)
class Shadow:
    """Copy ``percent`` of the requests of a deployment to version ``to``."""

    to: str
    percent: int

    def sampled(self, draw: float) -> bool:
        return draw * 100 < self.percent

    def as_dict(self) -> dict[str, Any]:
        return {"to": self.to, "percent": self.percent}


def parse_shadow(group: str, versions: Sequence[str], body: Any) -> Shadow | None:
    """Validate ``{"to": "2", "percent": 20}``; ``{"percent": 0}`` turns shadowing off.

    Raises:
        BadRequest: not an object, an unknown version, or a percent outside 0-100.
    """
    if not isinstance(body, Mapping) or "percent" not in body:
        raise BadRequest(f"shadow for {group!r} must be an object like "
                         f"{{\"to\": \"{versions[-1]}\", \"percent\": 20}}", param="body")
    percent = body["percent"]
    if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
        raise BadRequest(f"percent must be a whole number from 0 to 100, got {percent!r}",
                         param="percent")
    if percent == 0:
        return None
    to = body.get("to")
    if to not in versions:
        raise BadRequest(f"{group!r} has no version {to!r} to shadow to; it has "
                         f"{', '.join(versions)}", param="to")
    return Shadow(str(to), percent)


def _numbers(value: Any) -> list[float] | None:
    """Every number in a JSON-like answer, in order; None if it holds anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, Mapping):
        value = [value[k] for k in sorted(value)]
    if isinstance(value, list | tuple):
        out: list[float] = []
        for item in value:
            numbers = _numbers(item)
            if numbers is None:
                return None
            out += numbers
        return out
    return None


def distance(primary: Any, shadow: Any) -> float | None:
    """Euclidean distance between two numeric answers of the same shape, else None.

    Example:
        >>> distance({"embedding": [0.0, 3.0]}, {"embedding": [4.0, 3.0]})
        4.0
        >>> distance("text", "text") is None
        True
    """
    a, b = _numbers(_plain(primary)), _numbers(_plain(shadow))
    if a is None or b is None or len(a) != len(b) or not a:
        return None
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))


def _plain(value: Any) -> Any:
    """Pydantic models as dicts, so answers like ``list[Embedding]`` compare as numbers."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return _plain(dump())
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
