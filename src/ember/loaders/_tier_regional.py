"""The regional cache: an fsspec URL shared by the nodes of a region.

Same layout as the node cache, except that object stores have no symlinks, so a snapshot
entry is a small JSON ref naming the blob's sha256. A blob is uploaded under a temp name
and moved into place (a single atomic object on S3-like stores), then its marker, then the
ref; a reader trusts a blob only through its marker.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import fsspec

from ember.loaders._paths import SHA256_HEX, component
from ember.loaders._source import ObjectInfo
from ember.loaders._source_fsspec import FsspecSource
from ember.loaders._tier import BlobKey, BlobRecord, CacheEntry, CacheTier

_SMALL_CAP_BYTES = 64 << 10


class RegionalTier(CacheTier):
    """A cache tier on any fsspec filesystem.

    Args:
        url: the tier's root, e.g. ``s3://region-cache/ember``.
        storage_options: keyword arguments for the filesystem.
    """

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.location = url
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
        return BlobRecord(sha, size) if size == marker.get("size") else None

    def source_for(self, key: BlobKey, record: BlobRecord) -> tuple[FsspecSource, ObjectInfo]:
        """A source that reads the blob, and its info carrying the expected checksum."""
        root = f"{self._ns(key.namespace)}/blobs"
        source = FsspecSource(self.fs, root, url=f"{self.location.rstrip('/')}/{root}")
        info = source.stat(record.sha256)
        return source, ObjectInfo(info.name, info.size, info.version, sha256=record.sha256)

    def publish_file(self, key: BlobKey, path: Path, record: BlobRecord) -> None:
        ns = self._ns(key.namespace)
        blob = f"{ns}/blobs/{record.sha256}"
        if not self._has_blob(blob, record.size):
            tmp = f"{ns}/blobs/.tmp-{uuid.uuid4().hex}"
            self.fs.put_file(str(path), tmp)
            self.fs.mv(tmp, blob)
        marker = {"sha256": record.sha256, "size": record.size}
        self.fs.pipe_file(f"{ns}/markers/{record.sha256}.json", json.dumps(marker).encode())
        self.fs.pipe_file(self._ref(key), json.dumps(marker).encode())

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
