"""S3 through s3fs against moto's server on loopback, with and without a regional tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from ember.loaders import LoaderConfig, ObjectChanged, load, resolve
from ember.loaders._source import ObjectInfo
from ember.loaders._source_fsspec import FsspecSource

from loaders.origins import make_weights, s3_options


def _upload(s3: Any, tmp_path: Path, key: str, n: int = 16) -> tuple[str, dict[str, torch.Tensor]]:
    local = tmp_path / "up" / key
    tensors = make_weights(local, n=n)
    s3.put_file(str(local), f"{s3.bucket}/{key}")
    return f"s3://{s3.bucket}/{key}", tensors


def _replace_keeping_etag(bucket: str, key: str, data: bytes) -> None:
    """Give the object ``key`` new bytes and keep its ETag, in moto's in-process store.

    No S3 call can do this (a PUT computes a new ETag); moto's server runs in this process.
    """
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    stored = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, key)
    assert stored is not None and len(data) == stored.size
    etag = stored._etag
    stored.value = data  # type: ignore[misc]  # moto declares a setter mypy misses
    stored._etag = etag


def test_s3_load_equals_safetensors(
    s3: Any, s3_endpoint: str, tmp_path: Path, config: LoaderConfig
) -> None:
    url, _ = _upload(s3, tmp_path, "models/mlp/model.safetensors")
    cfg = config.model_copy(update={"storage_options": s3_options(s3_endpoint)})
    expected = safetensors.torch.load_file(str(tmp_path / "up/models/mlp/model.safetensors"))
    for _ in ("miss", "hit"):
        got = load(url, config=cfg)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], v) for k, v in expected.items())
    folder = load(f"s3://{s3.bucket}/models/mlp/", config=cfg)  # prefix: finds the file
    assert folder.keys() == expected.keys()


def test_regional_tier_serves_a_second_node(
    s3: Any, s3_endpoint: str, tmp_path: Path, config: LoaderConfig
) -> None:
    url, tensors = _upload(s3, tmp_path, "m/model.safetensors")
    etag_before = s3.info(f"{s3.bucket}/m/model.safetensors")["ETag"]
    options = s3_options(s3_endpoint)
    regional = f"s3://{s3.bucket}/regional-cache"
    node_a = config.model_copy(
        update={
            "storage_options": options,
            "regional_cache": regional,
            "regional_storage_options": options,
        }
    )
    resolve(url, config=node_a)
    assert s3.glob(f"{s3.bucket}/regional-cache/*/blobs/*")
    # The origin now serves other weights of the same size under the same ETag (what a
    # region must never see, and so proof of where node B's bytes come from): only a fill
    # from the region gives node B the weights node A published.
    other = {k: -v for k, v in tensors.items()}
    _replace_keeping_etag(s3.bucket, "m/model.safetensors", safetensors.torch.save(other))
    assert s3.info(f"{s3.bucket}/m/model.safetensors")["ETag"] == etag_before
    node_b = node_a.model_copy(update={"cache_dir": tmp_path / "node-b"})
    got = load(url, config=node_b)
    assert all(torch.equal(got[k], v) for k, v in tensors.items()), "node B read the origin"
    # And a node without the regional tier reads the origin's (other) bytes: the swap holds.
    alone = config.model_copy(update={"storage_options": options,
                                       "cache_dir": tmp_path / "node-c"})
    assert all(torch.equal(load(url, config=alone)[k], v) for k, v in other.items())


def test_regional_corruption_falls_back_to_origin(
    s3: Any, s3_endpoint: str, tmp_path: Path, config: LoaderConfig
) -> None:
    url, tensors = _upload(s3, tmp_path, "c/model.safetensors")
    options = s3_options(s3_endpoint)
    regional = f"s3://{s3.bucket}/rc"
    cfg = config.model_copy(
        update={
            "storage_options": options,
            "regional_cache": regional,
            "regional_storage_options": options,
        }
    )
    resolve(url, config=cfg)
    [blob] = s3.glob(f"{s3.bucket}/rc/*/blobs/*")
    data = bytearray(s3.cat_file(blob))
    data[-1] ^= 0xFF
    s3.pipe_file(blob, bytes(data))
    other = cfg.model_copy(update={"cache_dir": tmp_path / "node-c"})
    got = load(url, config=other)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert not s3.exists(blob) or s3.cat_file(blob) != bytes(data)


def test_object_overwritten_between_reads_is_detected(s3: Any, tmp_path: Path) -> None:
    url, _ = _upload(s3, tmp_path, "e/model.safetensors", n=2)
    source = FsspecSource(s3, f"{s3.bucket}/e", url=url.rsplit("/", 1)[0])
    info = source.stat("model.safetensors")
    assert len(source.read_range(info, 0, 8)) == 8
    # Same size, new bytes: only the ETag (sent as If-Match) can tell.
    data = bytearray(s3.cat_file(f"{s3.bucket}/e/model.safetensors"))
    data[-1] ^= 0xFF
    s3.pipe_file(f"{s3.bucket}/e/model.safetensors", bytes(data))
    with pytest.raises(ObjectChanged, match="ETag"):
        source.read_range(info, 8, 16)
    stale = ObjectInfo(info.name, info.size, '"0123456789abcdef0123456789abcdef"')
    with pytest.raises(ObjectChanged):
        source.read_range(stale, 0, 8)
