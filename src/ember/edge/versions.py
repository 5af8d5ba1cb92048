"""The edge's side of versions: which version serves a request, shadow copies, admin routes.

``PUT /-/traffic/{deployment}`` with ``{"1": 90, "2": 10}`` sets the weights (an admin
route, like everything under ``/-/``); ``GET`` reads them. Bad weights are refused with 400
naming the field and change nothing. The weights are written to the cluster's key-value
store, taken at once by the edge that answered and within a second by the others
(``refresh``). See ``control/traffic.py`` for how a request is routed. ``PUT
/-/shadow/{deployment}`` with ``{"to": "2", "percent": 20}`` copies a sample of requests to a
candidate (``control/shadow.py``); :meth:`Versions.shadow` runs one copy after the caller's
answer is on its way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from ember.app.decorator import RouteSpec
from ember.control.rollout import Rollout
from ember.control.shadow import Shadow, distance, parse_shadow
from ember.control.traffic import Traffic, TrafficStore, parse_weights
from ember.edge._metrics import Metrics
from ember.edge._strict_json import read_json
from ember.edge.rollouts import RolloutStore, watch
from ember.errors import EmberError, NotFound

logger = logging.getLogger("ember.ingress")

#: Response header naming the version that served the request; as a request header, a pin.
VERSION_HEADER = "X-Ember-Version"
#: Request header whose value keeps a caller on one version while the weights stand.
SESSION_HEADER = "X-Ember-Session"
#: Copies in flight per edge beyond which requests are not copied: a slow candidate must
#: not pile up work (and memory) on the edge.
_MAX_COPIES = 64


class Versions:
    """Every served deployment's versions, and the traffic between them, for one edge.

    Args:
        app_name: the app, whose key in the store holds the weights.
        versions: deployment name callers know -> Serve deployment names, stable first.
        labels: Serve deployment name -> its version label.
    """

    def __init__(self, app_name: str, versions: Mapping[str, Sequence[str]],
                 labels: Mapping[str, str]) -> None:
        self.store = TrafficStore(app_name)
        self.shadow_store = TrafficStore(app_name, "shadow")
        self.shadows: dict[str, Shadow] = {}
        self.app_name = app_name
        self.rollout_store = RolloutStore(app_name)
        #: Each deployment's latest rollout, running or ended, as last read.
        self.rollouts: dict[str, Rollout] = {}
        self._copies: set[asyncio.Task[None]] = set()  # running copies, kept from the GC
        self.labels = {n: labels.get(n, "1") for names in versions.values() for n in names}
        self.traffic = Traffic({g: [self.labels[n] for n in names]
                                for g, names in versions.items()})
        self._serve_name = {(g, self.labels[n]): n for g, names in versions.items()
                            for n in names}
        self._group_of = {n: g for g, names in versions.items() for n in names}
        self.versioned = any(len(names) > 1 for names in versions.values())

    def route(self, route: RouteSpec, headers: Mapping[str, str]) -> tuple[RouteSpec, str]:
        """The route as the chosen version serves it, and that version's label.

        Raises:
            BadRequest: the request pins a version the deployment does not have.
        """
        group = self._group_of.get(route.deployment)
        if group is None:  # a pipeline's route: its stages are not versioned
            return route, "1"
        label = self.traffic.pick(group, pin=headers.get(VERSION_HEADER),
                                  session=headers.get(SESSION_HEADER))
        name = self._serve_name[(group, label)]
        return (route if name == route.deployment
                else dataclasses.replace(route, deployment=name)), label

    def shadow_route(self, route: RouteSpec, served: str) -> RouteSpec | None:
        """The candidate's route if this request is sampled for a copy, else None."""
        group = self._group_of.get(route.deployment, "")
        shadow = self.shadows.get(group)
        if (shadow is None or shadow.to == served or len(self._copies) >= _MAX_COPIES
                or not shadow.sampled(random.random())):
            return None
        return dataclasses.replace(route, deployment=self._serve_name[(group, shadow.to)])

    def shadow(self, call: Any, metrics: Metrics, route: RouteSpec, body: Any,
               served: tuple[str, Any, float], request_id: str) -> None:
        """Copy a request to the candidate in the background and compare the answers.

        ``call`` is the dispatcher's ``call``; ``served`` is the caller's (status, value,
        seconds).
        """
        task = asyncio.ensure_future(self._compare(call, metrics, route, body, served,
                                                   request_id))
        self._copies.add(task)
        task.add_done_callback(self._copies.discard)

    async def _compare(self, call: Any, metrics: Metrics, route: RouteSpec, body: Any,
                       served: tuple[str, Any, float], request_id: str) -> None:
        status, value, served_s = served
        labels = (route.deployment, self.labels.get(route.deployment, "1"))
        started = time.monotonic()
        try:
            outcome = await call(route, body, f"{request_id}-shadow")
            shadow_status, shadow_value = "200", outcome.value
        except EmberError as err:
            shadow_status, shadow_value = str(err.status_code), None
        except Exception:  # a copy must never hurt the edge; count it and move on
            logger.debug("shadow copy to %s failed", route.deployment, exc_info=True)
            metrics.shadow.labels(*labels, "error").inc()
            return
        took = time.monotonic() - started
        same = shadow_status == status
        metrics.shadow.labels(*labels, "same_status" if same else "status_differs").inc()
        if served_s > 0:
            metrics.shadow_latency_ratio.labels(*labels).observe(took / served_s)
        apart = distance(value, shadow_value) if same and status == "200" else None
        if apart is not None:
            metrics.shadow_distance.labels(*labels).observe(apart)

    def row(self, name: str) -> dict[str, Any]:
        """``/-/status`` fields of the Serve deployment ``name``."""
        group = self._group_of.get(name, name)
        label = self.labels.get(name, "1")
        shadow = self.shadows.get(group)
        rollout = self.rollouts.get(group)
        return {"group": group, "version": label,
                "weight": self.traffic.weights.get(group, {}).get(label, 100),
                "shadow_percent": shadow.percent if shadow and shadow.to == label else 0,
                "rollout": _rollout_row(rollout) if rollout and rollout.spec.to == label
                else None}

    async def refresh(self) -> None:
        """Take the weights and shadows other edges (or an earlier run of this one) stored."""
        if not self.versioned:
            return
        self.traffic.update(await asyncio.to_thread(self.store.read))
        self.rollouts = await asyncio.to_thread(self.rollout_store.read_all)
        await watch(self.app_name, self.rollouts)
        stored = await asyncio.to_thread(self.shadow_store.read)
        for group, labels in self.traffic.versions.items():
            if group in stored:
                try:
                    self.set_shadow(group, parse_shadow(group, labels, stored[group]))
                except EmberError:  # written for an older set of versions
                    continue

    def labels_of(self, group: str) -> list[str]:
        """The version labels of ``group``.

        Raises:
            NotFound: the app has no deployment called ``group``.
        """
        labels = self.traffic.versions.get(group)
        if labels is None:
            raise NotFound(method="traffic", path=f"/-/traffic/{group}")
        return labels

    def note_rollout(self, rollout: Rollout) -> None:
        """Show a rollout this edge just began or ended before the next refresh reads it."""
        self.rollouts[rollout.spec.group] = rollout

    def set_shadow(self, group: str, shadow: Shadow | None) -> None:
        if shadow is None:
            self.shadows.pop(group, None)
        else:
            self.shadows[group] = shadow


def _rollout_row(rollout: Rollout) -> dict[str, Any]:
    """What ``/-/status`` says of a rollout, on its candidate's row."""
    spec = rollout.spec
    return {"state": rollout.state, "phase": rollout.phase, "from": spec.stable,
            "step": rollout.step + 1, "steps": len(spec.steps), "share": rollout.share,
            "reason": rollout.reason, "judged": rollout.judged}


def add_traffic_routes(app: FastAPI, versions: Versions) -> None:
    """``GET`` and ``PUT /-/traffic/{deployment}`` and ``/-/shadow/{deployment}`` (admin
    routes, see the module doc)."""

    labels_of = versions.labels_of

    async def read(deployment: str) -> Response:
        labels_of(deployment)
        return JSONResponse({"deployment": deployment,
                             "weights": versions.traffic.weights[deployment]})

    async def write(deployment: str, request: Request) -> Response:
        weights = parse_weights(deployment, labels_of(deployment), await read_json(request))
        await asyncio.to_thread(versions.store.write, deployment, weights)
        versions.traffic.update({deployment: weights})
        return JSONResponse({"deployment": deployment, "weights": weights})

    app.add_api_route("/-/traffic/{deployment}", read, methods=["GET"], include_in_schema=False)
    app.add_api_route("/-/traffic/{deployment}", write, methods=["PUT"], include_in_schema=False)
    _add_shadow_routes(app, versions)


def _add_shadow_routes(app: FastAPI, versions: Versions) -> None:
    labels_of = versions.labels_of

    async def read_shadow(deployment: str) -> Response:
        labels_of(deployment)
        shadow = versions.shadows.get(deployment)
        return JSONResponse({"deployment": deployment,
                             "shadow": shadow.as_dict() if shadow else {"percent": 0}})

    async def write_shadow(deployment: str, request: Request) -> Response:
        shadow = parse_shadow(deployment, labels_of(deployment), await read_json(request))
        stored = shadow.as_dict() if shadow else {"percent": 0}
        await asyncio.to_thread(versions.shadow_store.write, deployment, stored)
        versions.set_shadow(deployment, shadow)
        return JSONResponse({"deployment": deployment, "shadow": stored})

    app.add_api_route("/-/shadow/{deployment}", read_shadow, methods=["GET"],
                      include_in_schema=False)
    app.add_api_route("/-/shadow/{deployment}", write_shadow, methods=["PUT"],
                      include_in_schema=False)
