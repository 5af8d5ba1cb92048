"""The ingress's Dispatcher, driven through fake deployment handles; no cluster.

The Dispatcher, its LoadTracker and the routes (built by ``@ember.deployment``, ``App`` and
``ember.pipeline``) are the real ones; only Ray Serve's handles are faked (``serve_fakes``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import ExitStack
from typing import Any, TypeVar

import pytest
from pydantic import BaseModel
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError
from serve_fakes import FakeHandle, as_handle, hang, pool_of, replica_of, scripted

import ember
from ember.app.decorator import RouteSpec, get_spec
from ember.control.pool import PoolAnswer
from ember.edge._dispatch import Dispatcher, Outcome
from ember.edge._metrics import Metrics
from ember.edge._state import LoadTracker
from ember.errors import (
    DeploymentUnavailable,
    InvalidBody,
    QueueFull,
    RequestTimeout,
    UserCodeError,
)

T = TypeVar("T")
#: Every test finishes in well under this; a regression fails fast instead of hanging.
_TEST_DEADLINE_S = 10.0


class Text(BaseModel):
    text: str


@ember.deployment(route="/echo")
class Echo:
    def __call__(self, body: Text) -> dict[str, str]:
        return {"echo": body.text}


@ember.deployment(route="/busy", max_queue=2, max_ongoing_requests=2)
class Busy:
    def __call__(self, body: Text) -> str:
        return body.text


@ember.deployment(route="/side-effects", retry_on_replica_loss=False)
class SideEffects:
    def __call__(self, body: Text) -> str:
        return body.text


@ember.deployment(route="/gpu-only", warm_pool=False)
class NoPool:
    def __call__(self, body: Text) -> str:
        return body.text


@ember.deployment
class Tokenize:
    def __call__(self, body: Text) -> list[str]:
        return body.text.split()


@ember.deployment
class Encode:
    def __call__(self, tokens: list[str]) -> list[int]:
        return [len(t) for t in tokens]


@ember.deployment
class Pool:
    def __call__(self, lengths: list[int]) -> int:
        return sum(lengths)


PIPELINE = ember.pipeline([Tokenize, Encode, Pool], route="/chain", request_timeout_s=0.05)
APP = ember.App([Echo, Busy, SideEffects, NoPool, PIPELINE], warm_pool=1)
BODY = Text(text="hello cold world")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, _TEST_DEADLINE_S))


def _route(cls: type) -> RouteSpec:
    return get_spec(cls).routes[0]


def _dispatcher(handles: dict[str, FakeHandle], *, pool: FakeHandle | None = None,
                warm: bool = True) -> Dispatcher:
    """A Dispatcher wired as the ingress wires it; ``warm`` gives every deployment a replica."""
    options = {spec.name: spec.options for spec in APP.specs}
    tracker = LoadTracker(options, Metrics())
    for load in tracker.loads.values():
        load.running = 1 if warm else 0
    return Dispatcher({name: as_handle(h) for name, h in handles.items()}, options, tracker,
                      APP.timeouts(), as_handle(pool) if pool is not None else None,
                      frozenset(spec.name for spec in APP.pool_specs()))


def test_full_queue_is_503_with_retry_after_and_never_reaches_a_replica() -> None:
    busy = FakeHandle(replica_of(Busy), refuse=BackPressureError(2, 2))
    dispatcher = _dispatcher({"Busy": busy})

    async def call_behind_three_others() -> Outcome:
        # 1 running replica takes 2 (max_ongoing_requests); 3 others + this one leave 2 queued.
        with ExitStack() as others:
            for _ in range(3):
                others.enter_context(dispatcher.tracker.track("Busy"))
            return await dispatcher.call(_route(Busy), BODY, "req-1")

    with pytest.raises(QueueFull) as info:
        _run(call_behind_three_others())
    assert info.value.status_code == 503
    assert info.value.headers() == {"Retry-After": "1"}
    assert str(info.value) == "deployment 'Busy' has 2 queued requests (limit 2); retry shortly"
    assert busy.count("ember_call") == 1  # refused by the router: no retry either
    assert busy.ran == []


def test_timeout_is_504_and_cancels_every_pipeline_stage() -> None:
    stages = {name: FakeHandle(hang) for name in ("Tokenize", "Encode", "Pool")}
    dispatcher = _dispatcher(stages)
    route = PIPELINE.route_spec()

    with pytest.raises(RequestTimeout) as info:
        _run(dispatcher.call(route, BODY, "req-2"))
    assert info.value.status_code == 504
    # The pipeline's own timeout (0.05 s), not its stages' default of 60 s.
    assert info.value.fields["timeout_s"] == 0.05
    assert info.value.fields["deployment"] == "Tokenize"
    assert {name: h.count("ember_call") for name, h in stages.items()} == {
        "Tokenize": 1, "Encode": 1, "Pool": 1}
    assert {name: h.cancels for name, h in stages.items()} == {
        "Tokenize": 1, "Encode": 1, "Pool": 1}


def test_pipeline_passes_each_stage_result_to_the_next() -> None:
    stages = {cls.__name__: FakeHandle(replica_of(cls)) for cls in (Tokenize, Encode, Pool)}
    outcome = _run(_dispatcher(stages).call(PIPELINE.route_spec(), BODY, "req-3"))
    assert outcome.value == len("hello") + len("cold") + len("world")
    assert [h.ran[0].args[1] for h in stages.values()] == [
        BODY, ["hello", "cold", "world"], [5, 4, 5]]
    assert outcome.cold is None


def test_lost_replica_is_retried_exactly_once() -> None:
    echo = FakeHandle(scripted(ActorDiedError(), {"echo": "second replica"}))
    outcome = _run(_dispatcher({"Echo": echo}).call(_route(Echo), BODY, "req-4"))
    assert outcome.value == {"echo": "second replica"}
    assert echo.count("ember_call") == 2


def test_second_lost_replica_is_503_without_a_third_try() -> None:
    echo = FakeHandle(scripted(ActorDiedError(), ActorDiedError(), "never sent"))
    with pytest.raises(DeploymentUnavailable) as info:
        _run(_dispatcher({"Echo": echo}).call(_route(Echo), BODY, "req-5"))
    assert echo.count("ember_call") == 2
    assert info.value.status_code == 503
    assert info.value.headers() == {"Retry-After": "1"}
    assert info.value.fields["lost_replica"] is True
    # Ray's own message (nodes, processes, actor ids) stays in the log.
    assert str(info.value) == ("deployment 'Echo' is unavailable: "
                               "its replica was lost while serving this request")


def test_a_failed_start_answers_503_without_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    dispatcher = _dispatcher({"Echo": FakeHandle(hang)}, warm=False)
    load = dispatcher.tracker.loads["Echo"]
    load.status = "DEPLOY_FAILED"
    load.message = "FileNotFoundError: s3://bucket/private/weights.safetensors: no such key"
    with pytest.raises(DeploymentUnavailable) as info:
        _run(dispatcher.call(_route(Echo), BODY, "req-9"))
    assert "failed to start" in str(info.value)
    assert "s3://" not in str(info.value) and "FileNotFoundError" not in str(info.value)
    assert "s3://bucket/private" in caplog.text  # the operator's copy, in the edge log


def _stream_route() -> RouteSpec:
    return RouteSpec(path="/s", http_method="POST", deployment="Echo", attr="tokens",
                     input_model=None, output_model=None, is_async=True, is_stream=True)


def test_a_stream_to_a_deployment_that_failed_to_start_is_a_503_not_a_hang() -> None:
    async def never(*args: Any) -> AsyncIterator[str]:
        await asyncio.Event().wait()  # no replica will ever produce a chunk
        yield "never"

    dispatcher = _dispatcher({"Echo": FakeHandle(never)}, warm=False)
    load = dispatcher.tracker.loads["Echo"]
    load.status, load.message = "DEPLOY_FAILED", "ImportError: no module named secret_pkg"

    async def first_chunk() -> Any:
        chunks = dispatcher.stream(_stream_route(), BODY, "req-s1")
        return await asyncio.wait_for(anext(chunks), 20)

    with pytest.raises(DeploymentUnavailable, match="failed to start") as info:
        _run(first_chunk())
    assert "secret_pkg" not in str(info.value)


def test_a_stream_yields_every_chunk_and_ends() -> None:
    async def three(*args: Any) -> AsyncIterator[str]:
        for piece in ("a", "b", "c"):
            yield piece

    dispatcher = _dispatcher({"Echo": FakeHandle(three)})

    async def collect() -> list[str]:
        return [chunk async for chunk in dispatcher.stream(_stream_route(), BODY, "req-s2")]

    assert _run(collect()) == ["a", "b", "c"]


def test_no_retry_when_retry_on_replica_loss_is_off() -> None:
    handle = FakeHandle(scripted(ActorDiedError(), "would have succeeded"))
    with pytest.raises(DeploymentUnavailable):
        _run(_dispatcher({"SideEffects": handle}).call(_route(SideEffects), BODY, "req-6"))
    assert handle.count("ember_call") == 1


def test_pipeline_is_not_retried_on_a_lost_replica() -> None:
    stages = {"Tokenize": FakeHandle(scripted(ActorDiedError(), ["retried"])),
              "Encode": FakeHandle(), "Pool": FakeHandle()}
    with pytest.raises(DeploymentUnavailable):
        _run(_dispatcher(stages).call(PIPELINE.route_spec(), BODY, "req-7"))
    assert stages["Tokenize"].count("ember_call") == 1


def test_cold_request_goes_to_the_pool_and_reports_path_pool() -> None:
    echo, pool = FakeHandle(replica_of(Echo)), FakeHandle(pool_of(Echo))
    dispatcher = _dispatcher({"Echo": echo}, pool=pool, warm=False)
    dispatcher.tracker.pool_running = 1

    outcome = _run(dispatcher.call(_route(Echo), BODY, "req-8"))
    assert outcome.value == {"echo": "hello cold world"}
    assert [s.args for s in pool.sent] == [("Echo", "__call__", BODY)]
    assert echo.count("ember_call") == 0
    # One ping wakes it, so its own replica starts meanwhile; one stands for the request's
    # demand in its queue while the pool serves it.
    assert echo.count("ember_ping") == 2
    assert outcome.cold is not None and outcome.cold.path == "pool"
    # The pool constructed Echo for this request: its setup and warmup are the only phases.
    assert outcome.cold.phases == {"queue": 0.0, "start": 0.0, "import": 0.0,
                                   "weights": 0.118, "warmup": 0.021}
    assert ";path=pool;queue=0;start=0;import=0;weights=118;warmup=21" in outcome.cold.header()
    assert dispatcher.tracker.loads["Echo"].cold_starts == 1


@ember.deployment(route="/gpu-echo", num_gpus=1)
class GpuEcho:
    def __call__(self, body: Text) -> dict[str, str]:
        return {"gpu": body.text}


GPU_APP = ember.App([Echo, GpuEcho], warm_pool=1)


def test_app_splits_its_pooled_deployments_between_the_cpu_and_the_gpu_pool() -> None:
    assert [s.name for s in GPU_APP.pool_specs()] == ["Echo"]
    assert [s.name for s in GPU_APP.pool_specs(gpu=True)] == ["GpuEcho"]


def test_a_cold_gpu_deployment_goes_to_the_gpu_pool_only_while_that_pool_runs() -> None:
    cpu_pool, gpu_pool = FakeHandle(pool_of(Echo)), FakeHandle(pool_of(GpuEcho))
    gpu = FakeHandle(replica_of(GpuEcho))
    options = {spec.name: spec.options for spec in GPU_APP.specs}
    tracker = LoadTracker(options, Metrics())
    for load in tracker.loads.values():
        load.running = 0
    dispatcher = Dispatcher(
        {"Echo": as_handle(FakeHandle(replica_of(Echo))), "GpuEcho": as_handle(gpu)}, options,
        tracker, None, as_handle(cpu_pool), frozenset(["Echo"]), as_handle(gpu_pool),
        frozenset(["GpuEcho"]))
    tracker.pool_running = 1  # the CPU pool runs, the GPU pool not yet: the replica serves
    first = _run(dispatcher.call(_route(GpuEcho), BODY, "req-gpu-1"))
    assert gpu.count("ember_call") == 1 and cpu_pool.sent == [] and gpu_pool.sent == []
    assert first.value == {"gpu": "hello cold world"}
    for load in tracker.loads.values():
        load.running = 0
    tracker.gpu_pool_running = 1
    second = _run(dispatcher.call(_route(GpuEcho), BODY, "req-gpu-2"))
    assert [s.args for s in gpu_pool.sent] == [("GpuEcho", "__call__", BODY)]
    assert cpu_pool.sent == [] and second.cold is not None and second.cold.path == "pool"


@pytest.mark.parametrize(("cls", "pool_running"), [(Echo, 0), (NoPool, 1)],
                         ids=["pool not running", "deployment opted out"])
def test_cold_request_goes_to_the_deployment_when_the_pool_cannot_serve_it(
    cls: type, pool_running: int,
) -> None:
    name = get_spec(cls).name
    own, pool = FakeHandle(replica_of(cls)), FakeHandle(pool_of(cls))
    dispatcher = _dispatcher({name: own}, pool=pool, warm=False)
    dispatcher.tracker.pool_running = pool_running

    outcome = _run(dispatcher.call(_route(cls), BODY, "req-9"))
    assert pool.sent == []
    assert own.count("ember_call") == 1
    assert outcome.cold is not None and outcome.cold.path == "replica"
    assert "path=replica" in outcome.cold.header()


def test_past_the_pools_cap_a_request_is_held_for_the_own_replica() -> None:
    async def busy(name: str, attr: str, body: Any) -> PoolAnswer:
        return PoolAnswer(busy=True)

    echo, pool = FakeHandle(replica_of(Echo)), FakeHandle(busy)
    dispatcher = _dispatcher({"Echo": echo}, pool=pool, warm=False)
    dispatcher.tracker.pool_running = 1
    outcome = _run(dispatcher.call(_route(Echo), BODY, "req-cap"))
    assert outcome.value == {"echo": "hello cold world"}
    assert (pool.count("ember_call"), echo.count("ember_call")) == (1, 1)
    assert outcome.cold is not None and outcome.cold.path == "replica"


def test_a_deployment_whose_preload_failed_is_not_sent_to_the_pool() -> None:
    echo, pool = FakeHandle(replica_of(Echo)), FakeHandle(pool_of(Echo))
    dispatcher = _dispatcher({"Echo": echo}, pool=pool, warm=False)
    dispatcher.tracker.pool_running = 1
    dispatcher.tracker.update_pool_failures({"Echo": "warm pool preload failed: OSError: x"})
    _run(dispatcher.call(_route(Echo), BODY, "req-failed-preload"))
    assert (pool.sent, echo.count("ember_call")) == ([], 1)
    assert dispatcher.tracker.loads["Echo"].as_dict()["pool_failure"].endswith("OSError: x")


def test_a_request_waiting_for_a_replica_goes_to_the_pool_once_the_last_one_left() -> None:
    # The edge counted a replica (a stale poll), so the request went to the deployment,
    # where no replica will take it for seconds.
    echo, pool = FakeHandle(no_replica=True), FakeHandle(pool_of(Echo))
    dispatcher = _dispatcher({"Echo": echo}, pool=pool, warm=True)
    dispatcher.tracker.pool_running = 1

    async def scenario() -> Any:
        call = asyncio.ensure_future(dispatcher.call(_route(Echo), BODY, "req-race"))
        await asyncio.sleep(0.3)
        assert not call.done() and pool.sent == []
        dispatcher.tracker.loads["Echo"].running = 0  # the poll sees the replica gone
        return await asyncio.wait_for(call, 5)

    outcome = _run(scenario())
    assert outcome.value == {"echo": "hello cold world"}
    assert outcome.cold is not None and outcome.cold.path == "pool"
    assert echo.count("ember_call") == 1 and echo.responses[0].cancels == 1


def test_warm_request_has_no_cold_start_report() -> None:
    echo, pool = FakeHandle(replica_of(Echo)), FakeHandle(pool_of(Echo))
    dispatcher = _dispatcher({"Echo": echo}, pool=pool, warm=True)
    dispatcher.tracker.pool_running = 1
    outcome = _run(dispatcher.call(_route(Echo), BODY, "req-10"))
    assert outcome.cold is None
    assert (pool.sent, echo.count("ember_ping"), echo.count("ember_call")) == ([], 0, 1)


def test_user_code_raising_is_500_naming_the_request_id() -> None:
    async def broken(attr: str, body: Any) -> Any:
        raise ValueError("shape mismatch")

    echo = FakeHandle(broken)
    with pytest.raises(UserCodeError) as info:
        _run(_dispatcher({"Echo": echo}).call(_route(Echo), BODY, "req-7f3a"))
    assert info.value.status_code == 500
    assert str(info.value) == "deployment 'Echo' raised ValueError; request id req-7f3a"
    assert echo.count("ember_call") == 1  # a handler's exception is not a lost replica


def test_a_loaders_error_on_a_request_answers_503_with_the_request_id_not_its_urls(
        caplog: pytest.LogCaptureFixture) -> None:
    """The warm pool builds a model, a replica loads an adapter, on a caller's request: a
    loader's error there names URLs and paths, which are the operator's."""
    from ember.errors import SourceError

    async def loads(attr: str, body: Any) -> Any:
        raise SourceError("access denied", url="s3://bucket/private/adapter.safetensors")

    with pytest.raises(DeploymentUnavailable) as info:
        _run(_dispatcher({"Echo": FakeHandle(loads)}).call(_route(Echo), BODY, "req-51c"))
    assert info.value.status_code == 503
    assert str(info.value) == ("deployment 'Echo' is unavailable: it could not load its "
                               "weights; request id req-51c")
    assert "s3://bucket/private" in caplog.text and "req-51c" in caplog.text


def test_an_ember_error_about_the_code_answers_500_naming_only_its_type() -> None:
    from ember.errors import ConfigError

    async def wired_wrongly(attr: str, body: Any) -> Any:
        raise ConfigError("secret path /srv/app/settings.toml is wrong")

    with pytest.raises(UserCodeError) as info:
        _run(_dispatcher({"Echo": FakeHandle(wired_wrongly)}).call(_route(Echo), BODY, "r-2"))
    assert str(info.value) == "deployment 'Echo' raised ConfigError; request id r-2"


def _refuses(message: str) -> FakeHandle:
    async def handler(attr: str, body: Any) -> Any:
        raise InvalidBody(message)

    return FakeHandle(handler)


def test_ember_error_raised_on_purpose_keeps_its_status() -> None:
    echo = _refuses("text must not be empty")
    with pytest.raises(InvalidBody) as info:
        _run(_dispatcher({"Echo": echo}).call(_route(Echo), BODY, "req-11"))
    assert info.value.status_code == 422
    assert echo.count("ember_call") == 1


def test_ember_error_raised_on_purpose_keeps_its_message() -> None:
    with pytest.raises(InvalidBody) as info:
        _run(_dispatcher({"Echo": _refuses("text must not be empty")})
             .call(_route(Echo), BODY, "req-12"))
    assert type(info.value).__name__ == "InvalidBody"
    assert str(info.value) == "invalid body: text must not be empty"


def test_a_burst_of_cold_requests_waits_for_the_new_replica_with_one_poll_between_them() -> None:
    async def slow_echo(attr: str, body: Text) -> dict[str, str]:
        await asyncio.sleep(0.2)  # still running when the replica shows up
        return {"echo": body.text}

    dispatcher = _dispatcher({"Echo": FakeHandle(slow_echo)}, warm=False)
    polls = 0
    poll = dispatcher._poll_placed

    async def counted(name: str) -> None:
        nonlocal polls
        polls += 1
        await poll(name)

    dispatcher._poll_placed = counted  # type: ignore[method-assign]

    async def burst() -> list[Outcome]:
        async def replica_shows_up() -> None:
            await asyncio.sleep(0.05)
            dispatcher.tracker.loads["Echo"].running = 1

        shows_up = asyncio.ensure_future(replica_shows_up())
        outcomes = await asyncio.gather(*(dispatcher.call(_route(Echo), BODY, f"burst-{i}")
                                          for i in range(10)))
        await shows_up
        return list(outcomes)

    outcomes = _run(burst())
    assert polls == 1
    # Each read its replica's timeline while it ran: every phase is there.
    assert all(o.cold is not None and o.cold.path == "replica" and "weights" in o.cold.phases
               for o in outcomes)


def test_the_router_check_runs_when_the_edge_starts_not_in_a_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # It reads Ray's source (about 0.09 s of CPU): inside a cold request, the replica that
    # request waits for would be asked for that much later.
    from ember.ray_internals import _checks

    checked: list[str] = []
    real = _checks._BY_NAME["router_view"]

    def counted() -> str | None:
        checked.append("router_view")
        return real.check()

    counting = _checks.Internal(real.name, real.on_change, counted)
    monkeypatch.setitem(_checks._BY_NAME, "router_view", counting)
    _checks.available.cache_clear()
    try:
        dispatcher = _dispatcher({"Echo": FakeHandle(scripted({"echo": "x"}))})
        assert checked == ["router_view"]
        _run(dispatcher.call(_route(Echo), BODY, "req-check"))
        assert checked == ["router_view"]  # the request read the kept answer
    finally:
        _checks.available.cache_clear()
