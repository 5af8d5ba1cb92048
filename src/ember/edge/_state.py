"""What the ingress knows about each deployment's load and replicas.

Ongoing and queued counts are as seen by this ingress: requests it has sent and not yet
had answered, split into "on a replica" and "waiting" using the running replica count and
each replica's concurrency limit. Replica counts come from Ray Serve's controller, polled
in the background so that no request path waits on the controller.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from ember.app.config import DeploymentOptions
from ember.control.coldstart import ColdStartReport
from ember.control.pool import GPU_POOL_DEPLOYMENT, POOL_DEPLOYMENT
from ember.edge._metrics import Metrics


@dataclass
class DeploymentLoad:
    """Live counters of one deployment."""

    name: str
    options: DeploymentOptions
    inflight: int = 0
    running: int = 0
    starting: int = 0
    status: str = "UNKNOWN"
    message: str = ""
    last_cold_start: ColdStartReport | None = None
    last_cold_start_at: float | None = None
    cold_starts: int = 0
    replica_states: dict[str, int] = field(default_factory=dict)
    #: Why a starting replica is not placed ("waiting for resources: ..."), when it is not.
    waiting_for: str | None = None
    #: Why the warm pool does not serve this deployment, when its preload failed.
    pool_failure: str | None = None

    @property
    def queued(self) -> int:
        return max(0, self.inflight - self.running * self.options.ongoing_limit())

    @property
    def ongoing(self) -> int:
        return self.inflight - self.queued

    def as_dict(self) -> dict[str, Any]:
        return {
            "deployment": self.name,
            "status": self.status,
            "replicas_running": self.running,
            "replicas_starting": self.starting,
            "ongoing": self.ongoing,
            "queued": self.queued,
            "floor": self.options.warm_floor,
            "max_replicas": self.options.max_replicas,
            "cold_starts": self.cold_starts,
            "last_cold_start": (
                {"at": self.last_cold_start_at, **self.last_cold_start.as_dict()}
                if self.last_cold_start else None),
            "cold_start_budget_s": self.options.cold_start_budget_s,
            "message": "; ".join(filter(None, [self.waiting_for, self.pool_failure,
                                               self.message])),
            "waiting_for_resources": self.waiting_for,
            "pool_failure": self.pool_failure,
        }


#: Serve deployment name of the edges (``edge.py``), whose count the status reports.
EDGE_DEPLOYMENT = "ember-edge"


class LoadTracker:
    """Per-deployment counters shared by the ingress's request handlers."""

    def __init__(self, options: dict[str, DeploymentOptions], metrics: Metrics) -> None:
        self.metrics = metrics
        self.loads = {name: DeploymentLoad(name, opts) for name, opts in options.items()}
        self.pool_running = 0
        self.gpu_pool_running = 0
        #: Deployments whose preload failed in the warm pool, with the reason.
        self.pool_failures: dict[str, str] = {}
        self.edges_running = 0
        #: Whether the app has a warm pool, whose replica must be up before it is ready.
        self.pool_expected = False
        self.gpu_pool_expected = False
        #: Whether replica states have been read at least once; not ready before that.
        self.polled = False
        #: Set when a request finds a deployment cold: the replica poll, which may be
        #: backing off, reads the states at once (``ingress.IngressState.poll_replicas``).
        self._poll_now = asyncio.Event()

    def wake_poll(self) -> None:
        """Have the replica poll read the states now rather than at its next period."""
        self._poll_now.set()

    async def next_poll(self, timeout_s: float) -> None:
        """Wait ``timeout_s``, or less when :meth:`wake_poll` is called meanwhile."""
        with suppress(TimeoutError):
            await asyncio.wait_for(self._poll_now.wait(), timeout_s)
        self._poll_now.clear()

    @contextmanager
    def track(self, deployment: str) -> Iterator[bool]:
        """Count one request in flight; yields whether it arrived to a cold deployment."""
        load = self.loads[deployment]
        cold = load.running == 0
        if cold:
            self.wake_poll()
        load.inflight += 1
        self._publish(load)
        try:
            yield cold
        finally:
            load.inflight -= 1
            self._publish(load)

    def update_replicas(self, deployment: str, overview: Any) -> None:
        """Take one ``DeploymentStatusOverview`` from Ray Serve's status."""
        load = self.loads.get(deployment)
        if load is None:
            if deployment == POOL_DEPLOYMENT:
                self.pool_running = int(overview.replica_states.get("RUNNING", 0))
            elif deployment == GPU_POOL_DEPLOYMENT:
                self.gpu_pool_running = int(overview.replica_states.get("RUNNING", 0))
            elif deployment == EDGE_DEPLOYMENT:
                self.edges_running = int(overview.replica_states.get("RUNNING", 0))
            return
        states = {str(getattr(k, "value", k)): int(v) for k, v in overview.replica_states.items()}
        load.replica_states = states
        load.running = states.get("RUNNING", 0)
        load.starting = states.get("STARTING", 0) + states.get("PENDING_MIGRATION", 0)
        load.status = str(getattr(overview.status, "value", overview.status))
        load.message = overview.message or ""
        for state in ("RUNNING", "STARTING", "STOPPING"):
            self.metrics.replicas.labels(deployment, state.lower()).set(states.get(state, 0))
        self.metrics.floor.labels(deployment).set(load.options.warm_floor)
        self._publish(load)

    def update_pool_failures(self, failures: dict[str, str]) -> None:
        self.pool_failures = failures
        for load in self.loads.values():
            load.pool_failure = failures.get(load.name)

    def unplaced(self) -> list[DeploymentLoad]:
        """Deployments with no running replica and one starting: those that may be unplaced."""
        return [load for load in self.loads.values() if load.running == 0 and load.starting > 0]

    def changing(self) -> bool:
        """Whether some deployment is starting replicas or has requests waiting at zero."""
        if not self._pools_up():
            return True
        return any(load.starting > 0 or (load.running == 0 and load.inflight > 0)
                   for load in self.loads.values())

    def ready(self) -> bool:
        """True when every floor is met and the warm pool (if any) is up, as last read."""
        floors_met = all(load.running >= load.options.warm_floor for load in self.loads.values())
        return self.polled and floors_met and self._pools_up()

    def _pools_up(self) -> bool:
        return ((self.pool_running > 0 or not self.pool_expected)
                and (self.gpu_pool_running > 0 or not self.gpu_pool_expected))

    def _publish(self, load: DeploymentLoad) -> None:
        self.metrics.ongoing.labels(load.name).set(load.ongoing)
        self.metrics.queued.labels(load.name).set(load.queued)

    def record_cold(self, deployment: str, report: ColdStartReport) -> None:
        """Count one cold request and export its phases."""
        load = self.loads[deployment]
        load.cold_starts += 1
        load.last_cold_start, load.last_cold_start_at = report, time.time()
        if report.path == "replica":
            # A replica just answered: do not count the next request as cold while the
            # background poll has yet to see it.
            load.running = max(load.running, 1)
        self.metrics.cold_starts.labels(load.name, report.path).inc()
        self.metrics.cold_start_s.labels(load.name, report.path).observe(report.total_s)
        for phase, seconds in report.phases.items():
            self.metrics.cold_start_phase_s.labels(load.name, phase, report.path).observe(seconds)
