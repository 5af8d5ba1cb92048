"""A fill from a local origin is mapped before its hash and fsync; its seal publishes it.

The hash of a fresh fill runs on one thread and its fsync is bound by the disk's
durable writes (slower than its reads on some disks), so ``cache_write="auto"`` leaves
them, the rename, the marker and the snapshot link to a background thread. These tests
hold that thread back to see the order, and check that a fill that dies or fails before
its seal leaves no entry any lookup trusts.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ember.errors import ObjectChanged
from ember.loaders import (
    LoaderConfig,
    SnapshotLoad,
    resolve,
    snapshot_load,
    wait_for_cache_writes,
)
from ember.loaders import _copy as copy_module
from ember.loaders import _reader as reader_module
from ember.loaders import _writebehind as writebehind
from ember.loaders._tier import BlobKey, BlobRecord
from ember.loaders._tier_node import NodeTier, TempBlob

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


def test_a_local_fill_is_mapped_before_its_hash_and_seal_and_published_after(
    write_file: Writer,
    auto: LoaderConfig,
    sample_tensors: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = write_file(sample_tensors, "model.safetensors")
    hold, real_digest = threading.Event(), writebehind._digest
    hashed: list[tuple[int, str]] = []

    def held_digest(tmp: TempBlob, size: int) -> str:
        # The seal's first step: holding it holds the hash, the rename and the fsync.
        hashed.append((size, threading.current_thread().name))
        hold.wait(60)
        return real_digest(tmp, size)

    monkeypatch.setattr(writebehind, "_digest", held_digest)
    try:
        thread, out = _load_in_thread(path.as_uri(), auto)
        thread.join(30)
        assert not thread.is_alive(), "the load waited for its fill's seal"
        (got,) = out
        assert not got.restored
        for name, tensor in sample_tensors.items():
            assert torch.equal(got.tensors[name], tensor), name
        (mapped,) = got.blobs
        # The load mapped the fill's temp file; nothing is trusted yet: no blob, marker,
        # link or record.
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        assert mapped.name.startswith(".tmp-") and not (mapped.parent / sha).exists()
        assert not _marker(mapped.parent / sha).exists() and not _record(auto, got).exists()
        assert not list((auto.node_root()).glob("*/snapshots/*/model.safetensors"))
    finally:
        hold.set()
    assert wait_for_cache_writes(timeout_s=60)
    blob = mapped.parent / sha
    ((size, hashed_on),) = hashed
    assert size == path.stat().st_size and hashed_on.startswith("ember-cache-write"), hashed
    assert _marker(blob).exists() and _record(auto, got).exists() and not mapped.exists()
    for name, tensor in sample_tensors.items():  # the rename kept the mapped pages
        assert torch.equal(got.tensors[name], tensor), name
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
    (mapped,) = got.blobs
    blob = mapped.parent / hashlib.sha256(path.read_bytes()).hexdigest()
    assert not _marker(blob).exists() and not _record(auto, got).exists()
    assert not list(auto.node_root().glob("*/snapshots/*/model.safetensors"))
    again = snapshot_load(path.as_uri(), code_version="v1", config=auto)
    assert not again.restored
    assert wait_for_cache_writes(timeout_s=60) and _marker(blob).exists()
    assert snapshot_load(path.as_uri(), code_version="v1", config=auto).blobs == (blob,)


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
    key = BlobKey("ns", "v1", "model.safetensors")
    blob = _placed(node, data)  # the process dies here, before its seal
    link = node.link_path(key)  # even with a snapshot link, the marker is what is trusted
    link.parent.mkdir(parents=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    assert blob.exists() and node.hit(key) is None
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


def test_a_sealed_behind_fill_is_copied_by_the_kernel_not_through_a_buffer(
    write_file: Writer,
    auto: LoaderConfig,
    sample_tensors: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = write_file(sample_tensors, "model.safetensors")

    def no_buffer(size: int) -> object:
        raise AssertionError("the fill allocated a buffer for bytes the load maps from disk")

    copied: list[int] = []
    real_copy = os.copy_file_range

    def spy(src: int, dst: int, count: int, *offsets: int) -> int:
        copied.append(count)
        return real_copy(src, dst, count, *offsets)

    monkeypatch.setattr(reader_module, "anonymous_buffer", no_buffer)
    monkeypatch.setattr(os, "copy_file_range", spy)
    got = snapshot_load(path.as_uri(), code_version="v1", config=auto)
    for name, tensor in sample_tensors.items():
        assert torch.equal(got.tensors[name], tensor), name
    assert wait_for_cache_writes(timeout_s=60)
    assert copied, "the kernel copied nothing"


def test_without_an_in_kernel_copy_the_fill_copies_through_a_small_buffer(
    write_file: Writer,
    auto: LoaderConfig,
    sample_tensors: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = write_file(sample_tensors, "model.safetensors")

    def unsupported(*args: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    def no_buffer(size: int) -> object:
        raise AssertionError("the fallback allocated a whole-file buffer")

    monkeypatch.setattr(os, "copy_file_range", unsupported)
    monkeypatch.setattr(reader_module, "anonymous_buffer", no_buffer)
    got = snapshot_load(path.as_uri(), code_version="v1", config=auto)
    for name, tensor in sample_tensors.items():
        assert torch.equal(got.tensors[name], tensor), name
    assert wait_for_cache_writes(timeout_s=60)
    (mapped,) = got.blobs
    blob = mapped.parent / hashlib.sha256(path.read_bytes()).hexdigest()
    assert blob.read_bytes() == path.read_bytes()


def test_an_origin_changed_during_the_copy_fails_the_load_and_leaves_nothing(
    write_file: Writer,
    auto: LoaderConfig,
    sample_tensors: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = write_file(sample_tensors, "model.safetensors")
    real_copy = copy_module._copy_range

    def copy_then_change(src: int, tmp: TempBlob, start: int, end: int, where: str) -> int:
        done = real_copy(src, tmp, start, end, where)
        with path.open("r+b") as f:  # the same file, written in place while it is read
            f.seek(-1, os.SEEK_END)
            f.write(b"\x01")
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000_000))
        return done

    monkeypatch.setattr(copy_module, "_copy_range", copy_then_change)
    with pytest.raises(ObjectChanged):
        snapshot_load(path.as_uri(), code_version="v1", config=auto)
    assert wait_for_cache_writes(timeout_s=60)
    assert not [p for p in auto.node_root().glob("*/blobs/*")], "a fill left a file behind"


def test_a_fill_holds_one_file_buffer_at_a_time(
    write_file: Writer,
    config: LoaderConfig,
    sample_tensors: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``resolve`` of a sharded model reads each file into a buffer: once a file is in the
    node cache, its buffer goes (the whole model in anonymous memory would be a copy)."""
    import gc
    import json
    import mmap
    import weakref

    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    weight_map: dict[str, str] = {}
    for i, name in enumerate(names):
        shard = {f"{key}.{i}": value for key, value in sample_tensors.items()}
        path = write_file(shard, name)
        weight_map |= dict.fromkeys(shard, name)
    (path.parent / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    buffers: list[weakref.ref[mmap.mmap]] = []
    alive_before: list[int] = []
    real_buffer = reader_module.anonymous_buffer

    def tracked(size: int) -> mmap.mmap:
        gc.collect()
        alive_before.append(sum(ref() is not None for ref in buffers))
        buffer = real_buffer(size)
        buffers.append(weakref.ref(buffer))
        return buffer

    monkeypatch.setattr(reader_module, "anonymous_buffer", tracked)
    weights = resolve(path.parent.as_uri(), config=config)
    assert len(weights.paths) == 3
    assert alive_before == [0, 0, 0], f"earlier files' buffers alive at each read: {alive_before}"


@pytest.mark.parametrize("cache_write", ["auto", "behind"])
def test_a_seal_the_queue_refuses_finishes_its_ticket_and_leaves_no_temp_file(
    write_file: Writer,
    config: LoaderConfig,
    sample_tensors: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
    cache_write: str,
) -> None:
    # At interpreter shutdown the write-behind pool takes no new work; a shut-down pool
    # refuses the same way. A fill whose seal ("auto") or write ("behind") is refused must
    # still finish its ticket, or the next load of the same file in this process waits on
    # it; the snapshot record queued after them is skipped. Before, the load failed.
    path = write_file(sample_tensors, "model.safetensors")
    refusing = ThreadPoolExecutor(1)
    refusing.shutdown()
    chosen = config.model_copy(update={"cache_write": cache_write})
    with monkeypatch.context() as patch:
        patch.setattr(writebehind, "_pool", refusing)
        got = snapshot_load(path.as_uri(), code_version="v1", config=chosen)
    assert torch.equal(got.tensors["embed.weight"], sample_tensors["embed.weight"])
    assert not list(chosen.node_root().glob("*/blobs/.tmp-*"))
    thread, out = _load_in_thread(path.as_uri(), chosen)
    thread.join(20)  # under the 30 s lease: a ticket left unfinished makes this wait
    assert out and torch.equal(out[0].tensors["embed.weight"], sample_tensors["embed.weight"])
    assert wait_for_cache_writes(timeout_s=60)
    assert snapshot_load(path.as_uri(), code_version="v1", config=chosen).restored
