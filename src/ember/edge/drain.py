"""The edge's side of a stopping server: readiness follows the serving process, and a drain.

The process that deployed the app (``ember run``) writes its phase under one key of Ray's
internal KV store: ``starting`` until it is fully up (signal handlers in place, warm runtime
ready), ``serving``, then ``draining`` once it was asked to stop. Each edge reads the phase
five times a second while it is not ``serving`` or just changed, and at least every
:data:`STEADY_WATCH_PERIOD_S` while it stands (:meth:`DrainGate.watch`):

- ``/readyz`` answers 200 only while the phase is ``serving`` (no key at all counts as
  serving: an app deployed without ``ember run`` has no process to wait for);
- while ``draining``, new requests get 503 with ``Retry-After`` (:class:`DrainMiddleware`) and
  ``/readyz`` 503, so a load balancer moves traffic away, while the requests already in
  flight run to their end. Each edge reports how many it still has, and the stopping process
  waits for every report to reach zero before it tears Serve down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from ember import ray_internals
from ember.control.backoff import next_interval_s
from ember.edge._asgi import error_response
from ember.errors import ShuttingDown

logger = logging.getLogger("ember.edge")

NAMESPACE = "ember"
STARTING, SERVING, DRAINING = "starting", "serving", "draining"
#: How often an edge reads the phase after a change, readiness included (``control/backoff``).
WATCH_PERIOD_S = 0.2
#: How often it reads a phase that has stood still: a drain is seen within this.
STEADY_WATCH_PERIOD_S = 0.8
#: Paths that keep their own answers while draining: probes and the edges' own metrics.
_PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


def phase_key(app: str) -> str:
    return f"lifecycle:{app}"


def report_prefix(app: str) -> str:
    return f"lifecycle:{app}:edge:"


class DrainGate:
    """One edge's view of the phase, and its count of requests in flight."""

    def __init__(self) -> None:
        self.phase = SERVING
        self.in_flight = 0

    @property
    def draining(self) -> bool:
        return self.phase == DRAINING

    @property
    def serving(self) -> bool:
        return self.phase == SERVING

    async def watch(self, app: str, edge: str) -> None:
        """Follow the phase; while draining, publish this edge's requests in flight.

        Every :data:`WATCH_PERIOD_S` while the phase is not serving (starting, draining) or
        just changed, backing off to :data:`STEADY_WATCH_PERIOD_S` while it stands still.
        """
        period = WATCH_PERIOD_S
        while True:
            before = self.phase
            try:
                await asyncio.to_thread(self._sync, app, edge)
            except Exception:  # the GCS may be restarting: keep the last phase, try again
                logger.debug("cannot read the server's phase", exc_info=True)
            period = next_interval_s(period, changed=self.phase != before or not self.serving,
                                     fast_s=WATCH_PERIOD_S, slow_s=STEADY_WATCH_PERIOD_S)
            await asyncio.sleep(period)

    def _sync(self, app: str, edge: str) -> None:
        raw = ray_internals.kv_get(phase_key(app), namespace=NAMESPACE)
        self.phase = raw.decode() if raw else SERVING
        if self.draining:
            report = json.dumps({"in_flight": self.in_flight, "at": time.time()}).encode()
            ray_internals.kv_put(report_prefix(app) + edge, report,
                                 namespace=NAMESPACE)


class DrainMiddleware:
    """Count HTTP requests in flight; while draining, answer new ones 503 with Retry-After.

    Outermost middleware, so a refused request costs no auth, body read or model call.
    """

    def __init__(self, app: ASGIApp, *, gate: DrainGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _PROBES:
            await self.app(scope, receive, send)
            return
        if self.gate.draining:
            await error_response(ShuttingDown(), "-")(scope, receive, send)
            return
        self.gate.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.in_flight -= 1


def drained(reports: dict[str, Any], edges: int) -> bool:
    """Whether ``edges`` edges reported a drain and none has a request left in flight."""
    return len(reports) >= edges and all(r.get("in_flight", 1) == 0 for r in reports.values())
