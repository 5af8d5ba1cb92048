"""The edge's side of versions: which version serves a request, and the traffic admin routes.

``PUT /-/traffic/{deployment}`` with ``{"1": 90, "2": 10}`` sets the weights (an admin
route, like everything under ``/-/``); ``GET`` reads them. Bad weights are refused with 400
naming the field and change nothing. The weights are written to the cluster's key-value
store, taken at once by the edge that answered and within a second by the others
(``refresh``). See ``control/traffic.py`` for how a request is routed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from ember.errors import MalformedJSON, NotFound
from ember.platform.control.traffic import Traffic, TrafficStore, parse_weights
from ember.platform.decorator import RouteSpec

#: Response header naming the version that served the request; as a request header, a pin.
VERSION_HEADER = "X-Ember-Version"
#: Request header whose value keeps a caller on one version while the weights stand.
SESSION_HEADER = "X-Ember-Session"


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

    def row(self, name: str) -> dict[str, Any]:
        """``/-/status`` fields of the Serve deployment ``name``."""
        group = self._group_of.get(name, name)
        label = self.labels.get(name, "1")
        return {"group": group, "version": label,
                "weight": self.traffic.weights.get(group, {}).get(label, 100)}

    async def refresh(self) -> None:
        """Take the weights other edges (or an earlier run of this one) stored."""
        if self.versioned:
            self.traffic.update(await asyncio.to_thread(self.store.read))


def add_traffic_routes(app: FastAPI, versions: Versions) -> None:
    """``GET`` and ``PUT /-/traffic/{deployment}`` (admin routes, see the module doc)."""

    def labels_of(deployment: str) -> list[str]:
        labels = versions.traffic.versions.get(deployment)
        if labels is None:
            raise NotFound(method="traffic", path=f"/-/traffic/{deployment}")
        return labels

    async def read(deployment: str) -> Response:
        labels_of(deployment)
        return JSONResponse({"deployment": deployment,
                             "weights": versions.traffic.weights[deployment]})

    async def write(deployment: str, request: Request) -> Response:
        labels = labels_of(deployment)
        try:
            body = await request.json()
        except ValueError as exc:
            raise MalformedJSON(str(exc)) from None
        weights = parse_weights(deployment, labels, body)
        await asyncio.to_thread(versions.store.write, deployment, weights)
        versions.traffic.update({deployment: weights})
        return JSONResponse({"deployment": deployment, "weights": weights})

    app.add_api_route("/-/traffic/{deployment}", read, methods=["GET"], include_in_schema=False)
    app.add_api_route("/-/traffic/{deployment}", write, methods=["PUT"], include_in_schema=False)
