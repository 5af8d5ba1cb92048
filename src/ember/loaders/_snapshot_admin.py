"""List, drop and preload this node's weight snapshots (what ``ember snapshot`` runs).

The load itself is in :mod:`ember.loaders._snapshot`; the commands are in
:mod:`ember.cli.snapshot`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import UnsafePath
from ember.loaders._config import as_config
from ember.loaders._snapshot import (
    RECORD_NAME,
    SNAPSHOT_DIR,
    ConfigLike,
    SnapshotRecord,
    Verify,
    iter_records,
    last_used,
    read_record,
    snapshot_load,
    unlink_quiet,
    warm_pages,
)

_PREFIX = re.compile(r"^[0-9a-f]{1,64}$")
_LOW_BIT = bytes(b & 1 for b in range(256))


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot as ``ember snapshot ls`` shows it.

    Attributes:
        total_bytes: bytes of the blobs its record names.
        resident_bytes: how many of them are in the page cache now; ``None`` where the
            platform cannot tell (no ``mincore``).
        last_used_at: the last load or restore, in seconds since the epoch.
    """

    key: str
    url: str
    code_version: str
    total_bytes: int
    resident_bytes: int | None
    last_used_at: float
    created_at: float
    files: int


def list_snapshots(config: ConfigLike = None) -> list[SnapshotInfo]:
    """Every snapshot on this node, most recently used first.

    Args:
        config: a :class:`LoaderConfig` or a mapping of its fields (selects the cache root).

    Returns:
        One :class:`SnapshotInfo` per parsable record.

    Example:
        >>> [info.url for info in list_snapshots()]  # doctest: +SKIP
        ['file:///m/model.safetensors']
    """
    root = as_config(config).node_root()
    infos = [_info(path, record, root) for path, record in iter_records(root / SNAPSHOT_DIR)]
    return sorted(infos, key=lambda i: -i.last_used_at)


def _info(path: Path, record: SnapshotRecord, root: Path) -> SnapshotInfo:
    resident: int | None = 0
    for file in record.files:
        got = resident_bytes(root / file.path)
        resident = None if got is None or resident is None else resident + got
    return SnapshotInfo(
        record.key, record.url, record.code_version, record.total_bytes, resident,
        last_used(path, record), record.created_at, len(record.files),
    )  # fmt: skip


def drop_snapshot(key_prefix: str, *, config: ConfigLike = None) -> int:
    """Forget every snapshot whose key starts with ``key_prefix`` (its blobs stay cached).

    Args:
        key_prefix: 1-64 lowercase hex characters.
        config: selects the cache root.

    Returns:
        The number of records removed (0 when nothing matched).

    Raises:
        UnsafePath: the prefix is not hex (it could name a path).

    Example:
        >>> drop_snapshot("3f2a9c")  # doctest: +SKIP
        1
    """
    if not _PREFIX.match(key_prefix):
        raise UnsafePath(name=key_prefix, reason="expected a snapshot key prefix of hex chars")
    return _drop_matching(as_config(config).node_root() / SNAPSHOT_DIR, key_prefix)


def drop_all(*, config: ConfigLike = None) -> int:
    """Forget every snapshot on this node, unparsable records included.

    Returns:
        The number of records removed.
    """
    return _drop_matching(as_config(config).node_root() / SNAPSHOT_DIR, "")


def _drop_matching(folder: Path, prefix: str) -> int:
    names = os.listdir(folder) if folder.is_dir() else []
    matching = [n for n in names if RECORD_NAME.match(n) and n.startswith(prefix)]
    return sum(unlink_quiet(folder / n) for n in matching)


def preload_snapshot(
    url: str,
    *,
    code_version: str = "",
    config: ConfigLike = None,
    max_snapshot_bytes: int | None = None,
    verify: Verify = "cheap",
) -> SnapshotInfo:
    """Make sure this node has ``url``'s snapshot and its pages are in the page cache.

    For ``ember cache warm`` and a deployment's preload option, so the first request finds
    the weights ready to map. Reads each file once (cheap when its pages are warm).

    Args:
        url: the weights URL.
        code_version: the deployment's code version.
        config: a :class:`LoaderConfig` or a mapping of its fields.
        max_snapshot_bytes: as for :func:`ember.loaders.snapshot_load`.
        verify: as for :func:`ember.loaders.snapshot_load`.

    Returns:
        The snapshot's :class:`SnapshotInfo`, its resident bytes counted after the preload.

    Raises:
        WeightsError: as for :func:`ember.loaders.snapshot_load`.
    """
    # The point is a snapshot on this node when this returns: never write it behind.
    cfg = as_config(config).model_copy(update={"cache_write": "through"})
    loaded = snapshot_load(
        url, code_version=code_version, config=cfg,
        max_snapshot_bytes=max_snapshot_bytes, verify=verify,
    )  # fmt: skip
    path = cfg.node_root() / SNAPSHOT_DIR / f"{loaded.key}.json"
    del loaded  # only the pages matter; the mappings go with the tensors
    record = read_record(path)
    for file in record.files:
        warm_pages(cfg.node_root() / file.path, wait=True)
    return _info(path, record, cfg.node_root())


# -- page-cache residency (Linux mincore) ----------------------------------------------------
@functools.cache
def _libc() -> Any:
    """libc with ``mmap``/``munmap``/``mincore`` typed, or ``None`` off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    c = ctypes
    libc.mmap.restype = c.c_void_p
    libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
    libc.munmap.argtypes = [c.c_void_p, c.c_size_t]
    libc.mincore.argtypes = [c.c_void_p, c.c_size_t, c.POINTER(c.c_ubyte)]
    return libc


def resident_bytes(path: Path) -> int | None:
    """Bytes of ``path`` now in the page cache, or ``None`` where that cannot be known.

    Maps the file shared and read-only and asks ``mincore``: no page is touched, so the
    count does not change what it counts. A missing file has 0 resident bytes.
    """
    libc = _libc()
    if libc is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
            failed = libc.mincore(ctypes.c_void_p(addr), size, vec) != 0
            pages = bytes(vec).translate(_LOW_BIT).count(1)
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return None if failed else min(size, pages * mmap.PAGESIZE)
