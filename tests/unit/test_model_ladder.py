"""The bench's model ladder: same seed, same bytes; the layout ``save_pretrained`` writes."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from support import bench_module


@pytest.fixture(scope="module")
def ladder() -> ModuleType:
    return bench_module("model_ladder")


def test_same_seed_same_bytes_other_seed_other_bytes(ladder: ModuleType, tmp_path: Path) -> None:
    rung = ladder.LADDER["tiny"]
    a = ladder.folder_digest(ladder.write_checkpoint(rung, tmp_path / "a", seed=0))
    b = ladder.folder_digest(ladder.write_checkpoint(rung, tmp_path / "b", seed=0))
    c = ladder.folder_digest(ladder.write_checkpoint(rung, tmp_path / "c", seed=1))
    assert a == b != c


def test_shards_and_index_are_what_save_pretrained_writes(
    ladder: ModuleType, tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    rung = ladder.LADDER["tiny"]
    ours = ladder.write_checkpoint(rung, tmp_path / "ours", seed=0)
    model = LlamaForCausalLM(rung.config()).to(torch.bfloat16)  # type: ignore[arg-type]
    state = {n: ladder.tensor_for(n, tuple(t.shape), 0) for n, t in model.state_dict().items()}
    model.load_state_dict(state)
    model.save_pretrained(tmp_path / "hf", max_shard_size=rung.max_shard_bytes)
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 1, "the tiny rung must exercise sharding"
    assert shards == sorted(p.name for p in ours.glob("*.safetensors"))
    for name in shards:
        assert filecmp.cmp(ours / name, tmp_path / "hf" / name, shallow=False), name
    index = json.loads((ours / ladder.INDEX_NAME).read_text())
    theirs = json.loads((tmp_path / "hf" / ladder.INDEX_NAME).read_text())
    assert index == theirs
    assert json.loads((ours / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"]


def test_ensure_reuses_a_stamped_rung(ladder: ModuleType, tmp_path: Path) -> None:
    first = ladder.ensure("tiny", root=tmp_path)
    shard = next(first.glob("*.safetensors"))
    mtime = shard.stat().st_mtime_ns
    assert ladder.ensure("tiny", root=tmp_path) == first
    assert shard.stat().st_mtime_ns == mtime
    assert ladder.total_bytes(first) == sum(p.stat().st_size for p in first.glob("*.safetensors")
                                            ) - _headers(first)


def _headers(folder: Path) -> int:
    total = 0
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as f:
            total += 8 + int.from_bytes(f.read(8), "little")
    return total
