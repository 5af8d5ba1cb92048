"""The regional cache: an fsspec URL shared by the nodes of a region.

Same layout as the node cache, except that object stores have no symlinks, so a snapshot
entry is a small JSON ref naming the blob's sha256. A blob is uploaded under a temp name
and moved into place (a single atomic object on S3-like stores), then its marker, then the
ref; a reader trusts a blob only through its marker.

A marker records the blob's BLAKE3 beside its SHA-256 (its name): a replica reading from
the region verifies BLAKE3 as the bytes arrive, several times faster per core than SHA-256,
which had bounded a regional load on a node whose cores also serve the network. A marker
written before carries SHA-256 only, and its readers verify that.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import blake3
import fsspec

from ember.loaders._paths import SHA256_HEX, component
from ember.loaders._source import ObjectInfo, WeightSource
from ember.loaders._source_fsspec import FsspecSource
from ember.loaders._source_s3 import S3Source, client_args
from ember.loaders._tier import BlobKey, BlobRecord, CacheEntry, CacheTier

_SMALL_CAP_BYTES = 64 << 10


def _file_blake3(path: Path) -> str:
    """The BLAKE3 of a published node blob (its pages are usually still warm)."""
    return str(blake3.blake3().update_mmap(str(path)).hexdigest())


class RegionalTier(CacheTier):
    """A cache tier on any fsspec filesystem.

    Args:
        url: the tier's root, e.g. ``s3://region-cache/ember``.
        storage_options: keyword arguments for the filesystem.
        max_connections: the read concurrency of a load from the tier.
    """

    def __init__(self, url: str, storage_options: dict[str, Any], *,
                 max_connections: int = 8) -> None:
        self.location = url
        self.options = dict(storage_options)
        self.max_connections = max_connections
        self.fs, base = fsspec.core.url_to_fs(url, **storage_options)
        self.base = str(base).rstrip("/")

    def _ns(self, namespace: str) -> str:
        return f"{self.base}/{component(namespace)}"

    def _ref(self, key: BlobKey) -> str:
        namespace, version, name = key.parts()
        return f"{self.base}/{namespace}/snapshots/{version}/{name}.json"

    def _read_json(self, path: str) -> dict[str, Any] | None:
        try:
            data = self.fs.cat_file(path)
            doc = json.loads(data[:_SMALL_CAP_BYTES])
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def lookup(self, key: BlobKey) -> BlobRecord | None:
        ref = self._read_json(self._ref(key))
        sha = str(ref.get("sha256", "")) if ref else ""
        if not SHA256_HEX.match(sha):
            return None
        marker = self._read_json(f"{self._ns(key.namespace)}/markers/{sha}.json")
        if not marker or marker.get("sha256") != sha:
            return None
        try:
            size = int(self.fs.info(f"{self._ns(key.namespace)}/blobs/{sha}")["size"])
        except (OSError, KeyError, ValueError):
            return None
        if size != marker.get("size"):
            return None
        b3 = str(marker.get("blake3", ""))
        return BlobRecord(sha, size, b3 if SHA256_HEX.match(b3) else "")

    def source_for(self, key: BlobKey, record: BlobRecord) -> tuple[WeightSource, ObjectInfo]:
        """A source that reads the blob, and its info carrying the expected checksums."""
        root = f"{self._ns(key.namespace)}/blobs"
        url = f"{self.location.rstrip('/')}/{component(key.namespace)}/blobs/"
        source = self._blob_source(root, url)
        info = source.stat(record.sha256)
        return source, ObjectInfo(info.name, info.size, info.version, sha256=record.sha256,
                                  blake3=record.blake3 or None)

    def _blob_source(self, root: str, url: str) -> WeightSource:
        # On S3, botocore's thread-safe client reads ranges in parallel, as a load from an
        # S3 origin does (``_source_s3``); s3fs runs them all on one asyncio thread.
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        if protocol in ("s3", "s3a") and client_args(self.options) is not None:
            try:
                return S3Source(f"s3://{root}/", self.options,
                                max_connections=self.max_connections)
            except ImportError:  # botocore comes with s3fs
                pass
        return FsspecSource(self.fs, root, url=url)

    def publish_file(self, key: BlobKey, path: Path, record: BlobRecord) -> None:
        ns = self._ns(key.namespace)
        blob = f"{ns}/blobs/{record.sha256}"
        if not self._has_blob(blob, record.size):
            tmp = f"{ns}/blobs/.tmp-{uuid.uuid4().hex}"
            self._write(tmp, partial(self.fs.put_file, str(path), tmp))
            self.fs.mv(tmp, blob)
        marker = json.dumps({"sha256": record.sha256, "size": record.size,
                             "blake3": record.blake3 or _file_blake3(path)}).encode()
        for target in (f"{ns}/markers/{record.sha256}.json", self._ref(key)):
            self._write(target, partial(self.fs.pipe_file, target, marker))

    def _write(self, target: str, write: Callable[[], object]) -> None:
        # Object stores have no directories; a file system (a shared mount) needs them
        # made, once, on the first write into each.
        try:
            write()
        except FileNotFoundError:
            self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            write()

    def _has_blob(self, blob: str, size: int) -> bool:
        try:
            return int(self.fs.info(blob)["size"]) == size
        except (OSError, KeyError, ValueError):
            return False

    def entries(self) -> list[CacheEntry]:
        out = []
        for marker in self.fs.glob(f"{self.base}/*/markers/*.json"):
            doc = self._read_json(marker)
            if doc and SHA256_HEX.match(str(doc.get("sha256", ""))):
                namespace = str(marker)[len(self.base) + 1 :].split("/", 1)[0]
                out.append(CacheEntry(namespace, str(doc["sha256"]), int(doc["size"]), 0.0, ()))
        return out

    def remove(self, namespace: str, sha256: str) -> bool:
        ns = self._ns(namespace)
        removed = False
        for path in (f"{ns}/markers/{sha256}.json", f"{ns}/blobs/{sha256}"):
            try:
                self.fs.rm_file(path)
                removed = True
            except FileNotFoundError:
                pass
        return removed
