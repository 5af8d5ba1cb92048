"""Rollouts in the cluster: the driver that runs them and the edge's admin routes.

``PUT /-/rollout/{deployment}`` starts a rollout (``control/rollout.py`` says what one is),
``GET`` reads it, ``POST /-/rollback/{deployment}`` ends it with all traffic on stable.

A rollout must go on after the CLI that asked for it exits and after an edge restarts, so
neither runs it: :class:`RolloutDriver` is a detached Ray actor, one per app, that wakes
twice a second while a rollout runs and stops itself when none does. Its whole state lives
in the cluster's key-value store (one key per deployment), so a driver that dies is
restarted by Ray and picks up where the last one wrote; an edge that sees a running
rollout's heartbeat go stale asks for the driver again (:func:`watch`).

The driver judges versions on what callers met at the edges: every edge publishes its
metrics to the key-value store once a second (``_metrics.EdgeBoard``), and the driver adds
up their ``ember_request_duration_seconds`` histograms per version. Only the driver writes
a rollout once it has begun, so an edge and the driver never race on one record.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client.parser import text_string_to_metric_families

from ember.app.config import DeploymentOptions
from ember.control import floors
from ember.control import rollout as policy
from ember.control.rollout import Counts, Rollout, RolloutSpec, Tally
from ember.control.traffic import TrafficStore, stable_only
from ember.edge._metrics import EdgeBoard
from ember.edge._strict_json import read_json
from ember.errors import Conflict, NotFound

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
    """Rollouts in Ray's internal key-value store, one key per app and deployment."""

    def __init__(self, app: str) -> None:
        self.prefix = f"rollout:{app}:"

    def read(self, group: str) -> Rollout | None:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(self.prefix + group, namespace=_NAMESPACE)
        return _decode(raw)

    def read_all(self) -> dict[str, Rollout]:
        from ray.experimental import internal_kv

        found = {}
        for key in internal_kv._internal_kv_list(self.prefix, namespace=_NAMESPACE):
            rollout = _decode(internal_kv._internal_kv_get(key, namespace=_NAMESPACE))
            if rollout is not None:
                found[rollout.spec.group] = rollout
        return found

    def write(self, rollout: Rollout) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self.prefix + rollout.spec.group,
                                     json.dumps(rollout.as_json()).encode(), overwrite=True,
                                     namespace=_NAMESPACE)


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
        self.board = EdgeBoard(app, "")
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
                    # Inside the lock: a rollout begun from now on finds no driver, and the
                    # edge that asked makes a new one.
                    import ray

                    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                    return
            await asyncio.sleep(TICK_S)

    def _tick_all(self) -> bool:
        """Tick every running rollout once; whether any still runs."""
        live = False
        for rollout in self.store.read_all().values():
            if rollout.state != "running":
                continue
            counts, running = self._observe(rollout.spec.group)
            now = time.time()
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

    actor = ray.remote(RolloutDriver).options(
        name=f"ember-rollout:{app}", namespace=_NAMESPACE, lifetime="detached",
        get_if_exists=True, max_restarts=-1, num_cpus=0)
    return actor.remote(app)


async def _call_driver(app: str, method: str, *args: Any) -> Any:
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
        await _call_driver(app, "ensure_running")


def add_rollout_routes(app: FastAPI, app_name: str, versions: Any,
                       options: Mapping[str, DeploymentOptions]) -> None:
    """``PUT``/``GET /-/rollout/{deployment}`` and ``POST /-/rollback/{deployment}``;
    ``versions`` is the edge's ``http.versions.Versions``."""
    store = RolloutStore(app_name)

    async def begin(deployment: str, request: Request) -> Response:
        labels = versions.labels_of(deployment)
        spec = policy.parse_rollout(deployment, labels, versions.traffic.weights[deployment],
                                    await read_json(request))
        max_replicas = options[serve_name(deployment, spec.to)].max_replicas
        spec_json = {**asdict(spec), "steps": list(spec.steps)}
        began = await _call_driver(app_name, "begin", spec_json, max_replicas)
        if began is None:
            raise Conflict(f"a rollout of {deployment!r} is already running; "
                           f"`ember rollback {deployment}` ends it")
        versions.note_rollout(Rollout.from_json(began))
        return JSONResponse(began)

    async def read(deployment: str) -> Response:
        versions.labels_of(deployment)
        rollout = await asyncio.to_thread(store.read, deployment)
        if rollout is None:
            raise NotFound(method="GET", path=f"/-/rollout/{deployment} (no rollout yet)")
        return JSONResponse(rollout.as_json())

    async def rollback(deployment: str) -> Response:
        labels = versions.labels_of(deployment)
        last = await asyncio.to_thread(store.read, deployment)
        ended = None
        if last is not None and last.state == "running":
            ended = await _call_driver(app_name, "rollback", deployment,
                                       "rolled back by the operator")
        if ended is None:  # no rollout runs: put everything on the stable version anyway
            weights = (policy.weights_at(last.spec, 0) if last is not None
                       else stable_only(labels))
            await asyncio.to_thread(versions.store.write, deployment, weights)
        else:
            weights = policy.weights_at(Rollout.from_json(ended).spec, 0)
            versions.note_rollout(Rollout.from_json(ended))
        versions.traffic.update({deployment: {**dict.fromkeys(labels, 0), **weights}})
        return JSONResponse({"deployment": deployment, "weights": versions.traffic.weights[
            deployment], "rollout": ended})

    app.add_api_route("/-/rollout/{deployment}", begin, methods=["PUT"], include_in_schema=False)
    app.add_api_route("/-/rollout/{deployment}", read, methods=["GET"], include_in_schema=False)
    app.add_api_route("/-/rollback/{deployment}", rollback, methods=["POST"],
                      include_in_schema=False)
