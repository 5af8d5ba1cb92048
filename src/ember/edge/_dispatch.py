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
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, cast

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from ember import ray_internals
from ember.app.config import DeploymentOptions
from ember.app.decorator import RouteSpec
from ember.control import coldstart
from ember.control.coldstart import ColdStartReport, ReplicaTimeline
from ember.control.pool import PoolAnswer
from ember.edge._router_view import (
    assigned,
    push_fresh_demand_at_zero,
    quiet_idle_pushes,
    running_replicas,
)
from ember.edge._router_view import check_now as check_router_view_now
from ember.edge._state import LoadTracker
from ember.errors import (
    DeploymentUnavailable,
    EmberError,
    QueueFull,
    RequestError,
    RequestTimeout,
    ServiceError,
    UserCodeError,
    WaitingForResources,
    WeightsError,
)

logger = logging.getLogger("ember.ingress")

#: A cold deployment is pinged at most this often while it has no running replica.
_WAKE_EVERY_S = 5.0
_TIMELINE_TIMEOUT_S = 2.0
#: How often a waiting request checks whether its deployment failed to start.
_FAILED_START_POLL_S = 0.5
#: ... and, when the warm pool could take it, whether it is still waiting for a replica.
_REROUTE_POLL_S = 0.1
#: How often a cold request's timeline fetch looks for the new replica (a local read).
_PLACED_POLL_S = 0.01
#: Ray Serve deployment states in which no replica will come without a redeploy.
_FAILED_STATUSES = frozenset({"UNHEALTHY", "DEPLOY_FAILED"})


_GRPC_ENV = "RAY_SERVE_USE_GRPC_BY_DEFAULT"


def _grpc_transport() -> dict[str, Any]:
    """Handle options that send over Serve's gRPC transport where the cluster uses it.

    Ember's local cluster runs Serve with ``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``, but handles
    are built in the deploying process, whose Serve read that variable before Ember set it,
    so they would send by Ray actor call. Serve's own proxy sends over gRPC; so do the edges.
    """
    return ray_internals.handle_by_value_options() if os.environ.get(_GRPC_ENV) == "1" else {}


class _ToPool(Exception):  # a signal inside the dispatcher, never raised out of it
    """A request still waits for a replica of a deployment the warm pool can now serve."""


@dataclass
class Outcome:
    """A handler's result, and how the cold start went if the request met one."""

    value: Any
    cold: ColdStartReport | None = None


class Dispatcher:
    """Calls deployments through their handles on behalf of the ingress."""

    def __init__(
        self,
        handles: dict[str, DeploymentHandle[Any]],
        options: dict[str, DeploymentOptions],
        tracker: LoadTracker,
        timeouts: dict[str, float] | None = None,
        pool: DeploymentHandle[Any] | None = None,
        pool_names: frozenset[str] = frozenset(),
        gpu_pool: DeploymentHandle[Any] | None = None,
        gpu_pool_names: frozenset[str] = frozenset(),
    ) -> None:
        push_fresh_demand_at_zero()  # here, in the edge: the process that holds the handles
        quiet_idle_pushes()
        check_router_view_now()
        self._handles = handles
        grpc = _grpc_transport()
        self._calls = {n: h.options(method_name="ember_call", **grpc)
                       for n, h in handles.items()}
        self._options = options
        self._timeouts = timeouts or {}
        #: The pool that serves each deployment it may serve (CPU or GPU pool).
        self._pool_of: dict[str, Any] = {}
        for handle, names in ((pool, pool_names), (gpu_pool, gpu_pool_names)):
            if handle is not None:
                call = handle.options(method_name="ember_call", **grpc)
                self._pool_of.update(dict.fromkeys(names, call))
        self._gpu_pooled = gpu_pool_names if gpu_pool is not None else frozenset()
        self._woken_at: dict[str, float] = {}
        #: The last failed-start reason logged per deployment.
        self._logged_failures: dict[str, str] = {}
        self._placing: dict[str, asyncio.Future[None]] = {}
        #: When each deployment's router last went from no replica to one (the poll's end).
        self._placed_at: dict[str, float] = {}
        self.tracker = tracker

    def timeout_for(self, route: RouteSpec) -> float:
        return self._timeouts.get(route.path, self._options[route.deployment].request_timeout_s)

    async def call(self, route: RouteSpec, body: Any, request_id: str) -> Outcome:
        """Run ``route`` (a handler, or a pipeline's chain) and return its result.

        Raises:
            QueueFull: a deployment's queue is at ``max_queue``.
            RequestTimeout: no answer within the timeout; the work is cancelled.
            UserCodeError: the handler raised something that is not an ``EmberError``.
        """
        arrived = time.time()
        chain = route.chain or ((route.deployment, route.attr),)
        with self._tracking([name for name, _ in chain]):
            pooled = await self._try_pool(route, body, request_id, arrived)
            if pooled is not None:
                return pooled
            self._refuse_unplaced([name for name, _ in chain])
            self._wake_cold(chain[1:])
            timeline = self._timeline_once_placed(route.deployment)
            try:
                result = await self._send_chain(route, chain, body, request_id,
                                                reroute=not route.chain)
            except _ToPool:  # the last replica went while this request waited for one
                _cancel(timeline)
                pooled = await self._try_pool(route, body, request_id, arrived)
                if pooled is not None:
                    return pooled
                timeline = self._timeline_once_placed(route.deployment, cold=True)
                result = await self._send_chain(route, chain, body, request_id, reroute=False)
            except BaseException:
                _cancel(timeline)
                raise
        if timeline is None:
            return Outcome(result)
        return Outcome(result, await self._replica_report(route.deployment, arrived, timeline))

    async def _send_chain(self, route: RouteSpec, chain: tuple[tuple[str, str], ...],
                          body: Any, request_id: str, *, reroute: bool) -> Any:
        """Send through every stage; retry once if a replica died under a plain request.

        With ``reroute``, a request that still waits for a replica once the warm pool could
        serve it is taken back (``_ToPool``), never left to wait for a fresh replica.
        """
        retry = not route.chain and self._options[route.deployment].retry_on_replica_loss
        while True:
            responses: list[Any] = []
            value: Any = body
            for name, attr in chain:
                value = self._calls[name].remote(attr, value)
                responses.append(value)
            try:
                return await self._await(responses, route, request_id, reroute=reroute)
            except DeploymentUnavailable as err:
                if not (retry and err.fields.get("lost_replica")):
                    raise
                retry = False
                logger.warning("request %s: replica of %s lost; retrying once", request_id,
                               route.deployment)

    def no_own_replica(self, name: str) -> bool:
        """Whether ``name`` has no running replica, as its handle's router sees it now."""
        live = running_replicas(self._calls[name])
        return live == 0 if live is not None else self.tracker.loads[name].running == 0

    def _pool_can_serve(self, name: str) -> bool:
        running = (self.tracker.gpu_pool_running if name in self._gpu_pooled
                   else self.tracker.pool_running)
        return (name in self._pool_of and name not in self.tracker.pool_failures
                and running > 0 and self.no_own_replica(name))

    async def _try_pool(self, route: RouteSpec, body: Any, request_id: str,
                        arrived: float) -> Outcome | None:
        """Serve from the warm pool while the deployment's own replica starts.

        Returns None when the pool cannot take the request (no pool for it, the deployment
        has a replica, or the pool is at the deployment's concurrency cap): the request is
        then held for the deployment's own replica like any other.
        """
        if route.chain or not self._pool_can_serve(route.deployment):
            return None
        name = route.deployment
        self._wake_cold(((name, route.attr),))
        # What the pool serves is the deployment's demand too: a ping held in its queue for
        # as long as the pool works on the request is counted by Serve's autoscaler.
        demand = self._handles[name].options(method_name="ember_ping").remote()
        try:
            response = self._pool_of[name].remote(name, route.attr, body)
            answer: PoolAnswer = await self._await([response], route, request_id,
                                                   reroute=False)
        finally:
            if assigned(demand) is False:
                demand.cancel()  # type: ignore[no-untyped-call]
        if answer.busy:
            return None
        timeline = ReplicaTimeline(**answer.timeline) if answer.timeline else None
        report = coldstart.report(arrived, time.time(), timeline,
                                  coldstart.pool_path(arrived, timeline))
        self.tracker.record_cold(name, report)
        return Outcome(answer.value, report)

    def _timeline_once_placed(self, name: str, *, cold: bool | None = None
                              ) -> asyncio.Task[ReplicaTimeline | None] | None:
        """For a request that finds ``name`` without a running replica: fetch the new
        replica's start timeline as soon as the router has one, while the request runs.

        Asked only after the request is answered, the timeline cost one more round trip to
        the replica on every cold start's answer. None when ``name`` has a replica.
        """
        if not (self.no_own_replica(name) if cold is None else cold):
            return None
        self.tracker.wake_poll()  # its counts may be seconds old: starting, placed, failed
        return asyncio.ensure_future(self._fetch_timeline(name))

    async def _fetch_timeline(self, name: str) -> ReplicaTimeline | None:
        try:
            async with asyncio.timeout(self._options[name].request_timeout_s):
                await asyncio.shield(self._placed(name))
        except Exception:  # never placed in time: the report asks the replica directly
            return None
        return await self._ping_timeline(name)

    async def _ping_timeline(self, name: str) -> ReplicaTimeline | None:
        try:
            ping = self._handles[name].options(method_name="ember_ping").remote()
            return ReplicaTimeline(**await _resolve(ping))
        except Exception:  # phases are best effort; the answer itself is what matters
            logger.debug("no replica timeline for %s", name, exc_info=True)
            return None

    def _placed(self, name: str) -> asyncio.Future[None]:
        """Resolved once ``name``'s router has a replica: one poller per cold deployment,
        however many cold requests wait on it (a burst must not spin one loop each)."""
        waiting = self._placing.get(name)
        if waiting is None or waiting.done():
            waiting = asyncio.ensure_future(self._poll_placed(name))
            self._placing[name] = waiting
        return waiting

    async def _poll_placed(self, name: str) -> None:
        # Bounded like the requests waiting on it; the next cold request starts a new one.
        async with asyncio.timeout(self._options[name].request_timeout_s):
            while self.no_own_replica(name):
                await asyncio.sleep(_PLACED_POLL_S)
        self._placed_at[name] = time.time()

    async def _replica_report(self, name: str, arrived: float,
                              timeline: asyncio.Task[ReplicaTimeline | None]
                              ) -> ColdStartReport:
        """Phases of a cold request served by the deployment's own (new) replica."""
        answered = time.time()
        placed = self._placing.get(name)
        if not timeline.done() and (placed is None or not placed.done()):
            # The router has not said it has the replica (or cannot be read): it exists, since
            # it answered, so ask it now.
            timeline.cancel()
            timeline = asyncio.ensure_future(self._ping_timeline(name))
        try:
            fetched = await asyncio.wait_for(asyncio.shield(timeline), _TIMELINE_TIMEOUT_S)
        except TimeoutError:
            _cancel(timeline)
            fetched = None
        placed_at = self._placed_at.get(name) if placed is not None and placed.done() else None
        report = coldstart.report(arrived, answered, fetched, "replica", placed_at)
        self.tracker.record_cold(name, report)
        return report

    async def call_attr(self, deployment: str, attr: str, body: Any,
                        request_id: str) -> Outcome:
        """Call one handler by name (used by protocol adapters)."""
        route = RouteSpec(path=f"{deployment}.{attr}", http_method="POST", deployment=deployment,
                          attr=attr, input_model=None, output_model=None, is_async=True)
        return await self.call(route, body, request_id)

    async def stream(self, route: RouteSpec, body: Any, request_id: str,
                     on_cold: Callable[[ColdStartReport], None] | None = None,
                     model_id: str | None = None) -> AsyncIterator[Any]:
        """Yield a streaming handler's chunks as they are produced.

        A stream that finds no running replica has its cold start measured like a call's;
        ``on_cold`` gets the report before the first chunk is yielded. ``model_id`` is Ray
        Serve's multiplexed model id: the router prefers a replica that holds that model.
        """
        name = route.deployment
        arrived = time.time()
        timeline = self._timeline_once_placed(name)
        handle = self._handles[name].options(method_name="ember_stream", stream=True)
        if model_id:
            handle = handle.options(multiplexed_model_id=model_id)
        with self.tracker.track(name):
            generator = cast(DeploymentResponseGenerator[Any], handle.remote(route.attr, body))
            try:
                # The first chunk is watched as a call's answer is: a deployment that cannot
                # start is a 503, not a stream that never begins and holds its slot.
                first: Any = self._watch(anext(generator), [name], None)
                while True:
                    try:
                        chunk = await first if first is not None else await anext(generator)
                    except StopAsyncIteration:
                        break
                    first = None
                    if timeline is not None:
                        report = await self._replica_report(name, arrived, timeline)
                        timeline = None
                        if on_cold is not None:
                            on_cold(report)
                    yield chunk
            except Exception as exc:
                raise self._map_error(exc, name, request_id) from None
            finally:
                _cancel(timeline)
                generator.cancel()  # type: ignore[no-untyped-call]  # no-op once finished

    async def _await(self, responses: list[Any], route: RouteSpec, request_id: str, *,
                     reroute: bool = False) -> Any:
        timeout_s = self.timeout_for(route)
        names = [name for name, _ in route.chain] or [route.deployment]
        watch = self._watch(responses[-1], names, route.deployment if reroute else None)
        try:
            return await asyncio.wait_for(watch, timeout_s)
        except TimeoutError:
            for response in responses:  # every stage: nothing keeps computing for no one
                response.cancel()
            raise RequestTimeout(deployment=route.deployment, timeout_s=timeout_s) from None
        except (DeploymentUnavailable, _ToPool):
            for response in responses:
                response.cancel()
            raise
        except Exception as exc:
            raise self._map_error(exc, route.deployment, request_id) from None

    async def _watch(self, response: Any, names: list[str], reroute: str | None) -> Any:
        """Await ``response``; give up with 503 if a deployment it waits for cannot start.

        With ``reroute`` (a deployment name), raise ``_ToPool`` if the request has not reached
        a replica of it while the warm pool could serve it.
        """
        task = asyncio.ensure_future(_resolve(response))
        poll_s = _REROUTE_POLL_S if reroute in self._pool_of else _FAILED_START_POLL_S
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll_s)
                if done:
                    return task.result()
                if (reroute is not None and assigned(response) is False
                        and self._pool_can_serve(reroute)):
                    raise _ToPool
                self._refuse_unplaced(names)
                for name in names:
                    load = self.tracker.loads[name]
                    if load.running == 0 and load.status in _FAILED_STATUSES:
                        raise self._failed_start(name, load.status, load.message)
        finally:
            task.cancel()

    def _failed_start(self, name: str, status: str, detail: str) -> DeploymentUnavailable:
        """A 503 that says only that ``name`` failed to start; the reason (the constructor's
        exception, a loader's error with its URLs) goes to the log and ``ember status``."""
        if self._logged_failures.get(name) != detail:  # once per reason, not per request
            self._logged_failures[name] = detail
            logger.warning("deployment %s failed to start (%s): %s", name, status, detail)
        return DeploymentUnavailable(
            "it failed to start; the operator finds why in the edge log and `ember status`",
            deployment=name)

    def _refuse_unplaced(self, names: list[str]) -> None:
        """503 at once for a stage whose replica no node has room for (see placement.py)."""
        for name in names:
            load = self.tracker.loads[name]
            if load.running == 0 and load.waiting_for:
                raise WaitingForResources(load.waiting_for, deployment=name)

    def _map_error(self, exc: BaseException, name: str, request_id: str) -> BaseException:
        # RayTaskError first: Ray re-raises a replica's error as a subclass of both
        # RayTaskError and the error's own class, so an EmberError raised on purpose
        # arrives as one of these; its cause holds the error as raised.
        if isinstance(exc, RayTaskError):
            return _user_error(name, exc, request_id)
        if isinstance(exc, EmberError):
            return exc
        if isinstance(exc, BackPressureError):
            limit = self._options[name].max_queue
            return QueueFull(deployment=name, queued=self.tracker.loads[name].queued, limit=limit)
        if isinstance(exc, RayActorError):  # the replica process died under this request
            # Ray's message names nodes, processes and actors: the log's, not the caller's.
            logger.warning("request %s: a replica of %s was lost: %s", request_id, name,
                           str(exc).splitlines()[0])
            return DeploymentUnavailable("its replica was lost while serving this request",
                                         deployment=name, lost_replica=True)
        # Over Serve's gRPC transport a handler's exception arrives as raised, unwrapped.
        return _user_error(name, exc, request_id)

    def _wake_cold(self, stages: tuple[tuple[str, str], ...]) -> None:
        """Ping every stage that has no running replica, so all cold starts overlap.

        The ping waits in the deployment's queue like any request, which is what makes Ray
        Serve's controller start a replica; one ping per few seconds is enough.
        """
        now = time.monotonic()
        for name, _ in stages:
            if not self.no_own_replica(name):
                continue
            if now - self._woken_at.get(name, -_WAKE_EVERY_S) >= _WAKE_EVERY_S:
                self._woken_at[name] = now
                self._handles[name].options(method_name="ember_ping").remote()

    @contextmanager
    def _tracking(self, names: list[str]) -> Iterator[None]:
        """Count the request in flight at every stage."""
        with ExitStack() as stack:
            for name in dict.fromkeys(names):
                stack.enter_context(self.tracker.track(name))
            yield


def _cancel(task: asyncio.Task[Any] | None) -> None:
    if task is not None:
        task.cancel()


async def _resolve(response: Any) -> Any:
    return await response


def _user_error(deployment: str, exc: BaseException, request_id: str) -> EmberError:
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    # User code may raise Ember errors on purpose. Those about the request (4xx) or the
    # service's state (a queue, a drain, a deadline) are the caller's to read; any other
    # (a loader's names URLs and paths: the warm pool builds a model, a replica loads an
    # adapter, on a caller's request) goes to the log, and the caller gets the request id.
    if isinstance(cause, (RequestError, ServiceError)):
        return cause
    if isinstance(cause, WeightsError):
        logger.error("request %s: %s could not load its weights: %s", request_id, deployment,
                     cause)
        return DeploymentUnavailable(
            f"it could not load its weights; request id {request_id}", deployment=deployment)
    logger.error("request %s: %s raised\n%s", request_id, deployment, exc)
    error_type = type(cause).__name__ if cause is not None else "Exception"
    return UserCodeError(deployment=deployment, error_type=error_type, request_id=request_id)
