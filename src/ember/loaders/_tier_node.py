"""The node cache: a local directory of content-addressed, immutable blobs.

Layout (the Hugging Face cache layout where it fits, so its tools can read it)::

    <root>/<namespace>/blobs/<sha256>                      the bytes, never modified
    <root>/<namespace>/blobs/.tmp-<host>-<pid>-<rand>      a fill in progress
    <root>/<namespace>/markers/<sha256>.json               size + checksum; mtime = last use
    <root>/<namespace>/snapshots/<version>/<name>          symlink -> ../../blobs/<sha256>
    <root>/<namespace>/refs/<revision>                     commit of a branch (hf:// only)
    <root>/.locks/<key digest>.lease | .error              single-flight state

A blob is published by rename after fsync and verification, then its marker, then the
snapshot link; a reader trusts a blob only through its marker.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from ember.errors import CacheFull, IntegrityError, UnsafePath
from ember.loaders._config import LoaderConfig
from ember.loaders._lease import write_atomic
from ember.loaders._paths import SHA256_HEX, check_relative, component, within
from ember.loaders._tier import BlobKey, BlobRecord, CacheEntry, CacheTier

_MARKER_CAP_BYTES = 64 << 10
_HOST = component(socket.gethostname())


@dataclass(frozen=True)
class NodeHit:
    """A published blob: its real path, the snapshot link that names it, its record."""

    path: Path
    link: Path
    record: BlobRecord


class TempBlob:
    """A fill's unique temp file, preallocated so a full disk fails before any write."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            if size:
                os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            self.discard()
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
                return
            raise CacheFull(size=size, root=path.parent, reason=str(exc)) from exc

    def write_at(self, offset: int, data: memoryview) -> None:
        """Write all of ``data`` at ``offset``; a full disk becomes :class:`CacheFull`."""
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(self.fd, data[done:], offset + done)
        except OSError as exc:
            raise CacheFull(size=self.size, root=self.path.parent, reason=str(exc)) from exc

    def close(self) -> None:
        """Close the file once: a second ``os.close`` could close another thread's new fd."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def discard(self) -> None:
        """Close and unlink: a failed fill leaves nothing behind."""
        with contextlib.suppress(OSError):
            self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class NodeTier(CacheTier):
    """The node's cache directory.

    Args:
        config: supplies the root, the byte cap and the free-space floor.
    """

    def __init__(self, config: LoaderConfig) -> None:
        self.config = config
        self.root = config.node_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.location = str(self.root)

    # -- paths ---------------------------------------------------------------------------
    def _ns_dir(self, namespace: str) -> Path:
        return self.root / component(namespace)

    def link_path(self, key: BlobKey) -> Path:
        """Where the snapshot link for ``key`` lives."""
        namespace, version, name = key.parts()
        return self.root / namespace / "snapshots" / version / name

    def lease_path(self, key: BlobKey) -> Path:
        """The lease file that makes fills of ``key`` single-flight."""
        locks = self.root / ".locks"
        locks.mkdir(exist_ok=True)
        return locks / f"{key.digest()}.lease"

    def _marker(self, namespace_dir: Path, sha256: str) -> Path:
        return namespace_dir / "markers" / f"{sha256}.json"

    # -- lookups -------------------------------------------------------------------------
    def lookup(self, key: BlobKey) -> BlobRecord | None:
        hit = self.hit(key)
        return hit.record if hit else None

    def hit(self, key: BlobKey) -> NodeHit | None:
        """A cheap check (link, marker, size) of the blob for ``key``.

        Raises:
            UnsafePath: the snapshot link points outside the cache root.
        """
        link = self.link_path(key)
        if not link.is_symlink():
            return None
        blob = within(self.root, link)
        if not SHA256_HEX.match(blob.name) or blob.parent.name != "blobs":
            raise UnsafePath(name=str(link), reason="link does not point at a blob")
        record = self._check(blob)
        if record is None:
            return None
        with contextlib.suppress(OSError):
            os.utime(self._marker(blob.parent.parent, blob.name))  # LRU: last use
        return NodeHit(blob, link, record)

    def _check(self, blob: Path) -> BlobRecord | None:
        marker = self._marker(blob.parent.parent, blob.name)
        try:
            with open(marker, "rb") as f:
                doc = json.loads(f.read(_MARKER_CAP_BYTES))
            record = BlobRecord(str(doc["sha256"]), int(doc["size"]))
            size = os.stat(blob).st_size
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if record.sha256 != blob.name or size != record.size:
            # Truncated or tampered: remove so the next fill replaces it.
            self.remove(blob.parent.parent.name, blob.name)
            return None
        return record

    # -- fills ---------------------------------------------------------------------------
    def begin_fill(self, key: BlobKey, size: int) -> TempBlob:
        """Make room for ``size`` bytes and open a unique temp file beside the blobs.

        Raises:
            CacheFull: the blob is over the cap, or the disk stays too full after eviction.
        """
        blobs = self._ns_dir(key.namespace) / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        self.sweep_temps()
        self.make_room(size)
        name = f".tmp-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        return TempBlob(blobs / name, size)

    def commit(self, key: BlobKey, tmp: TempBlob, record: BlobRecord) -> NodeHit:
        """Verify, fsync and publish a filled temp file; then its marker and link.

        Raises:
            IntegrityError: the file's size is not the expected size.
        """
        try:
            os.fsync(tmp.fd)
            size = os.fstat(tmp.fd).st_size
            if size != record.size:
                raise IntegrityError(what="size", name=key.name, expected=record.size, actual=size)
            tmp.close()
            blob = tmp.path.parent / record.sha256
            os.replace(tmp.path, blob)
        except BaseException:
            tmp.discard()
            raise
        return self._finish(key, blob, record)

    def place(self, key: BlobKey, tmp: TempBlob, record: BlobRecord) -> Path:
        """Make a filled temp file durable and give it its blob name; :meth:`seal` it next.

        The fsync comes before the rename, so a blob name only ever holds durable bytes:
        another fill's marker for the same checksum can never vouch for bytes still in
        flight. A placed blob has no marker yet, so no lookup trusts it: a crash before the
        seal leaves an unmarked blob that the next fill of the same bytes replaces and
        :meth:`sweep_temps` removes once stale. A blob of the same bytes that is already
        published is kept and the temp file dropped.

        Raises:
            IntegrityError: the file's size is not the expected size.
        """
        blob = tmp.path.parent / record.sha256
        try:
            size = os.fstat(tmp.fd).st_size
            if size != record.size:
                raise IntegrityError(what="size", name=key.name, expected=record.size, actual=size)
            if self._check(blob) is not None:
                tmp.discard()
                return blob
            os.fsync(tmp.fd)
            tmp.close()
            os.replace(tmp.path, blob)
        except BaseException:
            tmp.discard()
            raise
        return blob

    def seal(self, key: BlobKey, blob: Path, record: BlobRecord) -> NodeHit:
        """Publish a placed blob: the directory entry made durable, then marker and link."""
        return self._finish(key, blob, record)

    def _finish(self, key: BlobKey, blob: Path, record: BlobRecord) -> NodeHit:
        _fsync_dir(blob.parent)
        marker = self._marker(blob.parent.parent, record.sha256)
        marker.parent.mkdir(exist_ok=True)
        doc = {"sha256": record.sha256, "size": record.size, "published_at": time.time()}
        write_atomic(marker, json.dumps(doc).encode())
        link = self.link_path(key)
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(blob, link.parent)
        tmp_link = link.with_name(f".{link.name}.{uuid.uuid4().hex}.tmp")
        os.symlink(target, tmp_link)
        os.replace(tmp_link, link)
        return NodeHit(blob, link, record)

    def publish_file(self, key: BlobKey, path: Path, record: BlobRecord) -> None:
        tmp = self.begin_fill(key, record.size)
        with open(path, "rb") as src:
            offset = 0
            while chunk := src.read(8 << 20):
                tmp.write_at(offset, memoryview(chunk))
                offset += len(chunk)
        self.commit(key, tmp, record)

    def write_ref(self, namespace: str, revision: str, commit: str) -> None:
        """Record which commit a branch name pointed at (the Hugging Face ``refs/`` file)."""
        if revision == commit:
            return
        refs = self._ns_dir(namespace) / "refs"
        refs.mkdir(parents=True, exist_ok=True)
        write_atomic(refs / component(revision), commit.encode())

    # -- bounds --------------------------------------------------------------------------
    def make_room(self, size: int) -> None:
        """Evict least-recently-used blobs that no live process maps (unlink only) until
        ``size`` more bytes fit.

        Raises:
            CacheFull: ``size`` alone exceeds the cap, or free disk stays under the floor.
        """
        cap = self.config.cache_max_bytes
        if size > cap:
            raise CacheFull(size=size, root=self.root, reason=f"over cache_max_bytes={cap}")
        entries = sorted(self.entries(), key=lambda e: e.last_used_s)
        used = sum(e.size for e in entries)
        floor = self.config.min_free_bytes

        def fits() -> bool:
            return used + size <= cap and shutil.disk_usage(self.root).free - size >= floor

        if fits():
            return
        # A blob a live process maps is never evicted: unlinking it frees no byte of disk
        # until its last mapping goes, and the next replica of its model would fetch it
        # again while the old copy still fills the disk.
        in_use = mapped_blobs(self.root)
        for entry in entries:
            if (entry.namespace, entry.sha256) in in_use:
                continue
            self.remove(entry.namespace, entry.sha256)
            used -= entry.size
            if fits():
                return
        free = shutil.disk_usage(self.root).free
        held = sum(e.size for e in entries if (e.namespace, e.sha256) in in_use)
        reason = (f"{free} bytes free, min_free_bytes={floor}, cache_max_bytes={cap}; "
                  f"{held} bytes are blobs that running processes map")
        raise CacheFull(size=size, root=self.root, reason=reason)

    def sweep_temps(self) -> None:
        """Remove temp files of fills whose process died (a kill -9 leaves a miss), and
        stale placed blobs that were never sealed (no marker)."""
        stale_s = max(10 * self.config.lease_timeout_s, 600.0)
        for blob in self.root.glob("*/blobs/*"):
            marker = self._marker(blob.parent.parent, blob.name)
            if not SHA256_HEX.match(blob.name) or marker.exists():
                continue
            with contextlib.suppress(OSError):
                # A seal touches its blob when it places it; the marker is checked again
                # last, so a seal that just published is not undone.
                if time.time() - blob.stat().st_mtime > stale_s and not marker.exists():
                    blob.unlink()
        for tmp in self.root.glob("*/blobs/.tmp-*"):
            parts = tmp.name.split("-")
            try:
                host, pid = "-".join(parts[1:-2]), int(parts[-2])
                age_s = time.time() - tmp.stat().st_mtime
            except (ValueError, OSError):
                continue
            # A live filler's temp file is never old: a load can wait long for its seal
            # (the queue, a slow disk) and its tensors are that file's pages. Another
            # host's (a shared cache folder) is judged by its age alone.
            mine = host == _HOST
            if (mine and not psutil.pid_exists(pid)) or (not mine and age_s > stale_s):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()

    # -- listing and removal -------------------------------------------------------------
    def entries(self) -> list[CacheEntry]:
        out: list[CacheEntry] = []
        for marker in self.root.glob("*/markers/*.json"):
            sha = marker.name.removesuffix(".json")
            ns_dir = marker.parent.parent
            try:
                size = (ns_dir / "blobs" / sha).stat().st_size
                used = marker.stat().st_mtime
            except OSError:
                continue
            snapshots = ns_dir / "snapshots"
            names = tuple(str(p.relative_to(snapshots)) for p in self._links(ns_dir, sha))
            out.append(CacheEntry(ns_dir.name, sha, size, used, names))
        return out

    def _links(self, ns_dir: Path, sha256: str) -> list[Path]:
        found = []
        for link in (ns_dir / "snapshots").rglob("*"):
            with contextlib.suppress(OSError):
                if link.is_symlink() and os.path.basename(os.readlink(link)) == sha256:
                    found.append(link)
        return found

    def remove(self, namespace: str, sha256: str) -> bool:
        if not SHA256_HEX.match(sha256):
            raise UnsafePath(name=sha256, reason="not a sha256 blob key")
        ns_dir = self.root / check_relative(component(namespace))
        removed = False
        # Marker first: a concurrent hit check then sees a miss, never a half-removed blob.
        for path in (self._marker(ns_dir, sha256), ns_dir / "blobs" / sha256):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed = True
        for link in self._links(ns_dir, sha256):
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
        return removed


def mapped_blobs(root: Path) -> set[tuple[str, str]]:
    """The blobs under ``root`` (as namespace and SHA-256 name) that a process this one can
    see maps now; a mapping of a file already unlinked is not its name's blob.

    Read from each process's ``/proc/<pid>/maps``: those of other users, other PID
    namespaces (another pod sharing the folder) and processes that end meanwhile are not
    seen, and their blobs count as unmapped.
    """
    prefix = os.path.realpath(root) + os.sep
    found: set[tuple[str, str]] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:
            continue
        if prefix not in text:
            continue
        for line in text.splitlines():
            at = line.find(prefix)
            if at < 0 or line.endswith(" (deleted)"):
                continue
            parts = line[at + len(prefix):].split("/")
            if len(parts) == 3 and parts[1] == "blobs" and SHA256_HEX.match(parts[2]):
                found.add((parts[0], parts[2]))
    return found


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
