"""A fill from a local origin is mapped before its fsync; its seal publishes it afterwards.

The fsync of a fresh fill is bound by the disk's durable writes (slower than its reads on
some disks), so ``cache_write="auto"`` leaves it, the marker and the snapshot link to a
background thread. These tests hold that thread back to see the order, and check that a
fill that dies or fails before its seal leaves no entry any lookup trusts.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ember.loaders import LoaderConfig, SnapshotLoad, snapshot_load, wait_for_cache_writes
from ember.loaders._tier import BlobKey, BlobRecord
from ember.loaders._tier_node import NodeTier

Writer = Callable[[dict[str, torch.Tensor], str], Path]


@pytest.fixture
def auto(config: LoaderConfig) -> LoaderConfig:
    return config.model_copy(update={"cache_write": "auto"})


def _marker(blob: Path) -> Path:
    return blob.parent.parent / "markers" / f"{blob.name}.json"


def _record(config: LoaderConfig, got: SnapshotLoad) -> Path:
    return config.node_root() / "snapshots" / f"{got.key}.json"


def _load_in_thread(url: str, config: LoaderConfig) -> tuple[threading.Thread, list[SnapshotLoad]]:
    out: list[SnapshotLoad] = []
    thread = threading.Thread(
        target=lambda: out.append(snapshot_load(url, code_version="v1", config=config)),
        daemon=True,
    )
    thread.start()
    return thread, out


def test_a_local_fill_is_mapped_before_its_seal_and_published_after(
    write_file: Writer,
    auto: LoaderConfig,
    sample_tensors: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = write_file(sample_tensors, "model.safetensors")
    hold, real_seal = threading.Event(), NodeTier.seal

    def held_seal(self: NodeTier, key: BlobKey, blob: Path, record: BlobRecord) -> object:
        hold.wait(60)
        return real_seal(self, key, blob, record)

    monkeypatch.setattr(NodeTier, "seal", held_seal)
    try:
        thread, out = _load_in_thread(path.as_uri(), auto)
        thread.join(30)
        assert not thread.is_alive(), "the load waited for its fill's seal"
        (got,) = out
        assert not got.restored
        for name, tensor in sample_tensors.items():
            assert torch.equal(got.tensors[name], tensor), name
        (blob,) = got.blobs
        # Placed under its checksum, but not trusted yet: no marker, link or record.
        assert blob.name == hashlib.sha256(path.read_bytes()).hexdigest()
        assert not _marker(blob).exists() and not _record(auto, got).exists()
        assert not list((auto.node_root()).glob("*/snapshots/*/model.safetensors"))
    finally:
        hold.set()
    assert wait_for_cache_writes(timeout_s=60)
    assert _marker(blob).exists() and _record(auto, got).exists()
    again = snapshot_load(path.as_uri(), code_version="v1", config=auto)
    assert again.restored and again.blobs == (blob,)


def test_through_waits_for_the_seal(
    write_file: Writer, config: LoaderConfig, sample_tensors: dict[str, torch.Tensor]
) -> None:
    path = write_file(sample_tensors, "model.safetensors")
    got = snapshot_load(path.as_uri(), code_version="v1", config=config)
    (blob,) = got.blobs
    assert _marker(blob).exists() and _record(config, got).exists()


def test_a_failed_seal_publishes_nothing_and_the_next_load_fills_again(
    write_file: Writer,
    auto: LoaderConfig,
    sample_tensors: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = write_file(sample_tensors, "model.safetensors")

    def failing_seal(self: NodeTier, key: BlobKey, blob: Path, record: BlobRecord) -> object:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(NodeTier, "seal", failing_seal)
        got = snapshot_load(path.as_uri(), code_version="v1", config=auto)
        assert wait_for_cache_writes(timeout_s=60)
    assert torch.equal(got.tensors["embed.weight"], sample_tensors["embed.weight"])
    (blob,) = got.blobs
    assert not _marker(blob).exists() and not _record(auto, got).exists()
    assert not list(auto.node_root().glob("*/snapshots/*/model.safetensors"))
    again = snapshot_load(path.as_uri(), code_version="v1", config=auto)
    assert not again.restored and again.blobs == (blob,)
    assert wait_for_cache_writes(timeout_s=60) and _marker(blob).exists()


def _placed(node: NodeTier, data: bytes, name: str = "model.safetensors") -> Path:
    key = BlobKey("ns", "v1", name)
    tmp = node.begin_fill(key, len(data))
    tmp.write_at(0, memoryview(data))
    return node.place(key, tmp, BlobRecord(hashlib.sha256(data).hexdigest(), len(data)))


def test_a_blob_placed_but_never_sealed_is_not_trusted_and_is_swept_once_stale(
    auto: LoaderConfig,
) -> None:
    node = NodeTier(auto)
    data = os.urandom(4096)
    blob = _placed(node, data)  # the process dies here, before its seal
    assert blob.exists() and node.hit(BlobKey("ns", "v1", "model.safetensors")) is None
    assert not node.entries()  # nor counted, nor evicted: it is not an entry
    node.sweep_temps()
    assert blob.exists(), "a young placed blob may still be sealing"
    stale = time.time() - 2 * max(10 * auto.lease_timeout_s, 600.0)
    os.utime(blob, (stale, stale))
    node.sweep_temps()
    assert not blob.exists()


def test_a_sealed_blob_is_not_swept_however_old(auto: LoaderConfig) -> None:
    node = NodeTier(auto)
    data = os.urandom(4096)
    key = BlobKey("ns", "v1", "model.safetensors")
    record = BlobRecord(hashlib.sha256(data).hexdigest(), len(data))
    hit = node.seal(key, _placed(node, data), record)
    stale = time.time() - 2 * max(10 * auto.lease_timeout_s, 600.0)
    os.utime(hit.path, (stale, stale))
    node.sweep_temps()
    assert node.hit(key) is not None


def test_placing_bytes_already_published_keeps_the_durable_blob(auto: LoaderConfig) -> None:
    node = NodeTier(auto)
    data = os.urandom(4096)
    key = BlobKey("ns", "v1", "model.safetensors")
    record = BlobRecord(hashlib.sha256(data).hexdigest(), len(data))
    first = node.seal(key, _placed(node, data), record)
    inode = first.path.stat().st_ino
    again = _placed(node, data, "copy.safetensors")
    assert again == first.path and again.stat().st_ino == inode
    assert not list(first.path.parent.glob(".tmp-*"))
