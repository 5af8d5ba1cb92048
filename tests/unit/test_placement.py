"""Why a replica waits: an unplaced request of its shape that no live node can fit."""

from __future__ import annotations

import pytest

from ember.control.placement import replica_shape, unplaceable


def test_the_issue_example_reads_as_promised() -> None:
    reason = unplaceable({"CPU": 1.0}, pending=[{"CPU": 1.0}], free=[{"CPU": 0.8}])
    assert reason == "waiting for resources: needs CPU 1.0, 0.8 free"


def test_a_node_with_room_means_it_is_only_starting() -> None:
    assert unplaceable({"CPU": 1.0}, pending=[{"CPU": 1.0}],
                       free=[{"CPU": 0.2}, {"CPU": 1.0}]) is None


def test_a_placed_replica_on_a_full_node_is_not_called_unplaced() -> None:
    # Its CPU is already taken from the node, so nothing fits, but nothing of its shape waits.
    assert unplaceable({"CPU": 1.0}, pending=[{"CPU": 0.5}], free=[{"CPU": 0.5}]) is None
    assert unplaceable({"CPU": 1.0}, pending=[], free=[{"CPU": 0.0}]) is None


def test_the_short_resource_is_named_with_the_roomiest_node() -> None:
    need = replica_shape(0.5, 1.0)
    reason = unplaceable(need, pending=[{"GPU": 1.0, "CPU": 0.5}],
                         free=[{"CPU": 2.0}, {"CPU": 0.1, "GPU": 0.0}])
    assert reason == "waiting for resources: needs GPU 1.0, 0.0 free"


@pytest.mark.parametrize(("cpus", "gpus", "shape"), [
    (1.0, 0.0, {"CPU": 1.0}), (0.25, 1.0, {"CPU": 0.25, "GPU": 1.0}), (0.0, 0.0, {}),
])
def test_replica_shape_leaves_zero_amounts_out(cpus: float, gpus: float,
                                                shape: dict[str, float]) -> None:
    assert replica_shape(cpus, gpus) == shape
    # A replica that asks for nothing fits any node; one that asks for something fits none.
    assert (unplaceable(shape, pending=[shape], free=[{}]) is None) == (not shape)
