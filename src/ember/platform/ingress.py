"""The ingress: one FastAPI app in front of every deployment of an ``ember.App``.

Ray Serve's proxy hands each HTTP request to this deployment, which validates it (size,
JSON, types), routes it through a ``DeploymentHandle`` to the right deployment, and maps
every outcome to a status code: 503 + Retry-After when the queue is full, 504 after
``request_timeout_s`` (and the replica's work is cancelled), 500 with a request id when
user code raises. Scaling from zero needs nothing here: the handle holds the request while
Ray Serve's controller, driven by Ember's policy, starts replicas.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter
from ray import serve
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from ember.errors import (
    DeploymentUnavailable,
    EmberError,
    QueueFull,
    RequestTimeout,
    UserCodeError,
)
from ember.platform._http import (
    GuardMiddleware,
    install_error_handlers,
    request_id_of,
)
from ember.platform.config import DeploymentOptions
from ember.platform.decorator import RouteSpec
from ember.platform.metrics import Metrics
from ember.platform.state import LoadTracker

logger = logging.getLogger("ember.ingress")

_STATUS_POLL_S = 0.5
_DEFAULT_BODY_LIMIT = 1 << 20


class Dispatcher:
    """Sends validated requests to deployments and maps their outcomes to Ember errors."""

    def __init__(
        self,
        handles: dict[str, DeploymentHandle[Any]],
        options: dict[str, DeploymentOptions],
        tracker: LoadTracker,
    ) -> None:
        self._handles = {n: h.options(method_name="ember_call") for n, h in handles.items()}
        self._options = options
        self.tracker = tracker

    async def call(self, route: RouteSpec, body: Any, request_id: str) -> Any:
        """Run ``route``'s handler on a replica and return its result.

        Raises:
            QueueFull: the deployment's queue is at ``max_queue``.
            RequestTimeout: no answer within ``request_timeout_s``; the work is cancelled.
            UserCodeError: the handler raised something that is not an ``EmberError``.
        """
        name = route.deployment
        opts = self._options[name]
        with self.tracker.track(name):
            response = self._handles[name].remote(route.attr, body)
            try:
                return await asyncio.wait_for(_awaitable(response), opts.request_timeout_s)
            except TimeoutError:
                response.cancel()  # type: ignore[no-untyped-call]
                raise RequestTimeout(deployment=name, timeout_s=opts.request_timeout_s) from None
            except BackPressureError:
                load = self.tracker.loads[name]
                raise QueueFull(deployment=name, queued=load.queued, limit=opts.max_queue) from None
            except RayTaskError as exc:
                raise _user_error(name, exc, request_id) from None
            except ActorDiedError as exc:
                raise DeploymentUnavailable(str(exc).splitlines()[0], deployment=name) from None


async def _awaitable(response: Any) -> Any:
    return await response


def _user_error(deployment: str, exc: RayTaskError, request_id: str) -> EmberError:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, EmberError):  # user code may raise Ember errors on purpose
        return cause
    logger.error("request %s: %s raised\n%s", request_id, deployment, exc)
    error_type = type(cause).__name__ if cause is not None else "Exception"
    return UserCodeError(deployment=deployment, error_type=error_type, request_id=request_id)


def _response_model(annotation: Any) -> Any:
    """The annotation if FastAPI can serialize it, else None (returned value is sent as is)."""
    if annotation is None or annotation is inspect.Signature.empty:
        return None
    try:
        TypeAdapter(annotation)
    except Exception:  # arbitrary user types (tensors...) have no schema
        return None
    return annotation


def _endpoint(route: RouteSpec, dispatcher: Dispatcher, metrics: Metrics) -> Callable[..., Any]:
    async def endpoint(request: Request, body: Any = None) -> Any:
        started = time.monotonic()
        status = "200"
        try:
            return await dispatcher.call(route, body, request_id_of(request))
        except EmberError as err:
            status = str(err.status_code)
            reason = {503: "queue_full", 504: "timeout"}.get(err.status_code)
            if reason:
                metrics.rejected.labels(route.deployment, reason).inc()
            raise
        finally:
            metrics.latency.labels(route.deployment, route.path, status).observe(
                time.monotonic() - started
            )

    params = [inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=Request)]
    if route.input_model is not None:
        params.append(
            inspect.Parameter("body", inspect.Parameter.KEYWORD_ONLY, annotation=route.input_model)
        )
    endpoint.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    endpoint.__name__ = f"{route.deployment}_{route.attr.strip('_') or 'call'}"
    return endpoint


class IngressState:
    """Everything the ingress app needs, built once per ingress replica."""

    def __init__(self, app_name: str, routes: list[RouteSpec],
                 options: dict[str, DeploymentOptions], handles: dict[str, DeploymentHandle[Any]]):
        self.app_name = app_name
        self.routes = routes
        self.options = options
        self.metrics = Metrics()
        self.tracker = LoadTracker(options, self.metrics)
        self.dispatcher = Dispatcher(handles, options, self.tracker)
        self._limits = {r.path: options[r.deployment].max_request_bytes for r in routes}
        self._deployment_of = {r.path: r.deployment for r in routes}

    def limit_for(self, path: str) -> int:
        return self._limits.get(path, _DEFAULT_BODY_LIMIT)

    def on_reject(self, path: str, reason: str) -> None:
        self.metrics.rejected.labels(self._deployment_of.get(path, "-"), reason).inc()

    def status(self) -> dict[str, Any]:
        return {
            "app": self.app_name,
            "ready": self.tracker.ready(),
            "deployments": [load.as_dict() for load in self.tracker.loads.values()],
        }

    async def poll_replicas(self) -> None:
        """Keep replica counts fresh without putting the controller on the request path."""
        while True:
            try:
                status = await asyncio.to_thread(serve.status)
                app_status = status.applications.get(self.app_name)
                if app_status is not None:
                    for name, overview in app_status.deployments.items():
                        self.tracker.update_replicas(name, overview)
            except Exception:  # the controller may be restarting; try again next tick
                logger.warning("replica status poll failed", exc_info=True)
            await asyncio.sleep(_STATUS_POLL_S)


def build_fastapi(state: IngressState) -> FastAPI:
    """The ASGI app served by the ingress deployment."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        poller = asyncio.create_task(state.poll_replicas())
        try:
            yield
        finally:
            poller.cancel()

    app = FastAPI(title=f"Ember: {state.app_name}", lifespan=lifespan)
    install_error_handlers(app, state.on_reject)
    for route in state.routes:
        app.add_api_route(
            route.path,
            _endpoint(route, state.dispatcher, state.metrics),
            methods=[route.http_method],
            response_model=_response_model(route.output_model),
            tags=[route.deployment],
        )
    _add_platform_routes(app, state)
    app.add_middleware(GuardMiddleware, limit_for=state.limit_for, on_reject=state.on_reject)
    return app


def _add_platform_routes(app: FastAPI, state: IngressState) -> None:
    routes: dict[str, Callable[[], Awaitable[Response]]] = {}

    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz() -> Response:
        ready = state.tracker.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    async def status() -> Response:
        return JSONResponse(state.status())

    routes.update({"/healthz": healthz, "/readyz": readyz, "/metrics": metrics,
                   "/-/status": status})
    for path, fn in routes.items():
        app.add_api_route(path, fn, methods=["GET"], include_in_schema=False)


@serve.ingress()
class EmberIngress:
    """Ray Serve deployment hosting the FastAPI app; handles arrive as constructor args."""

    def __init__(self, app_name: str, routes: list[RouteSpec],
                 options: dict[str, DeploymentOptions],
                 handles: dict[str, DeploymentHandle[Any]]) -> None:
        self._state = IngressState(app_name, routes, options, handles)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi(self._state)


__all__ = ["EmberIngress", "IngressState", "build_fastapi"]
