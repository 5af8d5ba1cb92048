"""``start_ray`` starts a cluster of its own unless told which one to join.

``ray.init(address=None)`` does not start one: it joins the cluster named in Ray's
``ray_current_cluster`` file, the one started last on this machine (another user's, or a
test's two-node cluster). Only the arguments Ember hands to ``ray.init`` are checked here;
the clusters themselves are the integration tests'.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from ember.cluster import runtime


@pytest.fixture
def init_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(runtime, "use_loopback_node_ip", lambda: None)
    # No cluster starts here, so there is no address to verify after ray.init.
    monkeypatch.setattr(runtime, "verify_loopback", lambda *_: None)
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: SimpleNamespace(gcs_address="127.0.0.1:1"))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(os, "environ", dict(os.environ))  # start_ray sets worker variables
    return calls


def test_without_an_address_it_starts_a_local_cluster_not_the_last_one_started(
        init_calls: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert runtime.start_ray(num_cpus=1, warm=False) is True
    assert init_calls[0]["address"] == "local"


def test_ray_address_is_joined(init_calls: list[dict[str, Any]],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6390")
    assert runtime.start_ray(num_cpus=1, warm=False) is False
    assert init_calls[0]["address"] == "127.0.0.1:6390"
