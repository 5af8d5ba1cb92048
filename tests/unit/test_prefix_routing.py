"""The prefix-routing policy with fake replicas: affinity, its limits, homes, the table."""

from __future__ import annotations

import pytest
import torch

from ember.control.prefix_routing import (
    Choice,
    InFlight,
    PrefixTable,
    ReplicaLoad,
    block_names,
    choose,
    rendezvous,
    text_blocks,
)
from ember.deployments._textgen_prefix import PrefixCache

SYSTEM = "You are a careful assistant who answers in one short sentence. "


def blocks(text: str) -> list[int]:
    return text_blocks(SYSTEM + text)


def loads(**queues: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(name, queue) for name, queue in queues.items()]


def test_a_prompt_goes_to_the_replica_that_served_its_prefix() -> None:
    table = PrefixTable()
    table.record(blocks("What is a list?"), "b")
    choice = choose(blocks("What is a dict?"), table, loads(a=0, b=0, c=0), max_queue_gap=8)
    assert choice is not None and (choice.replica, choice.reason) == ("b", "prefix")
    assert choice.matched_blocks == len(text_blocks(SYSTEM + "What is a "))  # what they share


def test_the_longest_match_wins_over_a_shorter_one() -> None:
    table = PrefixTable()
    table.record(blocks(""), "a")
    table.record(blocks("Tell me about Python's dictionaries and their ordering."), "b")
    choice = choose(blocks("Tell me about Python's dictionaries and sets."), table,
                    loads(a=0, b=0), max_queue_gap=8)
    assert choice is not None and choice.replica == "b"


def test_a_holder_within_the_gap_keeps_its_prefix() -> None:
    table = PrefixTable()
    table.record(blocks("x"), "a")
    choice = choose(blocks("y"), table, loads(a=8, b=0), max_queue_gap=8)
    assert choice is not None and choice.replica == "a"


def test_an_overloaded_holder_is_bypassed_for_the_least_loaded() -> None:
    table = PrefixTable()
    table.record(blocks("x"), "a")
    choice = choose(blocks("y"), table, loads(a=9, b=3, c=0), max_queue_gap=8)
    assert choice is not None and (choice.replica, choice.reason) == ("c", "least_loaded")


def test_a_cold_holder_is_not_chosen_for_affinity_alone() -> None:
    table = PrefixTable()
    table.record(blocks("x"), "a")
    replicas = [ReplicaLoad("a", 2, warm=False), ReplicaLoad("b", 1)]
    choice = choose(blocks("y"), table, replicas, max_queue_gap=8)
    assert choice is not None and (choice.replica, choice.reason) == ("b", "least_loaded")


def test_a_tie_for_least_loaded_goes_to_the_warm_replica() -> None:
    table = PrefixTable()
    table.record(blocks("x"), "a")
    replicas = [ReplicaLoad("a", 0, warm=False), ReplicaLoad("b", 0)]
    choice = choose(blocks("y"), table, replicas, max_queue_gap=8)
    assert choice is not None and (choice.replica, choice.reason) == ("b", "least_loaded")


def test_a_cold_replica_does_not_win_on_a_queue_one_shorter() -> None:
    # Queue lengths lag a request or so: a warm replica within the gap goes first.
    replicas = [ReplicaLoad("a", 0, warm=False), ReplicaLoad("b", 1)]
    choice = choose(text_blocks("hi"), PrefixTable(), replicas, max_queue_gap=8)
    assert choice is not None and choice.replica == "b"


def test_a_cold_replica_still_takes_load_when_it_is_the_least_loaded() -> None:
    table = PrefixTable()
    table.record(blocks("x"), "b")
    replicas = [ReplicaLoad("a", 0, warm=False), ReplicaLoad("b", 9)]
    choice = choose(blocks("y"), table, replicas, max_queue_gap=8)
    assert choice is not None and (choice.replica, choice.reason) == ("a", "least_loaded")


def test_the_next_holder_takes_over_when_the_best_is_overloaded() -> None:
    table = PrefixTable()
    table.record(blocks("shared"), "b")
    table.record(blocks("shared and longer than the other one"), "a")
    choice = choose(blocks("shared and longer than the other one"), table,
                    loads(a=20, b=2, c=0), max_queue_gap=8)
    assert choice is not None and (choice.replica, choice.reason) == ("b", "prefix")


def test_a_replica_that_is_gone_is_not_chosen() -> None:
    table = PrefixTable()
    table.record(blocks("x"), "gone")
    choice = choose(blocks("x"), table, loads(a=0, b=0), max_queue_gap=8)
    assert choice is not None and choice.reason == "home"


def test_a_new_prefix_goes_to_the_same_home_from_every_edge() -> None:
    prompt = blocks("a brand new conversation")
    homes = {choose(prompt, PrefixTable(), loads(**dict(zip(order, [0, 0, 0], strict=True))),
                    max_queue_gap=8).replica  # type: ignore[union-attr]
             for order in (("a", "b", "c"), ("c", "b", "a"), ("b", "c", "a"))}
    assert len(homes) == 1


def test_homes_spread_new_prefixes_over_the_replicas() -> None:
    homes = [rendezvous(text_blocks(f"{i:04d}: a conversation starts here")[0],
                        ["a", "b", "c", "d"])[0] for i in range(200)]
    assert {homes.count(r) for r in "abcd"} <= set(range(30, 71))


def test_an_overloaded_home_passes_to_the_next_in_rendezvous_order() -> None:
    prompt = blocks("new")
    home, second = rendezvous(prompt[0], ["a", "b"])
    choice = choose(prompt, PrefixTable(), [ReplicaLoad(home, 20), ReplicaLoad(second, 0)],
                    max_queue_gap=8)
    assert choice is not None and (choice.replica, choice.reason) == (second, "home")


def test_a_prompt_shorter_than_a_block_goes_to_the_least_loaded() -> None:
    choice = choose(text_blocks("hi"), PrefixTable(), loads(a=3, b=1), max_queue_gap=8)
    assert choice is not None and (choice.replica, choice.reason) == ("b", "least_loaded")


def test_no_replicas_no_choice() -> None:
    assert choose(blocks("x"), PrefixTable(), [], max_queue_gap=8) is None


def test_the_table_is_bounded_and_forgets_the_least_recent_blocks() -> None:
    table = PrefixTable(max_blocks=4, holders_per_block=2)
    first, second = text_blocks("A" * 64), text_blocks("B" * 64)
    table.record(first, "a")
    table.record(second, "b")
    assert len(table) == 4 and table.matched(first) == {} and table.matched(second) == {"b": 4}
    for replica in ("c", "d", "e"):
        table.record(second, replica)
    assert table.matched(second) == {"d": 4, "e": 4}


def test_forgetting_a_replica_drops_its_blocks() -> None:
    table = PrefixTable()
    table.record(blocks("x"), "a")
    table.record(blocks("x"), "b")
    table.forget({"a"})
    assert set(table.matched(blocks("x"))) == {"b"}
    table.forget({"b"})
    assert len(table) == 0


@pytest.mark.parametrize("length", [0, 15, 16, 47, 48])
def test_the_router_names_blocks_as_the_engines_prefix_cache_does(length: int) -> None:
    tokens = list(range(length))
    cache = PrefixCache(block_tokens=16, max_blocks=8)
    kv = [torch.zeros(1, 1, length, 2)]
    cache.insert(tokens, kv, kv)
    assert list(cache._blocks) == [(None, name) for name in block_names(tokens, 16)]


def test_text_blocks_are_the_byte_tokens_blocks() -> None:
    assert text_blocks("é" * 20) == block_names(list("é".encode() * 20))


def test_in_flight_counts_choices_then_acceptances_until_finished() -> None:
    now = [0.0]
    inflight = InFlight(choice_ttl_s=5.0, clock=lambda: now[0])
    inflight.chosen("1", "a")
    inflight.chosen("2", "a")
    inflight.routed("2", "b")  # chosen for a, taken by b
    assert inflight.counts() == {"a": 1, "b": 1}
    now[0] = 6.0  # the choice of 1 was never confirmed
    assert inflight.counts() == {"b": 1}
    inflight.finished("2")
    assert inflight.counts() == {}


def test_a_finish_reported_before_the_acceptance_is_not_counted() -> None:
    inflight = InFlight()
    inflight.chosen("1", "a")
    inflight.finished("1")
    inflight.routed("1", "a")
    assert inflight.counts() == {}


# -- LoRA adapters (Serve's multiplexed model ids) ------------------------------------------
def held(**adapters: str) -> list[ReplicaLoad]:
    """Idle warm replicas holding the comma-separated adapters given."""
    return [ReplicaLoad(name, 0, adapters=frozenset(filter(None, names.split(","))))
            for name, names in adapters.items()]


def test_an_adapter_request_goes_to_its_holder_whatever_its_prefix() -> None:
    table = PrefixTable()
    table.record(blocks("a shared system prompt"), "a")
    choice = choose(blocks("a shared system prompt"), table, held(a="", b="sql"),
                    max_queue_gap=8, adapter="sql")
    assert choice is not None and (choice.replica, choice.reason) == ("b", "adapter")


def test_a_new_adapter_goes_to_the_replica_holding_the_fewest() -> None:
    choice = choose([], PrefixTable(), held(a="x", b="", c="y,z"), max_queue_gap=8,
                    adapter="sql")
    assert choice is not None and (choice.replica, choice.reason) == ("b", "adapter_home")


def test_a_new_adapter_goes_to_the_same_home_from_every_edge_and_homes_spread() -> None:
    def home(order: str, adapter: str) -> str:
        choice = choose([], PrefixTable(), held(**dict.fromkeys(order, "")), max_queue_gap=8,
                        adapter=adapter)
        assert choice is not None
        return choice.replica

    assert len({home(order, "sql") for order in ("abc", "cba", "bca")}) == 1
    homes = [home("abcd", f"adapter-{i}") for i in range(200)]
    assert {homes.count(r) for r in "abcd"} <= set(range(30, 71))


def test_the_least_loaded_of_two_holders_takes_the_request() -> None:
    replicas = [ReplicaLoad("a", 3, adapters=frozenset({"sql"})),
                ReplicaLoad("b", 1, adapters=frozenset({"sql"})), ReplicaLoad("c", 0)]
    choice = choose([], PrefixTable(), replicas, max_queue_gap=8, adapter="sql")
    assert choice is not None and (choice.replica, choice.reason) == ("b", "adapter")


def test_an_overloaded_holder_is_passed_over_for_a_new_copy() -> None:
    replicas = [ReplicaLoad("a", 9, adapters=frozenset({"sql"})),
                ReplicaLoad("b", 0, adapters=frozenset({"x"})), ReplicaLoad("c", 0)]
    choice = choose([], PrefixTable(), replicas, max_queue_gap=8, adapter="sql")
    # Past the gap: the least-adapted qualifying replica loads it too.
    assert choice is not None and (choice.replica, choice.reason) == ("c", "adapter_home")
    replicas[0] = ReplicaLoad("a", 8, adapters=frozenset({"sql"}))  # within the gap: kept
    assert choose([], PrefixTable(), replicas, max_queue_gap=8, adapter="sql") \
        == Choice("a", "adapter")


def test_a_cold_holder_is_not_chosen_for_its_adapter() -> None:
    replicas = [ReplicaLoad("a", 0, warm=False, adapters=frozenset({"sql"})),
                ReplicaLoad("b", 2)]
    choice = choose([], PrefixTable(), replicas, max_queue_gap=8, adapter="sql")
    assert choice is not None and (choice.replica, choice.reason) == ("b", "adapter_home")


def test_an_adapter_request_with_nothing_qualified_goes_to_the_least_loaded() -> None:
    replicas = [ReplicaLoad("a", 0, warm=False, adapters=frozenset({"sql"})),
                ReplicaLoad("b", 3, warm=False)]
    choice = choose([], PrefixTable(), replicas, max_queue_gap=8, adapter="sql")
    assert choice is not None and (choice.replica, choice.reason) == ("a", "least_loaded")


def test_in_flight_adapters_count_until_finished_or_expired() -> None:
    now = [0.0]
    inflight = InFlight(choice_ttl_s=5.0, clock=lambda: now[0])
    inflight.chosen("1", "a", "sql")
    inflight.chosen("2", "b", "chat")
    inflight.routed("2", "b", "chat")
    inflight.chosen("3", "b")  # the base: no adapter
    assert inflight.adapters() == {"a": frozenset({"sql"}), "b": frozenset({"chat"})}
    now[0] = 6.0  # the choice of 1 was never confirmed
    assert inflight.adapters() == {"b": frozenset({"chat"})}
    inflight.finished("2")
    assert inflight.adapters() == {}
