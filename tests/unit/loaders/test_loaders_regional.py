"""The regional tier on a local directory: its markers' BLAKE3, checked by every reader.

The regional tier is any fsspec URL; a ``file://`` one is the same code as S3's (the S3
flavour runs against moto in ``tests/integration/loaders/test_s3.py``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import blake3
import pytest
import torch

from ember.loaders import LoaderConfig, load

Writer = Callable[[dict[str, torch.Tensor], str], Path]


def _node(config: LoaderConfig, tmp_path: Path, name: str) -> LoaderConfig:
    return config.model_copy(update={"cache_dir": tmp_path / name,
                                     "regional_cache": f"file://{tmp_path / 'region'}"})


def _one(tmp_path: Path, kind: str) -> Path:
    [path] = (tmp_path / "region").glob(f"*/{kind}/*")
    return path


def _assert_region_sound(tmp_path: Path) -> None:
    """The spoilt blob was dropped; node B's fill from the origin published it again."""
    blob, marker = _one(tmp_path, "blobs"), json.loads(_one(tmp_path, "markers").read_text())
    data = blob.read_bytes()
    assert hashlib.sha256(data).hexdigest() == blob.name == marker["sha256"]
    assert blake3.blake3(data).hexdigest() == marker["blake3"]


def _filled_region(config: LoaderConfig, tmp_path: Path, write_file: Writer,
                   tensors: dict[str, torch.Tensor]) -> str:
    origin = write_file(tensors, "model.safetensors")
    load(f"file://{origin}", config=_node(config, tmp_path, "node-a"))
    return f"file://{origin}"


def test_marker_records_the_blobs_blake3(
    config: LoaderConfig, tmp_path: Path, write_file: Writer,
    sample_tensors: dict[str, torch.Tensor],
) -> None:
    _filled_region(config, tmp_path, write_file, sample_tensors)
    blob, marker = _one(tmp_path, "blobs"), json.loads(_one(tmp_path, "markers").read_text())
    assert marker["blake3"] == blake3.blake3(blob.read_bytes()).hexdigest()
    assert marker["sha256"] == blob.name


def test_a_second_node_verifies_blake3_and_keeps_the_markers_sha256(
    config: LoaderConfig, tmp_path: Path, write_file: Writer,
    sample_tensors: dict[str, torch.Tensor],
) -> None:
    url = _filled_region(config, tmp_path, write_file, sample_tensors)
    sha = _one(tmp_path, "blobs").name
    got = load(url, config=_node(config, tmp_path, "node-b"))
    assert all(torch.equal(got[k], v) for k, v in sample_tensors.items())
    # Node B's cache names the blob by the SHA-256 the marker vouched for.
    assert [p.name for p in (tmp_path / "node-b").glob("*/blobs/*")] == [sha]


@pytest.mark.parametrize("spoil", ["blob", "marker_blake3"])
def test_a_blake3_mismatch_is_refused_and_the_origin_serves(
    config: LoaderConfig, tmp_path: Path, write_file: Writer,
    sample_tensors: dict[str, torch.Tensor], spoil: str,
) -> None:
    url = _filled_region(config, tmp_path, write_file, sample_tensors)
    blob, marker_path = _one(tmp_path, "blobs"), _one(tmp_path, "markers")
    if spoil == "blob":  # the same size, one byte flipped: only a checksum sees it
        data = bytearray(blob.read_bytes())
        data[-1] ^= 0xFF
        blob.write_bytes(bytes(data))
    else:  # the blob is intact; only BLAKE3 (not SHA-256) can tell it from its marker
        marker = json.loads(marker_path.read_text())
        marker["blake3"] = "0" * 64
        marker_path.write_text(json.dumps(marker))
    got = load(url, config=_node(config, tmp_path, "node-b"))
    assert all(torch.equal(got[k], v) for k, v in sample_tensors.items())
    _assert_region_sound(tmp_path)


def test_a_marker_without_blake3_is_verified_by_sha256(
    config: LoaderConfig, tmp_path: Path, write_file: Writer,
    sample_tensors: dict[str, torch.Tensor],
) -> None:
    url = _filled_region(config, tmp_path, write_file, sample_tensors)
    blob, marker_path = _one(tmp_path, "blobs"), _one(tmp_path, "markers")
    marker = json.loads(marker_path.read_text())
    del marker["blake3"]  # as a marker written before markers carried it
    marker_path.write_text(json.dumps(marker))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    got = load(url, config=_node(config, tmp_path, "node-b"))
    assert all(torch.equal(got[k], v) for k, v in sample_tensors.items())
    _assert_region_sound(tmp_path)
