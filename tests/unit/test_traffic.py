"""Traffic between versions, as pure functions: weights, pins, sessions and the split."""

from __future__ import annotations

import random
from collections import Counter

import pytest

import ember
from ember.control.traffic import Traffic, choose, parse_weights, stable_only
from ember.errors import BadRequest, ConfigError

VERSIONS = ["1", "2"]


def test_before_anyone_sets_weights_the_first_version_listed_gets_everything() -> None:
    assert stable_only(["1", "2", "3"]) == {"1": 100, "2": 0, "3": 0}
    traffic = Traffic({"Embed": VERSIONS})
    assert {traffic.pick("Embed") for _ in range(200)} == {"1"}


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"1": 90, "2": 9}, "body", "add up to 99, not 100"),
    ({"1": 90, "3": 10}, "3", "has no version '3'"),
    ({"1": 110, "2": -10}, "2", "must not be negative"),
    ({"1": 90.5, "2": 9.5}, "1", "must be a whole percent"),
    ({"1": True, "2": 99}, "1", "must be a whole percent"),
    ([90, 10], "body", "must be an object"),
    ({}, "body", "must be an object"),
])
def test_bad_weights_are_refused_naming_the_field(body: object, param: str, message: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_weights("Embed", VERSIONS, body)
    assert info.value.status_code == 400
    assert info.value.fields["param"] == param and message in str(info.value)


def test_versions_not_named_get_zero() -> None:
    assert parse_weights("Embed", ["1", "2", "3"], {"2": 100}) == {"1": 0, "2": 100, "3": 0}


def test_the_split_follows_the_weights() -> None:
    traffic = Traffic({"Embed": VERSIONS})
    traffic.update({"Embed": {"1": 90, "2": 10}})
    draws = random.Random(7)
    counts = Counter(traffic.pick("Embed", draw=draws.random()) for _ in range(20_000))
    assert abs(counts["2"] / 20_000 - 0.10) < 0.01


def test_a_pin_wins_over_the_weights_and_an_unknown_pin_is_refused() -> None:
    traffic = Traffic({"Embed": VERSIONS})
    assert traffic.pick("Embed", pin="2") == "2"
    with pytest.raises(BadRequest, match="has versions 1, 2"):
        traffic.pick("Embed", pin="9")


def test_a_session_stays_on_one_version_while_the_weights_stand() -> None:
    traffic = Traffic({"Embed": VERSIONS})
    traffic.update({"Embed": {"1": 50, "2": 50}})
    for session in (f"user-{i}" for i in range(50)):
        assert len({traffic.pick("Embed", session=session) for _ in range(20)}) == 1
    spread = Counter(traffic.pick("Embed", session=f"user-{i}") for i in range(2000))
    assert abs(spread["2"] / 2000 - 0.5) < 0.05  # sessions spread by the weights


def test_weights_stored_for_other_versions_are_ignored() -> None:
    traffic = Traffic({"Embed": VERSIONS})
    traffic.update({"Embed": {"1": 50, "7": 50}, "Gone": {"1": 100}})
    assert traffic.weights == {"Embed": {"1": 100, "2": 0}}


def test_a_zero_weight_version_is_never_chosen() -> None:
    assert {choose({"1": 0, "2": 100, "3": 0}, p / 100) for p in range(100)} == {"2"}


def _version(label: str, route: str = "/embed") -> type:
    @ember.deployment(name="Embed", version=label, route=route)
    class Embed:
        def __call__(self, body: dict[str, str]) -> str:
            return label

    return Embed


def _versions(*labels: str, route: str = "/embed") -> list[type]:
    return [_version(label, route) for label in labels]


def test_an_app_lists_versions_stable_first_and_serves_the_route_once() -> None:
    app = ember.App(_versions("1", "2"))
    assert app.versions == {"Embed": ("Embed@1", "Embed@2")}
    assert [(r.path, r.deployment) for r in app.routes()] == [("/embed", "Embed@1")]


def test_two_unversioned_classes_with_one_name_are_refused() -> None:
    @ember.deployment(name="Embed", route="/embed")
    class A:
        def __call__(self) -> str:
            return "a"

    with pytest.raises(ConfigError, match="give each class a version"):
        ember.App([A, *_versions("2")])


def test_versions_that_serve_different_routes_are_refused() -> None:
    with pytest.raises(ConfigError, match="must serve the same routes"):
        ember.App([*_versions("1"), *_versions("2", route="/other")])
