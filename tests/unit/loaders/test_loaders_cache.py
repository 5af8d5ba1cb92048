"""The node cache: verification on hit, eviction, bounds, unsafe paths, leases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ember.loaders import CacheFull, HeaderInvalid, LoaderConfig, UnsafePath, load, resolve
from ember.loaders._lease import Lease, acquire
from ember.loaders._paths import check_relative, within
from ember.loaders._tier_node import NodeTier, mapped_blobs

Writer = Callable[[dict[str, torch.Tensor], str], Path]


def _blob(config: LoaderConfig, path: Path) -> Path:
    return resolve(path.as_uri(), config=config).paths[0].resolve()


def test_truncated_blob_is_detected_and_refetched(
    write_file: Writer, config: LoaderConfig, sample_tensors: dict[str, torch.Tensor]
) -> None:
    path = write_file(sample_tensors, "model.safetensors")
    blob = _blob(config, path)
    size = blob.stat().st_size
    os.truncate(blob, size // 2)
    got = load(path.as_uri(), config=config)
    assert torch.equal(got["embed.weight"], sample_tensors["embed.weight"])
    assert _blob(config, path).stat().st_size == size


def test_corrupted_header_is_detected_and_refetched(
    write_file: Writer, config: LoaderConfig, sample_tensors: dict[str, torch.Tensor]
) -> None:
    path = write_file(sample_tensors, "model.safetensors")
    blob = _blob(config, path)
    data = bytearray(blob.read_bytes())
    data[8] = ord("[")  # same size, broken JSON
    blob.write_bytes(bytes(data))
    got = load(path.as_uri(), config=config)
    assert torch.equal(got["positions"], sample_tensors["positions"])
    assert _blob(config, path).read_bytes()[8:9] == b"{"


def test_verify_hits_catches_flipped_tensor_bytes(
    write_file: Writer, config: LoaderConfig, sample_tensors: dict[str, torch.Tensor]
) -> None:
    path = write_file(sample_tensors, "model.safetensors")
    blob = _blob(config, path)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    strict = config.model_copy(update={"verify_hits": True})
    got = load(path.as_uri(), config=strict)
    assert torch.equal(got["empty"], sample_tensors["empty"])
    assert bytes(_blob(config, path).read_bytes()) == path.read_bytes()


def test_lru_eviction_by_unlink_keeps_open_mappings_valid(
    write_file: Writer, config: LoaderConfig
) -> None:
    files = {
        k: write_file({"w": torch.full((1000,), float(i))}, f"{k}.safetensors")
        for i, k in enumerate("abc")
    }
    one = files["a"].stat().st_size
    capped = config.model_copy(update={"cache_max_bytes": 2 * one + 10})
    held = load(files["a"].as_uri(), config=capped)["w"]
    load(files["b"].as_uri(), config=capped)
    time.sleep(0.02)
    load(files["a"].as_uri(), config=capped)  # a is now more recently used than b
    load(files["c"].as_uri(), config=capped)
    node = NodeTier(capped)
    cached = {e.names[0].rsplit("/", 1)[-1] for e in node.entries()}
    assert cached == {"a.safetensors", "c.safetensors"}
    assert sum(e.size for e in node.entries()) <= capped.cache_max_bytes
    assert torch.equal(held, torch.full((1000,), 0.0))


# Maps the file it is given (as a replica maps its weights), says "mapped", and holds the
# mapping until its stdin closes.
_MAPPER = """
import mmap, sys
with open(sys.argv[1], "rb") as f:
    view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("mapped", flush=True)
sys.stdin.readline()
"""


def test_eviction_passes_over_a_blob_another_process_maps(
    write_file: Writer, config: LoaderConfig
) -> None:
    files = {
        k: write_file({"w": torch.full((1000,), float(i))}, f"{k}.safetensors")
        for i, k in enumerate("abc")
    }
    one = files["a"].stat().st_size
    capped = config.model_copy(update={"cache_max_bytes": 2 * one + 10})
    blob_a = _blob(capped, files["a"])  # a is the least recently used
    time.sleep(0.02)
    load(files["b"].as_uri(), config=capped)
    mapper = subprocess.Popen([sys.executable, "-c", _MAPPER, str(blob_a)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert mapper.stdout is not None and mapper.stdout.readline().strip() == "mapped"
        load(files["c"].as_uri(), config=capped)  # evicts b: a is mapped by the other process
        cached = {e.names[0].rsplit("/", 1)[-1] for e in NodeTier(capped).entries()}
        assert cached == {"a.safetensors", "c.safetensors"}
        # Only mapped blobs are left to evict: the fill is refused, naming them.
        load(files["b"].as_uri(), config=capped)  # a fresh b evicts c (unmapped)
        with pytest.raises(CacheFull, match=f"{one} bytes are blobs that running processes map"):
            NodeTier(capped).make_room(2 * one)
    finally:
        assert mapper.stdin is not None
        mapper.stdin.close()
        mapper.wait(timeout=30)


def test_a_mapped_blob_is_named_by_its_namespace_and_an_unlinked_one_is_not(
    write_file: Writer, config: LoaderConfig
) -> None:
    blob = _blob(config, write_file({"w": torch.zeros(1000)}, "a.safetensors"))
    namespace = blob.parent.parent.name
    mapper = subprocess.Popen([sys.executable, "-c", _MAPPER, str(blob)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert mapper.stdout is not None and mapper.stdout.readline().strip() == "mapped"
        root = Path(str(config.cache_dir))
        assert mapped_blobs(root) == {(namespace, blob.name)}
        # Unlinked, the mapping is of a file no name leads to: a blob filled again under
        # that name is not held by it.
        NodeTier(config).remove(namespace, blob.name)
        assert mapped_blobs(root) == set()
    finally:
        assert mapper.stdin is not None
        mapper.stdin.close()
        mapper.wait(timeout=30)


def test_blob_over_the_cap_is_refused_and_leaves_nothing(
    write_file: Writer, config: LoaderConfig
) -> None:
    path = write_file({"w": torch.zeros(4096)}, "big.safetensors")
    tiny = config.model_copy(update={"cache_max_bytes": 1024})
    with pytest.raises(CacheFull, match="cache_max_bytes=1024"):
        load(path.as_uri(), config=tiny)
    assert not list(Path(str(config.cache_dir)).glob("*/blobs/*"))


def test_free_disk_floor_is_checked_before_a_fill(write_file: Writer, config: LoaderConfig) -> None:
    path = write_file({"w": torch.zeros(16)}, "w.safetensors")
    greedy = config.model_copy(update={"min_free_bytes": 1 << 60})
    with pytest.raises(CacheFull, match="min_free_bytes"):
        load(path.as_uri(), config=greedy)
    assert not list(Path(str(config.cache_dir)).glob("*/blobs/*"))


def test_snapshot_link_out_of_the_root_is_refused(
    write_file: Writer, config: LoaderConfig, tmp_path: Path
) -> None:
    path = write_file({"w": torch.zeros(16)}, "w.safetensors")
    link = resolve(path.as_uri(), config=config).paths[0]
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(path.read_bytes())
    link.unlink()
    link.symlink_to(outside)
    with pytest.raises(UnsafePath, match="outside the cache root"):
        load(path.as_uri(), config=config)


@pytest.mark.parametrize(
    "name", ["../x.safetensors", "/etc/passwd", "a\\b.safetensors", "a\0b", "a/../../b", "", "./a"]
)
def test_unsafe_names_are_refused(name: str) -> None:
    with pytest.raises(UnsafePath):
        check_relative(name)


def test_within_refuses_symlink_escape(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "esc").symlink_to(tmp_path)
    with pytest.raises(UnsafePath):
        within(root, root / "esc" / "x")
    assert within(root, root / "ok") == (root / "ok").resolve()


def test_temp_of_a_dead_filler_is_swept(config: LoaderConfig) -> None:
    node = NodeTier(config)
    blobs = node.root / "ns" / "blobs"
    blobs.mkdir(parents=True)
    import socket

    from ember.loaders._paths import component

    dead = blobs / f".tmp-{component(socket.gethostname())}-999999999-abc"
    live = blobs / f".tmp-{component(socket.gethostname())}-{os.getpid()}-def"
    elsewhere = blobs / ".tmp-otherhost-42-ghi"
    for path in (dead, live, elsewhere):
        path.write_bytes(b"partial")
    old = time.time() - 10 * max(10 * config.lease_timeout_s, 600.0)
    os.utime(live, (old, old))  # a live filler's seal may wait long in the queue
    node.sweep_temps()
    assert not dead.exists() and live.exists() and elsewhere.exists()
    os.utime(elsewhere, (old, old))  # another host's: judged by its age alone
    node.sweep_temps()
    assert not elsewhere.exists() and live.exists()


def _lease_args(config: LoaderConfig) -> dict[str, float]:
    return {
        "timeout_s": config.lease_timeout_s,
        "heartbeat_s": config.lease_heartbeat_s,
        "poll_s": config.poll_interval_s,
    }


def test_a_failed_fill_error_reaches_a_waiter(tmp_path: Path, config: LoaderConfig) -> None:
    path = tmp_path / "k.lease"
    holder = acquire(path, lambda: None, **_lease_args(config))
    assert isinstance(holder, Lease)
    caught: list[BaseException] = []

    def wait() -> None:
        try:
            acquire(path, lambda: None, **_lease_args(config))
        except HeaderInvalid as exc:
            caught.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    holder.release(HeaderInvalid(name="m", reason="bad dtype"))
    waiter.join(10)
    assert [getattr(e, "reason", None) for e in caught] == ["bad dtype"]


def test_a_holder_gone_before_the_waiter_reads_its_lease_does_not_strand_the_waiter(
    tmp_path: Path, config: LoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder released (without publishing) between this waiter's failed create and its
    first read: no lease will ever appear, so the waiter must try to take it, not poll
    forever."""
    from ember.loaders import _lease

    real, lost = _lease._try_create, list[Path]()

    def lost_the_race(path: Path, heartbeat_s: float) -> Lease | None:
        if not lost:
            lost.append(path)  # someone else held it at that instant, and is gone now
            return None
        return real(path, heartbeat_s)

    monkeypatch.setattr(_lease, "_try_create", lost_the_race)
    got: list[object] = []
    waiter = threading.Thread(
        target=lambda: got.append(acquire(tmp_path / "k.lease", lambda: None,
                                          **_lease_args(config))), daemon=True)
    waiter.start()
    waiter.join(10)
    assert lost and len(got) == 1 and isinstance(got[0], Lease), "the waiter is stranded"
    got[0].release()


def test_dead_holder_is_taken_over_and_live_heartbeat_is_not(
    tmp_path: Path, config: LoaderConfig
) -> None:
    path = tmp_path / "k.lease"
    import socket

    path.write_text(json.dumps({"token": "t", "pid": 999999999, "host": socket.gethostname()}))
    config = config.model_copy(update={"lease_timeout_s": 0.5, "lease_heartbeat_s": 0.1})
    start = time.monotonic()
    taken = acquire(path, lambda: None, **_lease_args(config))
    assert isinstance(taken, Lease) and time.monotonic() - start < 1.0
    # A live holder that outlives the timeout keeps its lease through the heartbeat.
    done = threading.Event()
    threading.Timer(3 * config.lease_timeout_s, done.set).start()
    result = acquire(path, lambda: "published" if done.is_set() else None, **_lease_args(config))
    assert result == "published"
    taken.release()
    assert not path.exists()


def test_stale_heartbeat_from_another_host_is_taken_over(
    tmp_path: Path, config: LoaderConfig
) -> None:
    path = tmp_path / "k.lease"
    path.write_text(json.dumps({"token": "t", "pid": 1, "host": "other-host"}))
    old = time.time() - 10 * config.lease_timeout_s
    os.utime(path, (old, old))
    taken = acquire(path, lambda: None, **_lease_args(config))
    assert isinstance(taken, Lease)
    taken.release()


def test_a_failed_publish_closes_the_temp_file_once(
    config: LoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rename that fails after the temp file was closed must not close its fd number
    again: by then another thread (the cache write runs in the background) may own it."""
    from ember.loaders._tier import BlobKey, BlobRecord

    node = NodeTier(config)
    key = BlobKey("ns--x--0", "v1", "m.safetensors")
    tmp = node.begin_fill(key, 4)
    tmp.write_at(0, memoryview(b"abcd"))
    reused: list[int] = []

    def replace_fails(src: object, dst: object) -> None:
        reused.append(os.open(os.devnull, os.O_RDONLY))  # takes the number just closed
        raise OSError("the cache directory was removed")

    monkeypatch.setattr(os, "replace", replace_fails)
    with pytest.raises(OSError, match="removed"):
        node.commit(key, tmp, BlobRecord("0" * 64, 4))
    tmp.discard()
    os.fstat(reused[0])  # still open: neither commit nor discard closed it a second time
    os.close(reused[0])
    assert not tmp.path.exists()
