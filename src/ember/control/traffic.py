"""Traffic between the versions of one deployment: weights, pins and sticky sessions.

An ``App`` may list several classes with one ``name`` and different ``version``s; each is a
Ray Serve deployment of its own (``Embed@2``). The first listed is stable and gets 100% until
an operator sets weights (``PUT /-/traffic/Embed`` with ``{"1": 90, "2": 10}``, or
``ember traffic Embed 1=90 2=10``). The weights live in the cluster's key-value store, so
every edge, and an edge that restarts, reads the same; an edge re-reads them once a second.

Per request: ``X-Ember-Version`` pins a version; ``X-Ember-Session`` hashes the session id to
a fixed point on the weights' scale, so one session stays on one version while the weights
stand; otherwise a random draw picks by weight. The functions here are pure (the draw is
passed in) and tested without a cluster; :class:`TrafficStore` is the one part that talks to
Ray.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from ember.errors import BadRequest

Weights = dict[str, int]

_KV_NAMESPACE = "ember"


def stable_only(versions: Sequence[str]) -> Weights:
    """The weights before anyone sets them: the first version listed gets everything."""
    return {version: (100 if i == 0 else 0) for i, version in enumerate(versions)}


def parse_weights(group: str, versions: Sequence[str], body: Any) -> Weights:
    """Validate ``{"1": 90, "2": 10}`` for ``group``; every version not named gets 0.

    Raises:
        BadRequest: not an object of integer percentages, an unknown version, a negative
            weight, or a total other than 100; the message names the field.
    """
    if not isinstance(body, Mapping) or not body:
        raise BadRequest(f"traffic for {group!r} must be an object of version: percent, "
                         f"e.g. {{\"{versions[0]}\": 100}}", param="body")
    weights: Weights = dict.fromkeys(versions, 0)
    for version, weight in body.items():
        if version not in weights:
            raise BadRequest(f"{group!r} has no version {version!r}; it has "
                             f"{', '.join(versions)}", param=str(version))
        if isinstance(weight, bool) or not isinstance(weight, int):
            raise BadRequest(f"the weight of version {version!r} must be a whole percent, "
                             f"got {weight!r}", param=str(version))
        if weight < 0:
            raise BadRequest(f"the weight of version {version!r} must not be negative, "
                             f"got {weight}", param=str(version))
        weights[version] = weight
    total = sum(weights.values())
    if total != 100:
        raise BadRequest(f"the weights of {group!r} add up to {total}, not 100", param="body")
    return weights


def session_point(session: str, group: str) -> float:
    """Where a session falls on [0, 1): fixed for a session and deployment."""
    digest = hashlib.sha256(f"{group}\0{session}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def choose(weights: Mapping[str, int], point: float) -> str:
    """The version whose share of [0, 100) holds ``point * 100``.

    Example:
        >>> choose({"1": 90, "2": 10}, 0.95), choose({"1": 90, "2": 10}, 0.10)
        ('2', '1')
    """
    mark, upto = point * 100, 0
    last = next(iter(weights))
    for version, weight in weights.items():
        upto += weight
        if weight > 0:
            last = version
            if mark < upto:
                return version
    return last


class Traffic:
    """The weights one edge routes by, for every versioned deployment of its app."""

    def __init__(self, versions: Mapping[str, Sequence[str]]) -> None:
        #: Deployment name callers know -> its version labels, stable first.
        self.versions = {group: list(labels) for group, labels in versions.items()}
        self.weights = {group: stable_only(labels) for group, labels in self.versions.items()}

    def pick(self, group: str, *, pin: str | None = None, session: str | None = None,
             draw: float | None = None) -> str:
        """The version label that serves one request to ``group``.

        Raises:
            BadRequest: ``pin`` names a version ``group`` does not have.
        """
        labels = self.versions[group]
        if pin is not None:
            if pin not in labels:
                raise BadRequest(f"X-Ember-Version {pin!r}: {group!r} has versions "
                                 f"{', '.join(labels)}", param="X-Ember-Version")
            return pin
        if len(labels) == 1:
            return labels[0]
        point = session_point(session, group) if session else (
            random.random() if draw is None else draw)
        return choose(self.weights[group], point)

    def update(self, stored: Mapping[str, Any]) -> None:
        """Take the weights read from the store; entries that no longer fit are ignored."""
        for group, weights in stored.items():
            labels = self.versions.get(group)
            if labels is None:
                continue
            try:
                self.weights[group] = parse_weights(group, labels, weights)
            except BadRequest:  # written for an older set of versions: keep what we have
                continue


class TrafficStore:
    """Weights (or, with ``kind="shadow"``, shadow settings) in Ray's internal key-value
    store, one key per app."""

    def __init__(self, app: str, kind: str = "traffic") -> None:
        self.key = f"{kind}:{app}"

    def read(self) -> dict[str, Any]:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(self.key, namespace=_KV_NAMESPACE)
        try:
            value = json.loads(raw) if raw else {}
        except ValueError:  # a damaged value: stable-only rather than a crash
            return {}
        return value if isinstance(value, dict) else {}

    def write(self, group: str, weights: Any) -> None:
        """Set ``group``'s entry, keeping the other deployments' as stored."""
        from ray.experimental import internal_kv

        value = {**self.read(), group: weights}
        internal_kv._internal_kv_put(self.key, json.dumps(value).encode(), overwrite=True,
                                     namespace=_KV_NAMESPACE)
