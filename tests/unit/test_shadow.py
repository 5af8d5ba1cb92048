"""Shadow settings and the comparison of a copy's answer, as pure functions."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from ember.control.shadow import Shadow, distance, parse_shadow
from ember.errors import BadRequest


@pytest.mark.parametrize(("body", "param"), [
    ({"to": "9", "percent": 20}, "to"), ({"to": "2", "percent": 101}, "percent"),
    ({"to": "2", "percent": -1}, "percent"), ({"to": "2", "percent": 2.5}, "percent"),
    ({"to": "2"}, "body"), ([], "body")])
def test_bad_shadow_settings_are_refused_naming_the_field(body: object, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_shadow("Embed", ["1", "2"], body)
    assert info.value.fields["param"] == param


def test_zero_percent_turns_shadowing_off() -> None:
    assert parse_shadow("Embed", ["1", "2"], {"percent": 0}) is None
    assert parse_shadow("Embed", ["1", "2"], {"to": "2", "percent": 20}) == Shadow("2", 20)


def test_percent_is_the_share_of_requests_copied() -> None:
    shadow = Shadow("2", 20)
    assert sum(shadow.sampled(i / 1000) for i in range(1000)) == 200


class Embedding(BaseModel):
    embedding: list[float]
    tokens: int


def test_numeric_answers_compare_by_euclidean_distance_models_included() -> None:
    assert distance([Embedding(embedding=[0.0, 3.0], tokens=2)],
                    [Embedding(embedding=[4.0, 3.0], tokens=2)]) == 4.0
    assert distance({"a": 1.0, "b": [2.0]}, {"b": [2.0], "a": 1.0}) == 0.0


def test_answers_that_are_not_numbers_of_one_shape_have_no_distance() -> None:
    assert distance("text", "text") is None
    assert distance([1.0, 2.0], [1.0]) is None
    assert distance([True], [False]) is None
    assert distance([], []) is None
