"""The rollout driver: the detached Ray actor that runs an app's rollouts, and their store.

``control/rollout.py`` says what a rollout is; the edge's admin routes (``edge/rollouts.py``)
start, read and end one through this driver.

A rollout must go on after the CLI that asked for it exits and after an edge restarts, so
neither runs it: :class:`RolloutDriver` is a detached Ray actor, one per app, that wakes
twice a second while a rollout runs and stops itself when none does. Its whole state lives
in the app's durable store (``control/store.py``, one key per deployment), so a driver that
dies is restarted by Ray and picks up where the last one wrote; an edge that sees a running
rollout's heartbeat go stale asks for the driver again (:func:`watch`), which is also how a
rollout goes on after ``ember run`` restarts: from the step it was at, held again from the
start (``policy.resume``).

The driver judges versions on what callers met at the edges: every edge publishes its
metrics to the key-value store once a second while they change
(``edge_reports.EdgeReports``), and the driver
adds up their ``ember_request_duration_seconds`` histograms per version. Only the driver
writes a rollout once it has begun, so an edge and the driver never race on one record.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ember.control import floors
from ember.control import rollout as policy
from ember.control.edge_reports import EdgeReports
from ember.control.rollout import Counts, Rollout, RolloutSpec, Tally
from ember.control.store import open_store
from ember.control.traffic import TrafficStore
from ember.control.warm_env import light_runtime_env

logger = logging.getLogger("ember.rollout")

_NAMESPACE = "ember"
#: How often the driver looks at a running rollout.
TICK_S = 0.5
#: A running rollout whose driver has not written for this long has lost its driver.
STALE_S = 5.0
_LATENCY = "ember_request_duration_seconds"


def serve_name(group: str, version: str) -> str:
    """The Serve deployment of one version (``Embed@2``); every version of a group has one."""
    return f"{group}@{version}"


class RolloutStore:
    """Rollouts in the app's durable store (``control/store.py``), one key per deployment."""

    def __init__(self, app: str) -> None:
        self.app = app
        self.prefix = f"rollout:{app}:"

    def read(self, group: str) -> Rollout | None:
        return _decode(open_store(self.app).get(self.prefix + group))

    def read_all(self) -> dict[str, Rollout]:
        store = open_store(self.app)
        found = {}
        for key in store.keys(self.prefix):
            rollout = _decode(store.get(key))
            if rollout is not None:
                found[rollout.spec.group] = rollout
        return found

    def write(self, rollout: Rollout) -> None:
        open_store(self.app).put(self.prefix + rollout.spec.group,
                                 json.dumps(rollout.as_json()).encode())


def _decode(raw: bytes | None) -> Rollout | None:
    try:
        return Rollout.from_json(json.loads(raw)) if raw else None
    except (ValueError, KeyError, TypeError):  # damaged or from another release: no rollout
        return None


def counts_from(texts: Mapping[str, str], group: str) -> Counts:
    """Per edge and version of ``group``: requests, 5xx and the latency histogram, from the
    edges' published expositions."""
    counts: Counts = {}
    for edge, text in texts.items():
        parts: dict[str, dict[str, Any]] = {}
        for family in text_string_to_metric_families(text):
            if family.name != _LATENCY:
                continue
            for sample in family.samples:
                deployment, version = sample.labels.get("deployment", ""), sample.labels.get(
                    "version", "1")
                if deployment != serve_name(group, version):
                    continue
                into = parts.setdefault(version, {"requests": 0.0, "errors": 0.0, "le": {}})
                if sample.name == f"{_LATENCY}_count":
                    into["requests"] += sample.value
                    if sample.labels.get("status", "").startswith("5"):
                        into["errors"] += sample.value
                elif sample.name == f"{_LATENCY}_bucket" and sample.labels["le"] != "+Inf":
                    le = float(sample.labels["le"])
                    into["le"][le] = into["le"].get(le, 0.0) + sample.value
        counts[edge] = {v: Tally(p["requests"], p["errors"], tuple(sorted(p["le"].items())))
                        for v, p in parts.items()}
    return counts


def running_from(statuses: list[dict[str, Any]], group: str) -> dict[str, int]:
    """Running replicas per version of ``group``, from the newest edge status."""
    if not statuses:
        return {}
    newest = max(statuses, key=lambda s: float(s.get("at", 0)))
    return {str(row.get("version", "1")): int(row.get("replicas_running") or 0)
            for row in newest["status"].get("deployments", []) if row.get("group") == group}


class RolloutDriver:
    """The detached actor that runs an app's rollouts (see the module doc)."""

    def __init__(self, app: str) -> None:
        self.app = app
        self.store = RolloutStore(app)
        self.traffic = TrafficStore(app)
        self.leases = floors.LeaseStore(app)
        self.board = EdgeReports(app, "")
        self._loop: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def begin(self, spec: dict[str, Any], max_replicas: int) -> dict[str, Any] | None:
        """Start a rollout; None if one is already running for the deployment."""
        async with self._lock:
            began = await asyncio.to_thread(self._begin, RolloutSpec(
                **{**spec, "steps": tuple(spec["steps"])}), max_replicas)
        await self.ensure_running()
        return began

    def _begin(self, spec: RolloutSpec, max_replicas: int) -> dict[str, Any] | None:
        current = self.store.read(spec.group)
        if current is not None and current.state == "running":
            return None
        _, running = self._observe(spec.group)
        rollout, change = policy.start(spec, max_replicas, time.time(), running)
        prior = self.leases.get(serve_name(spec.group, spec.to))
        rollout = replace(rollout, beat_s=time.time(), prior_lease=prior)
        return self._apply(rollout, change).as_json()

    async def rollback(self, group: str, reason: str) -> dict[str, Any] | None:
        """End ``group``'s running rollout with all traffic on stable; None if none runs."""
        async with self._lock:
            return await asyncio.to_thread(self._rollback, group, reason)

    def _rollback(self, group: str, reason: str) -> dict[str, Any] | None:
        current = self.store.read(group)
        if current is None or current.state != "running":
            return None
        ended, change = policy.end(current, time.time(), "rolled_back", reason)
        return self._apply(ended, change).as_json()

    async def ensure_running(self) -> None:
        """Start the loop unless it runs (after a restart, an edge calls this)."""
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            async with self._lock:
                try:
                    live = await asyncio.to_thread(self._tick_all)
                except Exception:  # the store may be restarting; look again next tick
                    logger.warning("rollout tick failed", exc_info=True)
                    live = True
                if not live:
                    # Inside the lock, and it is never released: a call queued behind this
                    # tick must not run on an actor that is being killed. A begin that ran
                    # here would write the candidate's lease and die before its rollout, and
                    # the new driver the edge then asks would take that lease for the
                    # operator's and put it back at the end. Queued calls fail with the
                    # actor, and the edge asks a new driver.
                    import ray

                    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                    await asyncio.Event().wait()
            await asyncio.sleep(TICK_S)

    def _tick_all(self) -> bool:
        """Tick every running rollout once; whether any still runs."""
        live = False
        for rollout in self.store.read_all().values():
            if rollout.state != "running":
                continue
            counts, running = self._observe(rollout.spec.group)
            now = time.time()
            if now - rollout.beat_s > STALE_S:  # nobody ran it for a while: a restart
                rollout = policy.resume(rollout, now)
            ticked, change = policy.tick(rollout, now, counts, running)
            judged = policy.summary(ticked, counts) if ticked.phase == "holding" else {}
            self._apply(replace(ticked, beat_s=now, judged=judged or ticked.judged), change)
            live = live or ticked.state == "running"
        return live

    def _observe(self, group: str) -> tuple[Counts, dict[str, int]]:
        published = self.board.published()
        texts = {edge: str(value["text"]) for edge, value in published.items()}
        return counts_from(texts, group), running_from(list(published.values()), group)

    def _apply(self, rollout: Rollout, change: policy.Change) -> Rollout:
        """Write the change, then the rollout: a crash between the two repeats the change."""
        spec = rollout.spec
        if change.weights is not None:
            self.traffic.write(spec.group, change.weights)
        if change.floor is not None:
            self._lease(rollout, change.floor)
        self.store.write(rollout)
        return rollout

    def _lease(self, rollout: Rollout, floor: int) -> None:
        """The candidate's lease: ``floor`` for a step, or at the end (0) the operator's
        lease from before the rollout if it still runs, else none. The operator's floor,
        if higher, holds through the rollout too."""
        candidate = serve_name(rollout.spec.group, rollout.spec.to)
        prior, now = rollout.prior_lease, time.time()
        prior_live = prior is not None and float(prior.get("until_s", 0)) > now
        prior_floor = int(prior.get("floor", 0)) if prior is not None and prior_live else 0
        if floor == 0 and prior is not None and prior_live:
            self.leases.put(candidate, prior_floor, float(prior["until_s"]))
        elif floor == 0:
            self.leases.delete(candidate)
        else:
            # Long enough to wake and hold one step; the next step renews it, and a driver
            # that is gone for good lets it lapse.
            until = now + policy.WAKE_TIMEOUT_S + rollout.spec.every_s + 60
            self.leases.put(candidate, max(floor, prior_floor), until)


def driver(app: str) -> Any:
    """The app's rollout driver, started if it is not running (blocking: Ray's GCS)."""
    import ray

    light = light_runtime_env()  # it needs none of the warm runtime's imports
    actor = ray.remote(RolloutDriver).options(
        name=f"ember-rollout:{app}", namespace=_NAMESPACE, lifetime="detached",
        get_if_exists=True, max_restarts=-1, num_cpus=0,
        **({"runtime_env": light} if light else {}))
    return actor.remote(app)


async def call_driver(app: str, method: str, *args: Any) -> Any:
    """Call the driver, once more with a new one if it stopped itself just now."""
    import ray

    for attempt in range(3):
        handle = await asyncio.to_thread(driver, app)
        try:
            return await getattr(handle, method).remote(*args)
        except ray.exceptions.RayActorError:
            if attempt == 2:
                raise
            await asyncio.sleep(0.2)
    return None


async def watch(app: str, rollouts: Mapping[str, Rollout]) -> None:
    """Ask for the driver again if a running rollout's heartbeat went stale."""
    if any(r.state == "running" and time.time() - r.beat_s > STALE_S for r in rollouts.values()):
        logger.warning("a rollout of %s lost its driver; starting it again", app)
        await call_driver(app, "ensure_running")
