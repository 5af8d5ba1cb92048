"""The edge's rollout routes: start, read and end a rollout of a deployment.

``PUT /-/rollout/{deployment}`` starts a rollout (``control/rollout.py`` says what one is),
``GET`` reads it, ``POST /-/rollback/{deployment}`` ends it with all traffic on stable. The
rollout itself runs in the control plane's driver (``control/rollout_driver.py``), which
goes on after the caller and the edge that took the request are gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from ember.app.config import DeploymentOptions
from ember.control import rollout as policy
from ember.control.rollout import Rollout
from ember.control.rollout_driver import RolloutStore, call_driver, serve_name
from ember.control.traffic import stable_only
from ember.edge._strict_json import read_json
from ember.errors import Conflict, NotFound


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
        began = await call_driver(app_name, "begin", spec_json, max_replicas)
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
            ended = await call_driver(app_name, "rollback", deployment,
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
