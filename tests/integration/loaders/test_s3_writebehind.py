"""A replica's load from S3 with write-behind, against moto's server on loopback.

The server records every request (``harness.S3Log``), so the tests can count what the
load asked for: one listing of the prefix, and every byte of every file in exactly one
ranged GET. The node-cache write is held back (or slowed, or killed) to show that the load
does not wait for it, that an entry appears only whole and verified, and that a process
killed midway leaves no entry at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from ember.loaders import LoaderConfig, NodeTier, ObjectChanged, snapshot_load
from ember.loaders import _writebehind as writebehind
from ember.loaders._snapshot import SNAPSHOT_DIR
from ember.loaders._source_s3 import S3Source

from harness import S3Log
from loaders.origins import make_weights, s3_options, subprocess_env

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _sharded(s3: Any, tmp_path: Path, prefix: str) -> tuple[str, dict[str, Path]]:
    """Two shards of eight 16 KiB tensors each and their index, uploaded under ``prefix``."""
    local = tmp_path / "up" / prefix
    weight_map: dict[str, str] = {}
    paths: dict[str, Path] = {}
    for i, shard in enumerate(SHARDS):
        tensors = make_weights(local / shard, n=8 + i)
        renamed = {f"s{i}.{k}": v for k, v in tensors.items()}
        safetensors.torch.save_file(renamed, str(local / shard))
        weight_map.update(dict.fromkeys(renamed, shard))
        paths[shard] = local / shard
    index = local / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    paths[index.name] = index
    for name, path in paths.items():
        s3.put_file(str(path), f"{s3.bucket}/{prefix}/{name}")
    return f"s3://{s3.bucket}/{prefix}/", paths


def _behind(config: LoaderConfig, endpoint: str) -> LoaderConfig:
    return config.model_copy(update={"storage_options": s3_options(endpoint),
                                     "cache_write": "auto"})  # behind for s3://


def _covered_once(ranges: list[str], size: int) -> bool:
    """Whether the ``bytes=a-b`` ranges tile ``[0, size)`` with no gap and no overlap."""
    spans = sorted(tuple(map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r).groups()))  # type: ignore[union-attr]
                   for r in ranges)
    cursor = 0
    for first, last in spans:
        if first != cursor:
            return False
        cursor = last + 1
    return cursor == size


def _published_problems(root: Path) -> list[str]:
    """Every published entry whose blob is missing, short or not the bytes its name says."""
    problems = []
    for marker in root.glob("*/markers/*.json"):
        sha = marker.name.removesuffix(".json")
        blob = marker.parent.parent / "blobs" / sha
        try:
            doc = json.loads(marker.read_text())
            data = blob.read_bytes()
        except (OSError, ValueError) as exc:
            problems.append(f"{sha[:12]}: {exc}")
            continue
        if len(data) != doc["size"] or hashlib.sha256(data).hexdigest() != sha:
            problems.append(f"{sha[:12]}: {len(data)} bytes, not the published blob")
    for link in root.glob("*/snapshots/*/*"):
        if not (link.parent.parent.parent / "markers" / f"{link.resolve().name}.json").exists():
            problems.append(f"link {link.name} before its marker")
    return problems


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[Callable[[Path], list[str]]]:
    """Check the node cache's published entries over and over while the test runs."""
    stop = threading.Event()
    seen: list[str] = []
    roots: list[Path] = []

    def watch() -> None:
        while not stop.wait(0.005):
            for root in roots:
                seen.extend(_published_problems(root))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()

    def add(root: Path) -> list[str]:
        roots.append(root)
        return seen

    yield add
    stop.set()
    thread.join(timeout=10)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold every node-cache write until the test opens the gate."""
    opened = threading.Event()
    original = writebehind._copy_and_hash

    def held(job: Any, tmp: Any) -> str:
        opened.wait(timeout=120)
        return original(job, tmp)

    monkeypatch.setattr(writebehind, "_copy_and_hash", held)
    yield opened
    opened.set()
    writebehind.wait_all(timeout_s=60)


def test_replica_load_lists_once_reads_each_byte_once_and_publishes_behind(
    s3: Any, s3_endpoint: str, s3_log: S3Log, tmp_path: Path, config: LoaderConfig,
    gate: threading.Event, watched: Callable[[Path], list[str]],
) -> None:
    url, paths = _sharded(s3, tmp_path, "ladder/m")
    cfg = _behind(config, s3_endpoint)
    problems = watched(cfg.node_root())
    before = len(s3_log.for_bucket(s3.bucket))
    with ThreadPoolExecutor(1) as pool:  # the cache write is held: the load must not wait
        got = pool.submit(snapshot_load, url, code_version="v1", config=cfg).result(timeout=60)
    node = NodeTier(cfg)
    assert node.entries() == [], "an entry was published before its write was allowed"
    expected: dict[str, torch.Tensor] = {}
    for shard in SHARDS:
        expected.update(safetensors.torch.load_file(str(paths[shard])))
    assert got.tensors.keys() == expected.keys()
    assert all(torch.equal(got.tensors[k], v) for k, v in expected.items())

    requests = s3_log.for_bucket(s3.bucket)[before:]
    listings = [r for r in requests if r.method == "GET" and "list-type=2" in r.query]
    assert len(listings) == 1, listings
    assert [r for r in requests if r.method == "HEAD"] == []
    for name, path in paths.items():
        key = f"/{s3.bucket}/ladder/m/{name}"
        gets = [r for r in requests if r.method == "GET" and r.path == key]
        assert all(r.range for r in gets), f"{name}: a GET without Range"
        assert _covered_once([r.range for r in gets], path.stat().st_size), (name, gets)

    gate.set()
    assert writebehind.wait_all(timeout_s=60)
    published = {e.sha256 for e in node.entries()}
    assert published == {hashlib.sha256(paths[s].read_bytes()).hexdigest() for s in SHARDS}
    assert (cfg.node_root() / SNAPSHOT_DIR / f"{got.key}.json").exists()
    assert _published_problems(cfg.node_root()) == []
    assert problems == []  # nor at any moment while the entries were being published
    again = snapshot_load(url, code_version="v1", config=cfg)  # the next replica: no origin
    assert again.restored and len(s3_log.for_bucket(s3.bucket)) == before + len(requests)


def _mapped_file(address: int) -> str | None:
    """The file this process maps at ``address`` ("" for anonymous memory), from its maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in parts[0].split("-"))
        if low <= address < high:
            return parts[5] if len(parts) > 5 else ""
    return None


def test_once_published_a_fresh_s3_loads_tensors_are_the_blobs_pages(
    s3: Any, s3_endpoint: str, tmp_path: Path, config: LoaderConfig,
) -> None:
    """Write-behind leaves one copy of the weights on the node: once a blob is published,
    the tensors built on the load's buffer sit on the blob's pages (the ones every later
    replica maps), and the anonymous copy is gone."""
    url, _ = _sharded(s3, tmp_path, "onecopy/m")
    cfg = _behind(config, s3_endpoint)
    got = snapshot_load(url, code_version="v1", config=cfg)
    expected = {k: v.clone() for k, v in got.tensors.items()}
    assert writebehind.wait_all(timeout_s=60)
    blobs = {str(p) for p in cfg.node_root().glob("*/blobs/*") if not p.name.startswith(".")}
    assert len(blobs) == len(SHARDS)
    for name, tensor in got.tensors.items():
        where = _mapped_file(tensor.untyped_storage().data_ptr())
        assert where in blobs, f"{name} is on {where!r}, not a published blob"
        assert torch.equal(tensor, expected[name])


CHILD = """
import sys, time
from ember.loaders import load, _writebehind, _tier_node
_writebehind._CHUNK_BYTES = 4096
slow = _tier_node.TempBlob.write_at
def write_at(self, offset, data):
    time.sleep(0.05)
    return slow(self, offset, data)
_tier_node.TempBlob.write_at = write_at
tensors = load(sys.argv[1], config={config})
print("loaded", len(tensors), flush=True)
time.sleep(120)
"""


def test_a_fill_killed_midway_leaves_no_entry(
    s3: Any, s3_endpoint: str, tmp_path: Path, config: LoaderConfig
) -> None:
    url, paths = _sharded(s3, tmp_path, "killed/m")
    cfg = _behind(config, s3_endpoint)
    options = cfg.model_dump(mode="json")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(config=repr(options)), url], env=subprocess_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    root = cfg.node_root()
    try:
        assert child.stdout is not None and child.stderr is not None
        assert child.stdout.readline().startswith("loaded"), child.stderr.read()[-2000:]
        deadline = time.monotonic() + 60
        while not any(p.stat().st_size for p in root.glob("*/blobs/.tmp-*")):
            assert time.monotonic() < deadline, "the cache write never started"
            time.sleep(0.02)
    finally:
        os.kill(child.pid, signal.SIGKILL)  # midway through the (slowed) cache write
        child.wait(timeout=60)
    node = NodeTier(cfg)
    assert node.entries() == []
    assert list(root.glob("*/markers/*")) == []
    assert [p for p in root.glob("*/snapshots/**/*") if not p.is_dir()] == []
    assert {p.name[:5] for p in root.glob("*/blobs/*")} == {".tmp-"}
    # The next fill sweeps the dead process's temp file and publishes whole blobs.
    snapshot_load(url, config=cfg.model_copy(update={"cache_write": "through"}))
    assert not list(root.glob("*/blobs/.tmp-*"))
    assert {e.sha256 for e in node.entries()} == {
        hashlib.sha256(paths[s].read_bytes()).hexdigest() for s in SHARDS}


def test_s3_reads_pin_the_listed_etag(s3: Any, s3_endpoint: str, tmp_path: Path) -> None:
    url, _ = _sharded(s3, tmp_path, "pinned/m")
    source = S3Source(url, s3_options(s3_endpoint))
    info = source.stat(SHARDS[0])
    assert len(source.read_range(info, 0, 8)) == 8
    key = f"{s3.bucket}/pinned/m/{SHARDS[0]}"
    data = bytearray(s3.cat_file(key))
    data[-1] ^= 0xFF
    s3.pipe_file(key, bytes(data))  # same size, new bytes: only If-Match can tell
    with pytest.raises(ObjectChanged, match="ETag"):
        source.read_range(info, 8, 16)
