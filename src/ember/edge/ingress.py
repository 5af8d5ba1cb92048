"""The ingress app: one FastAPI app in front of every deployment of an ``ember.App``.

Each edge (``edge.py``) serves it: it validates a request (size, JSON, types), routes it
through a ``DeploymentHandle`` (see ``_dispatch.py``) and answers with the right status.
Scaling from zero needs nothing here: the handle holds the request while Ray Serve's
controller, driven by Ember's policy, starts replicas.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from pydantic_core import to_jsonable_python
from ray.serve.handle import DeploymentHandle
from starlette.routing import BaseRoute, Match, Router
from starlette.types import Scope

from ember import ray_internals, settings
from ember.app.config import DeploymentOptions, check_name
from ember.app.decorator import RouteSpec
from ember.control import floors, listeners, placement, pool
from ember.control.backoff import next_interval_s
from ember.edge._asgi import (
    COLD_START_HEADER,
    ColdStartHeaderMiddleware,
    GuardMiddleware,
    error_body,
    install_error_handlers,
    note_cold_start,
    note_header,
    request_id_of,
)
from ember.edge._dispatch import Dispatcher
from ember.edge._metrics import EdgeBoard, Metrics
from ember.edge._replica_states import read_replica_states
from ember.edge._route_types import body_parameter, response_model, single_item
from ember.edge._state import LoadTracker
from ember.edge._strict_json import (
    ContentEncodingMiddleware,
    HeaderLimitMiddleware,
    parse_json,
)
from ember.edge.auth import ADMIN_PREFIX, ApiKeys, AuthMiddleware
from ember.edge.drain import DrainGate, DrainMiddleware
from ember.edge.protocols import Protocol
from ember.edge.ratelimit import RateLimiter, RateLimitMiddleware
from ember.edge.rollouts import add_rollout_routes
from ember.edge.versions import VERSION_HEADER, Versions, add_traffic_routes
from ember.errors import BadRequest, EmberError, InvalidBody, NotFound

logger = logging.getLogger("ember.ingress")

#: Replica states are read this often after a change, backing off to _STEADY_POLL_S while
#: they stand still (``control/backoff``): requests find a deployment's replicas through
#: their handle's router, so these counts only back it up, and feed status and metrics.
_STATUS_POLL_S = 1.0
_STEADY_POLL_S = 3.0
_FAST_POLL_S = 0.25
_PUBLISH_EVERY_S = 1.0
#: A report that has not changed is published again after this long: other edges drop one
#: silent for ``EdgeReports.STALE_S``.
_REPUBLISH_S = 10.0
_DEFAULT_BODY_LIMIT = 1 << 20
#: Body limit of admin routes, read-only methods and paths no route serves: all they take is
#: a small JSON document, if anything.
SMALL_BODY_LIMIT = 64 << 10
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass
class _PollMemo:
    """What the replica poll last saw and last published, to tell a change from none."""

    states: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    checked_at: float = -_PUBLISH_EVERY_S
    report: tuple[bytes, str] | None = None
    written_at: float = 0.0


class IngressState:
    """Everything the ingress app needs, built once per ingress replica."""

    def __init__(self, app_name: str, routes: list[RouteSpec],
                 options: dict[str, DeploymentOptions], handles: dict[str, DeploymentHandle[Any]],
                 timeouts: dict[str, float], protocols: tuple[Protocol, ...] = (),
                 pool: DeploymentHandle[Any] | None = None,
                 pool_names: frozenset[str] = frozenset(),
                 keys: ApiKeys | None = None, limiter: RateLimiter | None = None, *,
                 gpu_pool: DeploymentHandle[Any] | None = None,
                 gpu_pool_names: frozenset[str] = frozenset(),
                 versions: dict[str, tuple[str, ...]] | None = None,
                 labels: dict[str, str] | None = None) -> None:
        self.app_name = app_name
        # Read in the process that deploys (where the operator set them); only key digests
        # travel to the ingress.
        self.keys = keys if keys is not None else ApiKeys([])
        self.limiter = limiter
        self.options = options
        self.max_lease_s = settings.load().max_lease_s
        self.routes = routes
        self.protocols = protocols
        self.metrics = Metrics()
        #: Set by the edge that serves this state: the other edges' metrics and status.
        self.board: EdgeBoard | None = None
        self._memo = _PollMemo()
        self.tracker = LoadTracker(options, self.metrics)
        #: The serving process's phase as this ingress last read it (see ``drain.py``).
        self.gate = DrainGate()
        self.dispatcher = Dispatcher(handles, options, self.tracker, timeouts, pool, pool_names,
                                     gpu_pool, gpu_pool_names)
        self.tracker.pool_expected = pool is not None
        self.tracker.gpu_pool_expected = gpu_pool is not None
        self._limits: dict[tuple[str, str], int] = {
            (r.http_method, r.path): options[r.deployment].max_request_bytes for r in routes}
        self._deployment_of = {r.path: r.deployment for r in routes}
        #: Set by ``build_fastapi``: the routes a body limit is looked up in, and the
        #: protocol that added each of its routes (by the route's id).
        self.router: Router | None = None
        self.protocol_routes: dict[int, Protocol] = {}
        self.body_timeout_s = settings.load().body_timeout_s
        self.versions = Versions(app_name, versions or {r.deployment: (r.deployment,)
                                                        for r in routes if not r.chain},
                                 labels or {})

    def limit_for(self, scope: Scope) -> int:
        """Route first: the body limit of the route the request matches, its deployment's
        (a templated path's too); a protocol's route, the largest of the deployments it may
        call (the one its path names, where it does); admin, read-only and unknown paths,
        ``SMALL_BODY_LIMIT``."""
        method, path = scope["method"], scope["path"]
        if (method, path) in self._limits:
            return self._limits[(method, path)]
        if path.startswith(ADMIN_PREFIX) or method not in _BODY_METHODS or self.router is None:
            return SMALL_BODY_LIMIT
        for route in self.router.routes:
            match, child = route.matches(scope)
            if match == Match.FULL:
                return self._limit_of(route, method, child.get("path_params", {}))
        return SMALL_BODY_LIMIT

    def _limit_of(self, route: BaseRoute, method: str, path_params: dict[str, Any]) -> int:
        template = str(getattr(route, "path", ""))
        if (method, template) in self._limits:
            return self._limits[(method, template)]
        protocol = self.protocol_routes.get(id(route))
        if protocol is None:  # a route Ember added itself (the platform's): small bodies
            return SMALL_BODY_LIMIT
        named = protocol.deployment_for(path_params)
        names = [named] if named is not None else protocol.deployments()
        return max([self.options[n].max_request_bytes for n in names if n in self.options],
                   default=_DEFAULT_BODY_LIMIT)

    def on_reject(self, path: str, reason: str) -> None:
        self.metrics.rejected.labels(self._deployment_of.get(path, "-"), reason).inc()

    def status(self) -> dict[str, Any]:
        return {
            "app": self.app_name,
            "ready": self.ready(),
            "deployments": [{**load.as_dict(), **self.versions.row(load.name)}
                            for load in self.tracker.loads.values()],
            # Which edge answered, and how many run: what an operator (or a chaos test)
            # needs to see the edges come back.
            "edges": {"running": self.tracker.edges_running, "pid": os.getpid()},
            "ray": _ray_access(),
        }

    # The Gateway protocol adapters use.
    async def call(self, deployment: str, attr: str, body: Any, request_id: str) -> Any:
        outcome = await self.dispatcher.call_attr(deployment, attr, body, request_id)
        if outcome.cold is not None:
            note_cold_start(outcome.cold.header())
        return outcome.value

    async def stream(self, deployment: str, attr: str, body: Any, request_id: str, *,
                     model_id: str | None = None) -> AsyncIterator[Any]:
        route = RouteSpec(path=f"{deployment}.{attr}", http_method="POST", deployment=deployment,
                          attr=attr, input_model=None, output_model=None, is_async=True,
                          is_stream=True)
        async for chunk in self.dispatcher.stream(
                route, body, request_id, on_cold=lambda report: note_cold_start(report.header()),
                model_id=model_id):
            yield chunk

    @property
    def registry(self) -> CollectorRegistry:
        return self.metrics.registry

    def ready(self) -> bool:
        return self.gate.serving and self.tracker.ready()

    async def poll_once(self) -> bool:
        """Read every deployment's replica states from Serve's controller once.

        Returns:
            Whether any deployment's states or status differ from the last read.
        """
        overviews = await asyncio.to_thread(read_replica_states, self.app_name)
        states = {name: (sorted(o.replica_states.items()), o.status, o.message)
                  for name, o in overviews.items()}
        changed, self._memo.states = states != self._memo.states, states
        for name, overview in overviews.items():
            self.tracker.update_replicas(name, overview)
        await self._check_placement()
        self.tracker.polled = True
        # At most once a second for a scrape and for the pool's failed preloads (they change
        # only when a pool replica starts); fast polls (0.25 s) need not repeat them.
        now = time.monotonic()
        if now - self._memo.checked_at < _PUBLISH_EVERY_S:
            return changed
        self._memo.checked_at = now
        await self.versions.refresh()
        if self.tracker.pool_expected or self.tracker.gpu_pool_expected:
            failures = await asyncio.to_thread(pool.read_failures, self.app_name)
            self.tracker.update_pool_failures(failures)
        # A report written counts as a change: an edge under traffic keeps publishing (and
        # polling) every second for the rollouts, scrapes and status that read the reports.
        return await self._publish(now) or changed

    async def _publish(self, now: float) -> bool:
        """This edge's metrics and status for the other edges, when they changed (or are
        about to go stale): an idle edge does not rewrite the same report every second.

        Returns:
            Whether a changed report was written.
        """
        if self.board is None:
            return False
        status = self.status()
        report = (self.metrics.render(), json.dumps(status, sort_keys=True, default=str))
        if report == self._memo.report and now - self._memo.written_at < _REPUBLISH_S:
            return False
        await asyncio.to_thread(self.board.publish, report[0], status)
        changed = report != self._memo.report
        self._memo.report, self._memo.written_at = report, now
        return changed

    async def _check_placement(self) -> None:
        """Say why a starting replica waits, when Ray has no node with room for it."""
        starting = self.tracker.unplaced()
        for load in self.tracker.loads.values():
            if load not in starting:
                load.waiting_for = None
        if not starting:
            return
        try:
            pending, free = await asyncio.to_thread(placement.cluster_view)
        except Exception:  # best effort: without the view, requests wait as they would
            logger.debug("cluster resource view unavailable", exc_info=True)
            return
        for load in starting:
            need = placement.replica_shape(load.options.num_cpus, load.options.num_gpus)
            load.waiting_for = placement.unplaceable(need, pending=pending, free=free)

    async def status_all(self) -> dict[str, Any]:
        """The status, with every other edge's request counts added when there are others."""
        own = self.status()
        return own if self.board is None else await asyncio.to_thread(self.board.status_all,
                                                                      own)

    async def render_metrics(self) -> bytes:
        """This edge's metrics, with every other edge's when it runs beside others."""
        own = self.metrics.render()
        return own if self.board is None else await asyncio.to_thread(self.board.render_all,
                                                                       own)

    async def poll_replicas(self) -> None:
        """Keep replica counts fresh without putting the controller on the request path.

        Polls every second after a change, backing off to every :data:`_STEADY_POLL_S` while
        nothing changes, and four times a second while a deployment is changing size
        (replicas starting, or requests waiting at zero), when a fresh count decides where
        requests go. A request that finds a deployment cold cuts the wait short.
        """
        period = _STATUS_POLL_S
        while True:
            changed = True
            try:
                changed = await self.poll_once()
            except Exception:  # the controller may be restarting; try again next tick
                logger.warning("replica status poll failed", exc_info=True)
            period = next_interval_s(period, changed=changed, fast_s=_STATUS_POLL_S,
                                     slow_s=_STEADY_POLL_S)
            await self.tracker.next_poll(_FAST_POLL_S if self.tracker.changing() else period)


def _endpoint(route: RouteSpec, state: IngressState) -> Callable[..., Any]:
    dispatcher, metrics = state.dispatcher, state.metrics
    single = single_item(route)

    async def endpoint(request: Request, response: Response, body: Any = None) -> Any:
        if route.is_stream:
            return _sse(dispatcher.stream(route, body, request_id_of(request)),
                        request_id_of(request))
        started = time.monotonic()
        status, chosen, label, value, routed = "200", route, "1", None, False
        one = single is not None and not isinstance(body, list)
        payload = [body] if one else body
        try:
            chosen, label = state.versions.route(route, request.headers)
            routed = True
            note_header(VERSION_HEADER, label)  # on the answer, and on an error from it
            outcome = await dispatcher.call(chosen, payload, request_id_of(request))
            if outcome.cold is not None:
                response.headers[COLD_START_HEADER] = outcome.cold.header()
            value = outcome.value
            return value[0] if one else value
        except EmberError as err:
            status = str(err.status_code)
            reason = {503: "queue_full", 504: "timeout"}.get(err.status_code)
            if reason:
                metrics.rejected.labels(chosen.deployment, reason).inc()
            raise
        finally:
            took = time.monotonic() - started
            metrics.latency.labels(chosen.deployment, route.path, status, label).observe(took)
            copy = state.versions.shadow_route(route, label) if routed else None
            if copy is not None:  # after the answer: the caller never waits for the copy
                state.versions.shadow(dispatcher.call, metrics, copy, payload,
                                      (status, value, took), request_id_of(request))

    params = [inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=Request),
              inspect.Parameter("response", inspect.Parameter.KEYWORD_ONLY, annotation=Response)]
    body_param = body_parameter(route)
    if body_param is not None:
        params.append(body_param)
    endpoint.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    endpoint.__name__ = route.path.strip("/").replace("/", "_") or "root"
    return endpoint


def _sse(chunks: AsyncIterator[Any], request_id: str) -> StreamingResponse:
    """Server-sent events: one ``data:`` event per chunk, sent as soon as it exists."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(to_jsonable_python(chunk))}\n\n"
        except EmberError as err:  # headers are gone: report in-band, as SSE APIs do
            yield f"event: error\ndata: {json.dumps(error_body(err, request_id))}\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def build_fastapi(state: IngressState) -> FastAPI:
    """The ASGI app served by the ingress deployment."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        poller = asyncio.create_task(state.poll_replicas())
        watcher = asyncio.create_task(state.versions.watch_store())
        try:
            yield
        finally:
            poller.cancel()
            watcher.cancel()

    # No redirects: a path that does not match is a 404, never a 307 to some other path.
    app = FastAPI(title=f"Ember: {state.app_name}", lifespan=lifespan, redirect_slashes=False)
    app.router.route_class = _strict_json_route(state)
    install_error_handlers(app, state.on_reject)
    for route in state.routes:
        app.add_api_route(route.path, _endpoint(route, state), methods=[route.http_method],
                          response_model=response_model(route), tags=[route.deployment])
    for protocol in state.protocols:
        before = len(app.router.routes)
        protocol.install(app, state)
        state.protocol_routes.update(dict.fromkeys(map(id, app.router.routes[before:]),
                                                   protocol))
    _add_platform_routes(app, state)
    state.router = app.router
    # Starlette runs the last middleware added first: header limit, then auth (so no
    # unauthenticated body is ever read), per-key rate limit, encoding, body size, and the
    # cold-start header of protocol routes.
    app.add_middleware(ColdStartHeaderMiddleware)
    app.add_middleware(GuardMiddleware, limit_for=state.limit_for, on_reject=state.on_reject,
                       body_timeout_s=state.body_timeout_s)
    app.add_middleware(ContentEncodingMiddleware, on_reject=state.on_reject)
    app.add_middleware(RateLimitMiddleware, limiter=state.limiter, on_reject=state.on_reject)
    app.add_middleware(AuthMiddleware, keys=state.keys, on_reject=state.on_reject)
    app.add_middleware(HeaderLimitMiddleware, on_reject=state.on_reject)
    # Outermost: a draining server refuses new requests before any other work.
    app.add_middleware(DrainMiddleware, gate=state.gate)
    return app


def _strict_json_route(state: IngressState) -> type[APIRoute]:
    """Routes whose JSON bodies go through Ember's strict parser before FastAPI's validation.

    The strict parser refuses what ``json.loads`` would accept but no client should send
    (NaN, 1e999, duplicate keys, 100,000-deep nesting) with a 400 that says why.
    """

    class StrictJSONRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            if self.body_field is None:
                # No body parameter: FastAPI never parses this body, the handler reads it
                # (the Open Inference route, for Triton's binary tensor extension).
                return handler

            async def strict(request: Request) -> Response:
                body = await request.body()
                if body:
                    try:
                        # FastAPI's request.json() reuses Starlette's cache of the parsed body.
                        request._json = parse_json(body)
                    except EmberError:
                        state.on_reject(request.url.path, "malformed_json")
                        raise
                    _default_to_json(request)
                return await handler(request)

            return strict

    return StrictJSONRoute


def _default_to_json(request: Request) -> None:
    """Read a body sent without ``Content-Type`` as JSON, as Triton and KServe do.

    Triton's own HTTP client sends JSON with no content type; FastAPI would not parse it.
    """
    headers = request.scope["headers"]
    if not any(key == b"content-type" and value for key, value in headers):
        request.scope["headers"] = [*(h for h in headers if h[0] != b"content-type"),
                                    (b"content-type", b"application/json")]
        request.__dict__.pop("_headers", None)  # Starlette caches the parsed headers


def _add_platform_routes(app: FastAPI, state: IngressState) -> None:
    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz() -> Response:
        ready = state.ready()
        return JSONResponse({"ready": ready, "phase": state.gate.phase},
                            status_code=200 if ready else 503)

    async def metrics() -> Response:
        return Response(await state.render_metrics(), media_type="text/plain; version=0.0.4")

    async def status() -> Response:
        return JSONResponse(await state.status_all())

    routes: dict[str, Callable[[], Awaitable[Response]]] = {
        "/healthz": healthz, "/readyz": readyz, "/metrics": metrics, "/-/status": status}
    for path, fn in routes.items():
        app.add_api_route(path, fn, methods=["GET"], include_in_schema=False)
    _add_lease_routes(app, state)
    add_traffic_routes(app, state.versions)
    add_rollout_routes(app, state.app_name, state.versions, state.options)


def _check_lease(state: IngressState, deployment: str, seconds: float, floor: int) -> None:
    """Refuse a lease longer than ``EMBER_MAX_LEASE_S`` or a floor above ``max_replicas``."""
    if seconds > state.max_lease_s:
        raise BadRequest(f"for={seconds:g}s is over the lease limit of {state.max_lease_s:g}s "
                         f"({settings.variable('max_lease_s')})", param="for")
    cap = state.options[deployment].max_replicas
    if floor > cap:
        raise BadRequest(f"floor={floor} is over {deployment}'s max_replicas of {cap}",
                         param="floor")


def _add_lease_routes(app: FastAPI, state: IngressState) -> None:
    """``POST /-/warm/{deployment}?for=600&floor=1`` holds a floor for a while; DELETE ends it."""

    def check(deployment: str) -> None:
        check_name(deployment, "deployment")
        if deployment not in state.tracker.loads:
            raise NotFound(method="warm", path=f"/-/warm/{deployment}")

    async def warm(deployment: str, duration: Annotated[str, Query(alias="for")] = "600",
                   floor: Annotated[int, Query(ge=1)] = 1) -> Response:
        check(deployment)
        try:
            seconds = floors.parse_duration(duration)
        except ValueError as exc:
            raise InvalidBody(str(exc)) from None
        _check_lease(state, deployment, seconds, floor)
        until = time.time() + seconds
        await asyncio.to_thread(floors.LeaseStore(state.app_name).put, deployment, floor, until)
        return JSONResponse({"deployment": deployment, "floor": floor, "until_s": until})

    async def unwarm(deployment: str) -> Response:
        check(deployment)
        await asyncio.to_thread(floors.LeaseStore(state.app_name).delete, deployment)
        return JSONResponse({"deployment": deployment, "floor": 0})

    app.add_api_route("/-/warm/{deployment}", warm, methods=["POST"], include_in_schema=False)
    app.add_api_route("/-/warm/{deployment}", unwarm, methods=["DELETE"],
                      include_in_schema=False)


__all__ = ["IngressState", "build_fastapi"]


def _ray_access() -> dict[str, str | None] | None:
    """How a second shell reaches this edge's Ray cluster (``ray status``, ``serve status``)."""
    import ray

    if not ray.is_initialized():
        return None
    return dict(_cluster_access())


@functools.cache
def _cluster_access() -> dict[str, str | None]:
    # Read once per edge: the cluster's addresses do not change under it, and whether its
    # dashboard listens takes a GCS read and a connection, not to be paid per status call.
    import ray

    # Workers inherit the driver's RAY_AUTH_MODE, which Ray sets when it turns tokens on.
    return listeners.cluster_access(ray.get_runtime_context().gcs_address,
                                    token_auth=os.environ.get("RAY_AUTH_MODE") == "token",
                                    dashboard=ray_internals.dashboard_address())
