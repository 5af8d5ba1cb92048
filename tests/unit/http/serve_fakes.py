"""Stand-ins for Ray Serve's deployment handles, so the ingress runs without a cluster.

They fake only what Ember's ``Dispatcher`` uses of a ``DeploymentHandle``:
``handle.options(method_name=...)``, ``.remote(*args)``, awaiting the response and
``response.cancel()``. As with Ray, a response starts its work when it is sent (an asyncio
task here), a response passed to another handle's ``remote`` is resolved to its value before
that replica runs (how pipeline stages chain), and an exception raised by user code comes
back wrapped in ``RayTaskError`` while Ray's own errors (a dead actor, back pressure) come
back as they are.

Example:
    >>> async def double(attr: str, body: int) -> int:
    ...     return body * 2
    >>> fake = FakeHandle(double)
    >>> asyncio.run(_send(fake, "__call__", 21)), fake.count("ember_call")
    (42, 1)
"""

from __future__ import annotations

import asyncio
import inspect
import time
import traceback
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, cast

from ray import cloudpickle
from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from ember.control.pool import PoolAnswer

#: What a fake replica runs for ``ember_call``: the call's arguments in, the result out.
Handler = Callable[..., Any]  # a coroutine function, or an async generator one for streams


@dataclass(frozen=True)
class Sent:
    """One ``remote`` call: the replica method and its arguments as the caller passed them."""

    method: str
    args: tuple[Any, ...]


class FakeHandle:
    """A deployment's handle and its replica in one; counts what was sent, ran and cancelled.

    Args:
        handler: runs each ``ember_call`` with its arguments (``attr, body`` for a
            deployment, ``name, attr, body`` for the warm pool).
        refuse: raised for every call before any replica runs, as Ray's router raises
            ``BackPressureError`` when the queue is full.
        timeline: what ``ember_ping`` answers (a replica's start marks).
        no_replica: calls wait, never assigned to a replica, as at zero replicas.
    """

    def __init__(self, handler: Handler | None = None, *, refuse: BaseException | None = None,
                 timeline: dict[str, Any] | None = None, no_replica: bool = False) -> None:
        self.handler = handler or _echo
        self.refuse = refuse
        self.no_replica = no_replica
        self.timeline = timeline if timeline is not None else started_just_now()
        self.sent: list[Sent] = []
        #: Calls that reached the replica (not refused by the router).
        self.ran: list[Sent] = []
        self.responses: list[FakeResponse] = []

    def options(self, *, method_name: str, stream: bool = False,
                **_transport: Any) -> _MethodHandle:
        return _MethodHandle(self, method_name, stream)

    def count(self, method: str) -> int:
        """How many calls of ``method`` were sent."""
        return sum(1 for sent in self.sent if sent.method == method)

    @property
    def cancels(self) -> int:
        """How many times a response of this deployment was cancelled."""
        return sum(response.cancels for response in self.responses)

    def send(self, sent: Sent) -> FakeResponse:
        self.sent.append(sent)
        loop = asyncio.get_running_loop()
        assigned: asyncio.Future[None] = loop.create_future()
        response = FakeResponse(loop.create_task(self._serve(sent, assigned)), assigned)
        self.responses.append(response)
        return response

    async def _serve(self, sent: Sent, assigned: asyncio.Future[None]) -> Any:
        args = tuple([await a if isinstance(a, FakeResponse) else a for a in sent.args])
        if self.refuse is not None:
            raise self.refuse
        if self.no_replica:
            await asyncio.Event().wait()  # queued until cancelled: no replica ever comes
        assigned.set_result(None)
        self.ran.append(Sent(sent.method, args))
        if sent.method == "ember_ping":
            return self.timeline
        try:
            return await self.handler(*args)
        except (RayError, RayServeException):  # Ray's own failures reach the caller as is
            raise
        except Exception as exc:
            raise ray_task_error(exc) from None


class _MethodHandle:
    """``handle.options(method_name=...)``: sends calls of one replica method."""

    def __init__(self, handle: FakeHandle, method: str, stream: bool = False) -> None:
        self._handle = handle
        self._method = method
        self._stream = stream

    def options(self, *, method_name: str | None = None, **_transport: Any) -> _MethodHandle:
        return _MethodHandle(self._handle, method_name or self._method, self._stream)

    def remote(self, *args: Any) -> Any:  # a FakeResponse, or a FakeStream for streams
        if self._stream:  # the handler is an async generator function
            self._handle.ran.append(Sent(self._method, args))
            return FakeStream(self._handle.handler(*args))
        return self._handle.send(Sent(self._method, args))


class FakeStream:
    """A ``DeploymentResponseGenerator``: the handler's chunks, cancellable."""

    def __init__(self, chunks: Any) -> None:
        self._chunks = chunks
        self.cancels = 0

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        return await self._chunks.__anext__()

    def cancel(self) -> None:
        self.cancels += 1


class FakeResponse:
    """A ``DeploymentResponse``: awaitable once sent, cancellable (a no-op once done).

    ``_replica_result_future`` is Serve's own name for "assigned to a replica" (done then).
    """

    def __init__(self, task: asyncio.Task[Any], assigned: asyncio.Future[None]) -> None:
        self.task = task
        self._replica_result_future = assigned
        self.cancels = 0

    def __await__(self) -> Generator[Any, None, Any]:
        return self.task.__await__()

    def cancel(self) -> None:
        self.cancels += 1
        self.task.cancel()


def as_handle(fake: FakeHandle) -> DeploymentHandle[Any]:
    """``fake`` typed as what the ingress is given."""
    return cast("DeploymentHandle[Any]", fake)


def replica_of(cls: type) -> Handler:
    """A handler that runs ``cls``'s methods, as Ember's replica wrapper does."""
    instance = cls()
    setup = getattr(instance, "setup", None)
    if callable(setup):
        setup()

    async def handler(attr: str, body: Any) -> Any:
        result = getattr(instance, attr)(body)
        return await result if inspect.isawaitable(result) else result

    return handler


def pool_of(*classes: type) -> Handler:
    """The warm pool's ``ember_call``: serves any of ``classes`` by name, with its timeline."""
    replicas = {cls.__name__: replica_of(cls) for cls in classes}

    async def handler(name: str, attr: str, body: Any) -> PoolAnswer:
        setup_started = time.time()
        value = await replicas[name](attr, body)
        # A prewarmed pool process that constructed the deployment for this request.
        timeline = {**started_just_now(), "prewarmed": True,
                    "init_started_at": setup_started, "setup_s": 0.118, "warmup_s": 0.021}
        return PoolAnswer(False, value, timeline)

    return handler


def scripted(*outcomes: Any) -> Handler:
    """A handler that answers each call with the next outcome, raising those that are errors."""
    remaining = list(outcomes)

    async def handler(*args: Any) -> Any:
        outcome = remaining.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return handler


async def hang(*args: Any) -> Any:
    """A handler that never answers (until cancelled)."""
    await asyncio.Event().wait()


def started_just_now() -> dict[str, Any]:
    """``ReplicaTimeline`` fields of a replica whose process started a moment ago."""
    now = time.time()
    return {"process_started_at": now, "imported_at": now, "init_started_at": now,
            "setup_s": 0.0, "warmup_s": 0.0, "ready_at": now, "prewarmed": False}


def ray_task_error(exc: Exception) -> RayTaskError:
    """``exc`` as Ray Serve raises a replica's exception to the caller.

    The replica wraps it in ``RayTaskError`` and pickles it; the caller's side unpickles it
    and raises ``as_instanceof_cause()``, an instance of both (``replica_result.py``).
    """
    trace = "".join(traceback.format_exception(exc))
    # Ray's exceptions and cloudpickle are untyped.
    error = RayTaskError("ember_call", trace, exc,  # type: ignore[no-untyped-call]
                         proctitle="ray::ServeReplica:fake", pid=1, ip="127.0.0.1")
    wire = cloudpickle.dumps(error)  # type: ignore[no-untyped-call]
    received = cast(RayTaskError, cloudpickle.loads(wire))
    return cast(RayTaskError, received.as_instanceof_cause())  # type: ignore[no-untyped-call]


async def _echo(*args: Any) -> Any:
    return args[-1]


async def _send(fake: FakeHandle, attr: str, body: Any) -> Any:
    return await fake.options(method_name="ember_call").remote(attr, body)
