"""Cache-aware placement without a cluster: the actor options, the option checks, the mark."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ember
from ember.app.config import DeploymentOptions, to_ray_options
from ember.control.snapshot_placement import held_here, prefer_nodes
from ember.errors import ConfigError
from ember.loaders import LoaderConfig, preload_snapshot, snapshot_key


def test_replicas_prefer_the_holders_and_fall_back_to_any_node() -> None:
    placement = prefer_nodes(["bb", "aa"])
    assert placement == {"label_selector": {"ray.io/node-id": "in(aa,bb)"},
                         "fallback_strategy": [{"label_selector": {}}]}
    options = to_ray_options(DeploymentOptions(num_cpus=0.5), name="M", placement=placement)
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0, **placement}
    # No holder: no selector at all, Serve places the replica as it always does.
    assert prefer_nodes([]) == {}
    plain = to_ray_options(DeploymentOptions(), name="M")["ray_actor_options"]
    assert set(plain) == {"num_cpus", "num_gpus"}


def test_a_snapshot_version_needs_its_url() -> None:
    with pytest.raises(ConfigError, match=r"snapshot_version.*needs snapshot_url"):
        @ember.deployment(snapshot_version="v1")
        class Model:
            def __call__(self, x: int) -> int:
                return x


def test_a_node_holds_the_snapshots_recorded_in_its_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(8)}, str(weights))
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("EMBER_REGIONAL_CACHE", "")
    url = weights.as_uri()
    assert held_here([snapshot_key(url, "v1")]) == []
    preload_snapshot(url, code_version="v1", config=LoaderConfig(min_free_bytes=0))
    assert held_here([snapshot_key(url, "v1"), snapshot_key(url, "v2")]) == [
        snapshot_key(url, "v1")]
