"""The Ray request router around the prefix policy, with fake replicas and no cluster."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

import ember
from ember.app.config import PREFIX_ROUTER_IMPORT_PATH, to_ray_options
from ember.control.prefix_router import PrefixRouter, prompt_text
from ember.errors import ConfigError
from ember.protocols import GenerateRequest

DEPLOYMENT = DeploymentID(name="Gen", app_name="app")
SHARED = "You are a careful assistant who answers in one short sentence. "
#: A pending request holds a future, so every test runs in a loop of its own.
LOOP: list[asyncio.AbstractEventLoop] = []


@pytest.fixture(autouse=True)
def _loop() -> Iterator[None]:
    LOOP.append(asyncio.new_event_loop())
    yield
    LOOP.pop().close()


@dataclass
class FakeReplica:
    name: str
    routing_stats: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 16
    #: The adapters the replica reported to Serve (``@serve.multiplexed``).
    multiplexed_model_ids: set[str] = field(default_factory=set)

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(self.name, DEPLOYMENT)


def router(gap: int = 8) -> PrefixRouter:
    made = PrefixRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA,
                        use_replica_queue_len_cache=True)
    made.initialize_state(max_queue_gap=gap)
    return made


def request(prompt: str | None, number: int, model: str = "") -> PendingRequest:
    """A pending request; ``model`` is its multiplexed model id (a LoRA adapter)."""
    body = GenerateRequest(prompt=prompt) if prompt is not None else None
    return PendingRequest(args=["generate", body], kwargs={}, future=LOOP[0].create_future(),
                          metadata=RequestMetadata(request_id=f"r{number}",
                                                   internal_request_id=f"i{number}",
                                                   multiplexed_model_id=model))


def route(made: PrefixRouter, replicas: list[FakeReplica], pending: PendingRequest) -> str:
    """Where the router sends ``pending``: the first replica of its first rank."""
    ranks = LOOP[0].run_until_complete(
        made.choose_replicas(replicas, pending))  # type: ignore[arg-type]
    chosen: str = ranks[0][0].replica_id.unique_id
    made.on_request_routed(pending, ranks[0][0].replica_id, None)
    return chosen


def test_requests_sharing_a_prefix_go_where_the_first_went() -> None:
    made, replicas = router(), [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    first = route(made, replicas, request(SHARED + "What is a list?", 0))
    for n in range(1, 8):
        pending = request(SHARED + f"Question {n}?", n)
        assert route(made, replicas, pending) == first
        made.on_request_completed(ReplicaID(first, DEPLOYMENT), f"i{n}")


def test_the_holder_is_bypassed_once_its_queue_passes_the_gap() -> None:
    made, replicas = router(gap=2), [FakeReplica("a"), FakeReplica("b")]
    holder = route(made, replicas, request(SHARED + "first", 0))
    # Requests 1..2 stay on the holder (in flight: 0, 1, 2), then the gap is passed.
    seen = [route(made, replicas, request(SHARED + f"more {n}", n)) for n in range(1, 5)]
    assert seen[:2] == [holder, holder] and holder not in seen[3:]


def test_a_replica_that_reports_cold_is_not_chosen_for_its_prefix() -> None:
    made = router()
    warm = [FakeReplica("a"), FakeReplica("b")]
    holder = route(made, warm, request(SHARED + "first", 0))
    made.on_request_completed(ReplicaID(holder, DEPLOYMENT), "i0")
    other = "b" if holder == "a" else "a"
    cold = [FakeReplica(holder, {"warm": False}), FakeReplica(other)]
    assert route(made, cold, request(SHARED + "second", 1)) == other


def test_a_replica_gone_and_back_starts_with_no_prefixes() -> None:
    made = router()
    holder = route(made, [FakeReplica("a"), FakeReplica("b")], request(SHARED + "x", 0))
    other = "b" if holder == "a" else "a"
    route(made, [FakeReplica(other)], request("unrelated prompt, long enough for a block", 1))
    assert len(made._ember_table.matched(made._ember_blocks(request(SHARED, 2)))) == 0


def test_a_request_without_a_prompt_goes_to_the_least_loaded() -> None:
    made, replicas = router(), [FakeReplica("a"), FakeReplica("b")]
    for n in range(3):
        made.on_request_routed(request(None, n), ReplicaID("a", DEPLOYMENT), None)
    assert route(made, replicas, request(None, 9)) == "b"


def test_every_other_replica_is_ranked_after_the_choice() -> None:
    made = router()
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    ranks = LOOP[0].run_until_complete(
        made.choose_replicas(replicas, request(SHARED, 0)))  # type: ignore[arg-type]
    assert len(ranks) == 2 and len(ranks[1]) == 2
    assert {r.replica_id.unique_id for rank in ranks for r in rank} == {"a", "b", "c"}


@pytest.mark.parametrize(("args", "kwargs", "text"), [
    (["generate", GenerateRequest(prompt="hello")], {}, "hello"),
    (["generate", {"messages": [{"role": "user", "content": "hi"}]}], {}, "user: hi"),
    (["generate"], {"body": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]}},
     "user: ab"),
    (["generate", "just a string"], {}, None),
    ([], {}, None),
])
def test_the_prompt_is_read_from_the_request_body(args: list[Any], kwargs: dict[str, Any],
                                                   text: str | None) -> None:
    assert prompt_text(args, kwargs) == text


def test_router_prefix_sets_serves_request_router() -> None:
    @ember.deployment(router="prefix", prefix_max_queue_gap=3)
    class Routed:
        def __call__(self, body: GenerateRequest) -> str:
            return "ok"

    options = to_ray_options(Routed.__ember_deployment__.options,  # type: ignore[attr-defined]
                             name="Routed")
    config = options["request_router_config"]
    assert config["request_router_class"] == PREFIX_ROUTER_IMPORT_PATH
    assert config["request_router_kwargs"] == {"max_queue_gap": 3}


def test_the_default_router_leaves_serves_own() -> None:
    @ember.deployment
    class Plain:
        def __call__(self, body: GenerateRequest) -> str:
            return "ok"

    spec = Plain.__ember_deployment__  # type: ignore[attr-defined]
    assert "request_router_config" not in to_ray_options(spec.options, name="Plain")


def test_an_unknown_router_is_refused_with_the_known_ones_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown router 'sticky'.*'prefix'.*'default'"):
        @ember.deployment(router="sticky")
        class Sticky:
            def __call__(self, body: GenerateRequest) -> str:
                return "ok"


def test_a_queue_gap_without_the_prefix_router_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"prefix_max_queue_gap.*router='prefix'"):
        @ember.deployment(prefix_max_queue_gap=2)
        class Gap:
            def __call__(self, body: GenerateRequest) -> str:
                return "ok"


def test_the_import_path_serve_resolves_is_the_router() -> None:
    from ray.serve.config import RequestRouterConfig

    config = RequestRouterConfig(
        request_router_class=PREFIX_ROUTER_IMPORT_PATH)  # type: ignore[arg-type]
    assert config.get_request_router_class() is PrefixRouter


def test_a_completion_reported_before_its_routing_does_not_count_for_ever() -> None:
    # Serve reports a fast request's completion before its routing (seen on a real cluster).
    made, replicas = router(gap=0), [FakeReplica("a"), FakeReplica("b")]
    pending = request(SHARED + "fast", 0)
    made.on_request_completed(ReplicaID("a", DEPLOYMENT), "i0")
    made.on_request_routed(pending, ReplicaID("a", DEPLOYMENT), None)
    assert made._ember_inflight.counts() == {}
    assert route(made, replicas, request(SHARED + "again", 1)) == "a"


def test_a_burst_counts_its_own_choices_before_any_acceptance() -> None:
    # Serve routes a burst before the first acceptance comes back.
    made, replicas = router(gap=2), [FakeReplica("a"), FakeReplica("b")]
    seen = []
    for n in range(8):
        ranks = LOOP[0].run_until_complete(made.choose_replicas(
            replicas, request(SHARED + f"burst {n}", n)))  # type: ignore[arg-type]
        seen.append(ranks[0][0].replica_id.unique_id)
    assert len(set(seen)) == 2 and max(seen.count("a"), seen.count("b")) <= 5


def test_only_prefix_routed_replicas_report_routing_stats() -> None:
    from ember.control.replica import ReplicaCore, replica_class

    @ember.deployment(router="prefix")
    class Routed:
        def __call__(self, body: GenerateRequest) -> str:
            return "ok"

        def routing_stats(self) -> dict[str, bool]:
            return {"warm": False}

    @ember.deployment
    class Plain:
        def __call__(self, body: GenerateRequest) -> str:
            return "ok"

    from ember.app.decorator import get_spec

    routed, plain = get_spec(Routed), get_spec(Plain)
    assert hasattr(replica_class(routed), "record_routing_stats")
    assert not hasattr(replica_class(plain), "record_routing_stats")
    core = ReplicaCore(routed, Routed())
    assert LOOP[0].run_until_complete(core.routing_stats()) == {"warm": False}
    assert LOOP[0].run_until_complete(ReplicaCore(plain, Plain()).routing_stats()) == {
        "warm": True}


# -- LoRA adapters: Serve's multiplexed model id ---------------------------------------------
def test_an_adapter_request_goes_to_the_replica_that_reported_the_adapter() -> None:
    made = router()
    holder = route(made, [FakeReplica("a"), FakeReplica("b")], request(SHARED + "base", 0))
    other = "b" if holder == "a" else "a"
    replicas = [FakeReplica(holder), FakeReplica(other, multiplexed_model_ids={"sql"})]
    # The prompt's prefix is on the holder; the adapter wins.
    assert {route(made, replicas, request(SHARED + f"q {n}", n, "sql"))
            for n in range(1, 6)} == {other}


def test_adapters_in_flight_count_before_any_report() -> None:
    # Serve hears of a load a push interval after it starts: the router's own requests in
    # flight say where the adapter is going meanwhile.
    made, replicas = router(), [FakeReplica("a"), FakeReplica("b")]
    sql = {route(made, replicas, request(f"prompt {n} " * 4, n, "sql")) for n in range(4)}
    chat = {route(made, replicas, request(f"prompt {n} " * 4, 10 + n, "chat"))
            for n in range(4)}
    assert len(sql) == 1 and len(chat) == 1 and sql != chat  # once each, spread


def test_an_adapter_request_leaves_no_prefix_behind() -> None:
    made, replicas = router(), [FakeReplica("a"), FakeReplica("b")]
    route(made, replicas, request(SHARED + "with an adapter", 0, "sql"))
    assert len(made._ember_table) == 0


def test_holders_of_the_adapter_are_ranked_right_after_the_choice() -> None:
    made = router()
    replicas = [FakeReplica("a", multiplexed_model_ids={"sql"}),
                FakeReplica("b", multiplexed_model_ids={"sql"}), FakeReplica("c")]
    for n in range(3):  # c is the least loaded, a the busiest holder
        made.on_request_routed(request(None, n), ReplicaID("a", DEPLOYMENT), None)
    made.on_request_routed(request(None, 5), ReplicaID("b", DEPLOYMENT), None)
    ranks = LOOP[0].run_until_complete(
        made.choose_replicas(replicas, request(None, 9, "sql")))  # type: ignore[arg-type]
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["b"], ["a", "c"]]
