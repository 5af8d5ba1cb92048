"""Snapshots: a deployment's weights left in the node's page cache for its later replicas.

The first replica of a deployment on a node loads its weights through the caches as usual
and records the node-cache blobs it mapped in ``<node cache root>/snapshots/<key>.json``.
A later replica with the same URL and code version reads that record, checks each blob
against its marker and maps it: no origin access at all (no ``stat``, no shard index), so a
restart works with the origin down, and on CPU its tensors are views on the very pages the
first replica left in the page cache. Any failed check drops the record and falls back to
the streaming load, which writes a fresh one.

A record holds no bytes of its own: blobs stay governed by the node cache's LRU, and
dropping a record (``ember snapshot drop``, or the ``EMBER_SNAPSHOT_MAX_BYTES`` cap) only
forgets it. Listing, dropping and preloading live in :mod:`ember.loaders._snapshot_admin`.
Errors::

    WeightsError (503)                      ember.errors
    └── SnapshotError                       a snapshot cannot be used
        └── SnapshotInvalid                 a record failed a check (the load falls back)

Example:
    >>> from ember.loaders import snapshot_load
    >>> got = snapshot_load("file:///m/model.safetensors", code_version="v3")  # doctest: +SKIP
    >>> got.restored, sorted(got.phases)  # doctest: +SKIP
    (True, ['map', 'resolve', 'verify'])
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ember import settings
from ember.errors import (
    HeaderInvalid,
    IntegrityError,
    SnapshotInvalid,
    UnsafePath,
    WeightsError,
)
from ember.loaders._config import LoaderConfig, as_config
from ember.loaders._lease import write_atomic
from ember.loaders._paths import SHA256_HEX, check_relative, within

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from ember.loaders._staging import StagingCopier
    from ember.loaders._tier_node import NodeHit

log = logging.getLogger("ember.loaders")
ConfigLike = LoaderConfig | Mapping[str, Any] | None
Verify = Literal["cheap", "full"]
#: The records' folder under the cache root (namespaces always contain ``--``, so no clash).
SNAPSHOT_DIR = "snapshots"
ENV_MAX_BYTES = settings.variable("snapshot_max_bytes")
_FORMAT = 1
# The weight map of a very large checkpoint is tens of KiB; far more is not a record of ours.
_RECORD_CAP_BYTES = 16 << 20
RECORD_NAME = re.compile(r"^[0-9a-f]{64}\.json$")
_WARM_CHUNK_BYTES = 8 << 20


class SnapshotFile(BaseModel):
    """One mapped file: its blob ``<namespace>/blobs/<sha256>`` and its checkpoint name."""

    model_config = ConfigDict(frozen=True, strict=True)
    path: str
    name: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256_HEX.pattern)

    @model_validator(mode="after")
    def _a_blob_inside_the_root(self) -> SnapshotFile:
        parts = check_relative(self.path).split("/")  # UnsafePath passes through pydantic
        check_relative(self.name)
        if len(parts) != 3 or parts[1:] != ["blobs", self.sha256]:
            raise ValueError(f"{self.path!r} is not a node-cache blob path")
        return self


class SnapshotRecord(BaseModel):
    """The contents of ``snapshots/<key>.json``; its file's mtime is the live last use."""

    model_config = ConfigDict(frozen=True, strict=True)
    format: Literal[1] = 1
    key: str
    url: str
    code_version: str
    revision: str
    created_at: float
    last_used_at: float
    files: tuple[SnapshotFile, ...]
    weight_map: dict[str, str] | None
    total_bytes: int

    @model_validator(mode="after")
    def _total_matches(self) -> SnapshotRecord:
        if self.total_bytes != sum(f.size for f in self.files):
            raise ValueError("total_bytes is not the sum of the file sizes")
        return self


@dataclass(frozen=True)
class SnapshotLoad:
    """The result of :func:`snapshot_load`.

    Attributes:
        tensors: tensor name -> tensor (on CPU, views on the page cache).
        restored: ``True`` when mapped from an existing snapshot without touching the origin.
        key: the snapshot key (:func:`snapshot_key`).
        phases: seconds per phase: ``resolve``, ``verify``, ``map``; ``restore`` (a failed
            restore attempt) and ``record`` (writing a fresh record) on the fallback path.
        fallback_reason: why an existing snapshot was not restored, else ``None``.
        blobs: the node-cache files the tensors map, in load order (empty when a
            write-behind load holds them in memory). A file a fresh load filled and left
            to seal behind it is named by its temp path, which the seal renames.
    """

    tensors: dict[str, torch.Tensor]
    restored: bool
    key: str
    phases: dict[str, float] = field(default_factory=dict)
    fallback_reason: str | None = None
    blobs: tuple[Path, ...] = ()


_Mapped = tuple[dict[str, "torch.Tensor"], tuple[Path, ...]]  # tensors, the files they map


@dataclass(frozen=True)
class _Job:
    """One :func:`snapshot_load` call's fixed inputs."""

    url: str
    code_version: str
    key: str
    cfg: LoaderConfig
    copier: StagingCopier | None

    @property
    def root(self) -> Path:
        return self.cfg.node_root()

    @property
    def record_path(self) -> Path:
        return self.root / SNAPSHOT_DIR / f"{self.key}.json"


def snapshot_key(url: str, code_version: str = "") -> str:
    """The key of ``url``'s snapshot under ``code_version``: 64 hex characters.

    Example:
        >>> snapshot_key("file:///m.safetensors", "v1") == snapshot_key("file:///m.safetensors")
        False
    """
    return hashlib.sha256(json.dumps([url, code_version]).encode()).hexdigest()


def max_snapshot_bytes_from_env() -> int | None:
    """The cap from ``EMBER_SNAPSHOT_MAX_BYTES``, or ``None`` (unlimited) when unset.

    Raises:
        ConfigError: the variable is set but not a whole number.
    """
    return settings.load().snapshot_max_bytes


# -- the load --------------------------------------------------------------------------------
def snapshot_load(
    url: str,
    *,
    code_version: str = "",
    device: str = "cpu",
    config: ConfigLike = None,
    max_snapshot_bytes: int | None = None,
    verify: Verify = "cheap",
) -> SnapshotLoad:
    """Map ``url``'s weights from this node's snapshot, or load them and leave one.

    Args:
        url: the weights URL (as for :func:`ember.loaders.load`).
        code_version: the deployment's code version; a new one is a new snapshot.
        device: ``"cpu"`` (views on the page cache, no copy), ``"cuda"``, ``"cuda:N"`` or
            ``"auto"`` (one host-to-device copy through the loaders' staging buffers).
        config: a :class:`LoaderConfig` or a mapping of its fields.
        max_snapshot_bytes: cap on the bytes all records name; ``None`` reads
            ``EMBER_SNAPSHOT_MAX_BYTES`` (unset: unlimited).
        verify: ``"cheap"`` checks each blob's size and marker; ``"full"`` re-hashes it
            (``config.verify_hits`` implies it).

    Returns:
        A :class:`SnapshotLoad`; ``restored`` says whether the origin was skipped.

    Raises:
        ValueError: a CUDA device was asked for on a machine without one.
        ConfigError: ``EMBER_SNAPSHOT_MAX_BYTES`` is not a number.
        WeightsError: no snapshot could be restored and the streaming load failed.

    Example:
        >>> got = snapshot_load("file:///m/model.safetensors", code_version="v3")  # doctest: +SKIP
        >>> got.restored, got.fallback_reason  # doctest: +SKIP
        (True, None)
    """
    from ember.loaders._api import _copier

    cfg = as_config(config)
    # The copier first: a bad device is the caller's error, not a reason to fall back.
    job = _Job(url, code_version, snapshot_key(url, code_version), cfg, _copier(device, cfg))
    reason: str | None = None
    phases: dict[str, float] = {}
    if job.record_path.exists():
        start = time.perf_counter()
        try:
            tensors, blobs = _restore(job, verify == "full" or cfg.verify_hits, phases)
            return SnapshotLoad(tensors, True, job.key, phases, blobs=blobs)
        except (OSError, ValueError, WeightsError, UnsafePath) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("snapshot %s of %s not restored: %s", job.key[:12], url, reason)
            unlink_quiet(job.record_path)
            phases = {"restore": time.perf_counter() - start}
    cap = max_snapshot_bytes if max_snapshot_bytes is not None else max_snapshot_bytes_from_env()
    tensors, blobs = _fresh(job, cap, phases)
    return SnapshotLoad(tensors, False, job.key, phases, reason, blobs)


def _restore(job: _Job, full: bool, phases: dict[str, float]) -> _Mapped:
    """Check the record and its blobs, then map them; touches nothing outside the node."""
    start = time.perf_counter()
    record = read_record(job.record_path)
    if (record.url, record.code_version) != (job.url, job.code_version):
        raise SnapshotInvalid(key=job.key, reason="it names another URL or code version")
    phases["resolve"] = (mid := time.perf_counter()) - start
    blobs = [_checked_blob(job, file, full) for file in record.files]
    phases["verify"] = (mid2 := time.perf_counter()) - mid
    named = [(f.name, blob) for f, blob in zip(record.files, blobs, strict=True)]
    tensors = _map_files(named, record.weight_map, job)
    phases["map"] = time.perf_counter() - mid2
    markers = (_marker_path(job.root, f) for f in record.files)
    _touch(job.record_path, *markers)  # markers too: a snapshot's blobs stay young in the LRU
    return tensors, tuple(blobs)


def _marker_path(root: Path, file: SnapshotFile) -> Path:
    # The node tier's layout: <ns>/blobs/<sha256> is described by <ns>/markers/<sha256>.json.
    return root / file.path.split("/")[0] / "markers" / f"{file.sha256}.json"


def _checked_blob(job: _Job, file: SnapshotFile, full: bool) -> Path:
    """The blob's real path once it is a plain file inside the root that its marker vouches
    for; ``full`` re-hashes it as well."""
    path = job.root / file.path
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):  # published blobs are plain files; a link could go anywhere
        raise SnapshotInvalid(key=job.key, reason=f"{file.path} is not a regular file")
    real = within(job.root, path)  # a linked parent directory could still leave the root
    if st.st_size != file.size:
        raise IntegrityError(what="size", name=file.path, expected=file.size, actual=st.st_size)
    marker = _read_marker(_marker_path(job.root, file))
    if marker != (file.sha256, file.size):
        raise SnapshotInvalid(key=job.key, reason=f"the marker of {file.path} says {marker}")
    if full:
        with open(real, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if digest != file.sha256:
            raise IntegrityError(what="sha256", name=file.path, expected=file.sha256, actual=digest)
    return real


def _read_marker(path: Path) -> tuple[str, int] | None:
    """A node-cache marker's ``(sha256, size)``, or ``None`` when missing or unreadable."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(64 << 10))
        return str(doc["sha256"]), int(doc["size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _map_files(
    files: Sequence[tuple[str, Path]], weight_map: dict[str, str] | None, job: _Job
) -> dict[str, torch.Tensor]:
    """Map each file with the loaders' own copy-on-write mapping; check the shard map."""
    from ember.loaders._tensors import MappedFile

    out: dict[str, torch.Tensor] = {}
    copier = job.copier
    for name, path in files:
        for tensor_name, tensor in MappedFile(
                path, job.cfg.max_header_bytes, huge_pages=job.cfg.maps_huge()).tensors():
            owner = name if weight_map is None else weight_map.get(tensor_name)
            if tensor_name in out or owner != name:
                raise HeaderInvalid(name=name, reason=f"tensor {tensor_name!r} is not mapped to it")
            out[tensor_name] = copier.copy(tensor) if copier else tensor
    if weight_map is not None and len(out) != len(weight_map):
        missing = sorted(set(weight_map) - set(out))[:5]
        raise HeaderInvalid(name=job.url, reason=f"index lists tensors no shard has: {missing}")
    if copier is not None:
        copier.synchronize()
    return out


def _fresh(job: _Job, cap: int | None, phases: dict[str, float]) -> _Mapped:
    """Load through the caches (the origin included), then record what was mapped.

    With write-behind (:meth:`LoaderConfig.writes_behind`) the tensors are built on the
    bytes as they arrive, and the record is written once every file is published in the
    node cache, after the return. Otherwise a filled file is written through and mapped
    as its temp file; with :meth:`LoaderConfig.seals_behind` its hash, its publication
    and the record come after the return.
    """
    if job.cfg.writes_behind(job.url):
        return _fresh_behind(job, cap, phases)
    from ember.loaders import _writebehind
    from ember.loaders._api import LocalWeights, resolve_and_use

    start = time.perf_counter()

    def use(weights: LocalWeights) -> _Mapped:
        phases["resolve"] = time.perf_counter() - start
        named = [(name, within(job.root, path))
                 for name, path in zip(weights.files, weights.paths, strict=True)]
        return _map_files(named, weights.weight_map, job), tuple(p for _, p in named)

    # A fill's hash and fsync (the disk's durable writes can be slower than its reads) come
    # after the tensors map the fill's file; the record after every file is published.
    weights, used = resolve_and_use(job.url, job.cfg, use,
                                    seal_behind=job.cfg.seals_behind(job.url))
    assert used is not None  # use ran, or resolve_and_use raised
    phases["map"] = (mid := time.perf_counter()) - start - phases["resolve"]

    def record(hits: list[NodeHit]) -> None:
        _record_fresh(job, cap, [hit.link for hit in hits], weights.weight_map)

    if all(future.done() for future in weights.published):  # nothing left to seal
        hits = [future.result() for future in weights.published]
        published = [hit for hit in hits if hit is not None]
        if len(published) == len(hits):  # a failed seal: the next load fills and records
            record(published)
        phases["record"] = time.perf_counter() - mid
    else:
        _writebehind.then(weights.published, record)
    return used


def _fresh_behind(job: _Job, cap: int | None, phases: dict[str, float]) -> _Mapped:
    from ember.loaders import _writebehind
    from ember.loaders._api import stream_target
    from ember.loaders._resolve import resolve_target

    start = time.perf_counter()
    target = resolve_target(job.url, job.cfg)
    phases["resolve"] = (mid := time.perf_counter()) - start
    published: list[Future[NodeHit | None]] = []
    tensors = dict(stream_target(job.url, target, job.cfg, job.copier, None, published))
    if job.copier is not None:
        job.copier.synchronize()
    phases["map"] = time.perf_counter() - mid

    def record(hits: list[NodeHit]) -> None:
        _record_fresh(job, cap, [h.link for h in hits], target.weight_map)

    _writebehind.then(published, record)
    return tensors, ()


def _record_fresh(
    job: _Job, cap: int | None, links: Sequence[Path], weight_map: dict[str, str] | None
) -> None:
    """Write the record of a fresh load's node-cache links; keep their pages warm.

    A record that cannot be written (a full disk, a link evicted meanwhile) fails nothing:
    the load has its tensors, and the next load of the URL fills and records again.
    """
    try:
        _write_fresh_record(job, cap, links, weight_map)
    except OSError as exc:
        log.warning("snapshot %s: record not written (%s); the next load records it",
                    job.key, exc)


def _write_fresh_record(
    job: _Job, cap: int | None, links: Sequence[Path], weight_map: dict[str, str] | None
) -> None:
    described = [_describe(job.root, link) for link in links]
    files = tuple(f for f, _ in described)
    versions = sorted({link.relative_to(job.root).parts[2] for link in links})
    now = time.time()
    record = SnapshotRecord(
        key=job.key, url=job.url, code_version=job.code_version, revision=",".join(versions),
        created_at=now, last_used_at=now, files=files, weight_map=weight_map,
        total_bytes=sum(f.size for f in files),
    )  # fmt: skip
    _write_record(job.record_path, record)
    _enforce_cap(job.record_path.parent, job.key, cap)
    for _, blob in described:
        warm_pages(blob, wait=False)


def _describe(root: Path, link: Path) -> tuple[SnapshotFile, Path]:
    """The record entry and blob of one node-cache link ``<ns>/snapshots/<version>/<name>``."""
    blob = within(root, link)
    rel = blob.relative_to(root.resolve()).as_posix()
    name = "/".join(link.relative_to(root).parts[3:])
    size = os.stat(blob).st_size
    return SnapshotFile(path=rel, name=name, size=size, sha256=blob.name), blob


def warm_pages(path: Path, *, wait: bool) -> None:
    """Ask the kernel to keep (``wait``: to bring, now) the file's pages in the page cache."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            if wait:  # WILLNEED only starts readahead; reading makes the pages resident now
                buffer, offset = bytearray(_WARM_CHUNK_BYTES), 0
                while got := os.preadv(fd, [buffer], offset):
                    offset += got
        finally:
            os.close(fd)


# -- records ---------------------------------------------------------------------------------
def _write_record(path: Path, record: SnapshotRecord) -> None:
    """Publish a record atomically (temp file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, record.model_dump_json(indent=1).encode())


def read_record(path: Path) -> SnapshotRecord:
    """Parse and check one record file.

    Raises:
        SnapshotInvalid: the record is oversized, malformed, not its file's key, or names
            a path that could leave the cache root.
        FileNotFoundError: there is no record.
    """
    key = path.name.removesuffix(".json")
    with open(path, "rb") as f:
        raw = f.read(_RECORD_CAP_BYTES + 1)
    try:
        if len(raw) > _RECORD_CAP_BYTES:
            raise ValueError(f"over {_RECORD_CAP_BYTES} bytes")
        record = SnapshotRecord.model_validate_json(raw)
    except (ValueError, UnsafePath) as exc:  # pydantic's ValidationError is a ValueError
        raise SnapshotInvalid(key=key, reason=f"unparsable record ({exc})") from None
    if record.key != key:
        raise SnapshotInvalid(key=key, reason=f"the record is for key {record.key}")
    return record


def _touch(*paths: Path) -> None:
    """Mark a use: records and markers carry their last use in their mtime."""
    now = time.time_ns()  # explicit: file-system clocks are too coarse to order quick loads
    for path in paths:
        with contextlib.suppress(OSError):
            os.utime(path, ns=(now, now))


def last_used(path: Path, record: SnapshotRecord) -> float:
    try:
        return max(record.last_used_at, path.stat().st_mtime)
    except OSError:
        return record.last_used_at


def iter_records(folder: Path) -> Iterator[tuple[Path, SnapshotRecord]]:
    """Every parsable record (a bad one is skipped here; the next load of it drops it)."""
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if RECORD_NAME.match(path.name):
            with contextlib.suppress(OSError, SnapshotInvalid):
                yield path, read_record(path)


def _enforce_cap(folder: Path, keep: str, cap: int | None) -> list[str]:
    """Drop least-recently-used records, never ``keep``, until their bytes fit ``cap``.

    A blob shared by two records counts twice: conservative, and the records that share
    blobs (one URL under an old and a new code version) are the ones worth forgetting.
    """
    if cap is None:
        return []
    records = list(iter_records(folder))
    used = sum(r.total_bytes for _, r in records)
    dropped: list[str] = []
    for path, record in sorted(records, key=lambda item: last_used(*item)):
        if used <= cap:
            break
        if record.key != keep and unlink_quiet(path):
            used -= record.total_bytes
            dropped.append(record.key)
    if dropped:
        log.info("snapshot cap of %d bytes: dropped %s", cap, [k[:12] for k in dropped])
    if used > cap:
        log.warning("snapshot %s is kept although it exceeds the cap of %d bytes", keep[:12], cap)
    return dropped


def unlink_quiet(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
