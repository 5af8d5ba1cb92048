"""URLs, formats and sharded checkpoints; Hugging Face offline; config; device staging."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import pydantic
import pytest
import torch

from ember.loaders import (
    HeaderInvalid,
    LoaderConfig,
    UnsafeFormat,
    UnsafePath,
    WeightsNotFound,
    load,
    resolve,
)
from ember.loaders._reader import plan_ranges
from ember.loaders._staging import StagingCopier, select_device

Writer = Callable[[dict[str, torch.Tensor], str], Path]


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".ckpt", ".pkl"])
def test_pickle_files_are_refused_with_advice(
    tmp_path: Path, suffix: str, config: LoaderConfig
) -> None:
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"\x80\x04never unpickled")
    with pytest.raises(UnsafeFormat, match="convert it to safetensors"):
        load(path.as_uri(), config=config)


def test_folder_with_only_pickle_weights_is_refused(tmp_path: Path, config: LoaderConfig) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(UnsafeFormat):
        load(tmp_path.as_uri(), config=config)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(WeightsNotFound):
        load(tmp_path.as_uri(), config=config)


def _shard(write_file: Writer, tmp_path: Path, index: Mapping[str, object]) -> Path:
    write_file({"a": torch.ones(3), "b": torch.zeros(2)}, "model-00001-of-00002.safetensors")
    write_file({"c": torch.arange(4)}, "model-00002-of-00002.safetensors")
    path = tmp_path / "origin" / "model.safetensors.index.json"
    path.write_text(json.dumps(index))
    return path


def test_sharded_checkpoint_loads_as_one(
    write_file: Writer, tmp_path: Path, config: LoaderConfig
) -> None:
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    index = {"metadata": {}, "weight_map": {"a": first, "b": first, "c": second}}
    path = _shard(write_file, tmp_path, index)
    got = load(path.parent.as_uri(), config=config)  # the folder: the index is found
    assert set(got) == {"a", "b", "c"} and torch.equal(got["c"], torch.arange(4))
    weights = resolve(path.as_uri(), config=config)
    assert [p.name for p in weights.paths] == [first, second]
    assert weights.weight_map == index["weight_map"]


@pytest.mark.parametrize(
    ("weight_map", "error"),
    [
        ({"a": "../model-00001-of-00002.safetensors"}, UnsafePath),
        ({"a": "/abs/model.safetensors"}, UnsafePath),
        ({"a": "pytorch_model-00001.bin"}, UnsafeFormat),
        ({"a": "model-00001-of-00002.safetensors"}, HeaderInvalid),  # b is not in the map
        ({"a": 1}, HeaderInvalid),
    ],
)
def test_bad_index_is_refused(
    write_file: Writer,
    tmp_path: Path,
    config: LoaderConfig,
    weight_map: dict[str, object],
    error: type[Exception],
) -> None:
    path = _shard(write_file, tmp_path, {"weight_map": weight_map})
    with pytest.raises(error):
        load(path.as_uri(), config=config)


def _hf_cache(root: Path, data: bytes, commit: str = "c0ffee" * 6 + "abcd") -> Path:
    import hashlib

    repo = root / "models--acme--tiny"
    sha = hashlib.sha256(data).hexdigest()
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / sha).write_bytes(data)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(f"../../blobs/{sha}")
    return repo


def test_hf_offline_from_a_local_hub_cache(
    write_file: Writer, tmp_path: Path, config: LoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_file({"w": torch.arange(6.0)}, "model.safetensors")
    _hf_cache(tmp_path / "hub", src.read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    got = load("hf://acme/tiny@main", config=config)
    assert torch.equal(got["w"], torch.arange(6.0))
    link = resolve("hf://acme/tiny/model.safetensors", config=config).paths[0]
    # The node cache uses the hub's own layout: models--org--repo/snapshots/<commit>/.
    assert link.parts[-4:-2] == ("models--acme--tiny", "snapshots")
    assert (link.parents[2] / "refs" / "main").read_text() == link.parent.name
    with pytest.raises(WeightsNotFound, match="offline"):
        load("hf://acme/missing", config=config)


def test_hf_blob_that_does_not_match_its_sha256_is_refused(
    write_file: Writer, tmp_path: Path, config: LoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ember.loaders import IntegrityError

    src = write_file({"w": torch.arange(6.0)}, "model.safetensors")
    repo = _hf_cache(tmp_path / "hub", src.read_bytes())
    blob = next((repo / "blobs").iterdir())
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    blob.write_bytes(bytes(data))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(IntegrityError, match="sha256"):
        load("hf://acme/tiny", config=config)


@pytest.mark.parametrize("url", ["hf://acme", "hf://ac..me/x", "hf://a/b@rev with space"])
def test_malformed_hf_urls(url: str, config: LoaderConfig) -> None:
    with pytest.raises(UnsafePath):
        load(url, config=config)


def test_config_validation_names_both_fields() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"lease_heartbeat_s .* lease_timeout_s"):
        LoaderConfig(lease_timeout_s=1.0, lease_heartbeat_s=0.9)
    with pytest.raises(pydantic.ValidationError):
        LoaderConfig(max_header_bytes=100_000_001)
    assert load.__name__ == "load"


def test_config_accepts_a_mapping(write_file: Writer, tmp_path: Path) -> None:
    path = write_file({"w": torch.ones(2)}, "m.safetensors")
    got = load(path.as_uri(), config={"cache_dir": str(tmp_path / "c"), "min_free_bytes": 0})
    assert torch.equal(got["w"], torch.ones(2)) and (tmp_path / "c").is_dir()


def test_plan_ranges_cover_the_data_exactly() -> None:
    assert plan_ranges(8, 30, 10) == [(8, 18), (18, 28), (28, 30)]
    assert plan_ranges(8, 8, 10) == []


def test_staging_copies_in_buffer_sized_pieces_and_reuses_buffers() -> None:
    copier = StagingCopier(torch.device("cpu"), 64, pin=False)
    buffers = [b.data_ptr() for b in copier.buffers]
    src = torch.randn(100, 3)  # 1200 bytes -> 19 pieces through 2 buffers of 64
    out = copier.copy(src)
    copier.synchronize()
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    assert copier.copies == 19
    assert [b.data_ptr() for b in copier.buffers] == buffers
    assert copier.copy(torch.zeros(0)).numel() == 0
    assert torch.equal(copier.copy(torch.tensor(True)), torch.tensor(True))


def test_device_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        assert select_device("auto").type == "cpu"
        with pytest.raises(ValueError, match="CUDA is not available"):
            select_device("cuda")
        # Only device selection is faked here; the copy path is exercised on CPU above.
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_device("auto").type == "cuda"


def test_load_with_auto_device_on_this_machine(write_file: Writer, config: LoaderConfig) -> None:
    path = write_file({"w": torch.arange(10.0)}, "m.safetensors")
    got = load(path.as_uri(), device="auto", config=config)
    expected_type = "cuda" if torch.cuda.is_available() else "cpu"
    assert got["w"].device.type == expected_type
    assert torch.equal(got["w"].cpu(), torch.arange(10.0))
