"""Sending requests from the ingress to deployments, and mapping what comes back.

Every outcome becomes an Ember error with its status: a full queue is ``QueueFull`` (503,
at once), a missed deadline is ``RequestTimeout`` (504, and the replica's work is
cancelled, in every stage of a pipeline), a handler's exception is ``UserCodeError`` (500,
logged with its traceback and request id) unless the handler raised an Ember error on
purpose, which passes through with its own status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, cast

from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from ember.errors import (
    DeploymentUnavailable,
    EmberError,
    QueueFull,
    RequestTimeout,
    UserCodeError,
)
from ember.platform.config import DeploymentOptions
from ember.platform.decorator import RouteSpec
from ember.platform.state import LoadTracker

logger = logging.getLogger("ember.ingress")


class Dispatcher:
    """Calls deployments through their handles on behalf of the ingress."""

    def __init__(
        self,
        handles: dict[str, DeploymentHandle[Any]],
        options: dict[str, DeploymentOptions],
        tracker: LoadTracker,
        timeouts: dict[str, float] | None = None,
    ) -> None:
        self._handles = handles
        self._calls = {n: h.options(method_name="ember_call") for n, h in handles.items()}
        self._options = options
        self._timeouts = timeouts or {}
        self.tracker = tracker

    def timeout_for(self, route: RouteSpec) -> float:
        return self._timeouts.get(route.path, self._options[route.deployment].request_timeout_s)

    async def call(self, route: RouteSpec, body: Any, request_id: str) -> Any:
        """Run ``route`` (a handler, or a pipeline's chain) and return its result.

        Raises:
            QueueFull: a deployment's queue is at ``max_queue``.
            RequestTimeout: no answer within the timeout; the work is cancelled.
            UserCodeError: the handler raised something that is not an ``EmberError``.
        """
        chain = route.chain or ((route.deployment, route.attr),)
        with self._tracking([name for name, _ in chain]):
            self._wake_cold(chain[1:])
            responses: list[Any] = []
            value: Any = body
            for name, attr in chain:
                value = self._calls[name].remote(attr, value)
                responses.append(value)
            return await self._await(responses, route, request_id)

    async def call_attr(self, deployment: str, attr: str, body: Any, request_id: str) -> Any:
        """Call one handler by name (used by protocol adapters)."""
        route = RouteSpec(path=f"{deployment}.{attr}", http_method="POST", deployment=deployment,
                          attr=attr, input_model=None, output_model=None, is_async=True)
        return await self.call(route, body, request_id)

    async def stream(self, route: RouteSpec, body: Any, request_id: str) -> AsyncIterator[Any]:
        """Yield a streaming handler's chunks as they are produced."""
        name = route.deployment
        handle = self._handles[name].options(method_name="ember_stream", stream=True)
        with self.tracker.track(name):
            generator = cast(DeploymentResponseGenerator[Any], handle.remote(route.attr, body))
            try:
                async for chunk in generator:
                    yield chunk
            except Exception as exc:
                raise self._map_error(exc, name, request_id) from None
            finally:
                generator.cancel()  # type: ignore[no-untyped-call]  # no-op once finished

    async def _await(self, responses: list[Any], route: RouteSpec, request_id: str) -> Any:
        timeout_s = self.timeout_for(route)
        try:
            return await asyncio.wait_for(_resolve(responses[-1]), timeout_s)
        except TimeoutError:
            for response in responses:  # every stage: nothing keeps computing for no one
                response.cancel()
            raise RequestTimeout(deployment=route.deployment, timeout_s=timeout_s) from None
        except Exception as exc:
            raise self._map_error(exc, route.deployment, request_id) from None

    def _map_error(self, exc: BaseException, name: str, request_id: str) -> BaseException:
        if isinstance(exc, EmberError):
            return exc
        if isinstance(exc, BackPressureError):
            limit = self._options[name].max_queue
            return QueueFull(deployment=name, queued=self.tracker.loads[name].queued, limit=limit)
        if isinstance(exc, RayTaskError):
            return _user_error(name, exc, request_id)
        if isinstance(exc, ActorDiedError):
            return DeploymentUnavailable(str(exc).splitlines()[0], deployment=name)
        return exc

    def _wake_cold(self, stages: tuple[tuple[str, str], ...]) -> None:
        """Ping every later stage that has no running replica, so all cold starts overlap."""
        for name, _ in stages:
            if self.tracker.loads[name].running == 0:
                self._handles[name].options(method_name="ember_ping").remote()

    @contextmanager
    def _tracking(self, names: list[str]) -> Iterator[None]:
        with ExitStack() as stack:
            for name in dict.fromkeys(names):
                stack.enter_context(self.tracker.track(name))
            yield


async def _resolve(response: Any) -> Any:
    return await response


def _user_error(deployment: str, exc: RayTaskError, request_id: str) -> EmberError:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, EmberError):  # user code may raise Ember errors on purpose
        return cause
    logger.error("request %s: %s raised\n%s", request_id, deployment, exc)
    error_type = type(cause).__name__ if cause is not None else "Exception"
    return UserCodeError(deployment=deployment, error_type=error_type, request_id=request_id)
