"""The node's limits for loading weights, and a log of recent loads to hold against them.

``ember cache bench`` measures what this node can do at best (a cold sequential read of
its disk, a read from its page cache, ranged GETs from the regional tier) and prints each
recent load's GB/s beside the limit of the path it took, so an operator sees which one a
slow cold start was bound by. The disk is measured on a scratch file written beside the
cache (never on the blobs: dropping their pages would make the next replica's start cold).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ember.loaders._config import LoaderConfig
from ember.loaders.pages import evict

LOG_NAME = "loads.jsonl"
_LOG_KEEP = 200
_CHUNK = 16 << 20


def record_load(root: Path, entry: dict[str, Any]) -> None:
    """Append one load to ``<root>/loads.jsonl`` (the last 200 are kept)."""
    path = root / LOG_NAME
    with contextlib.suppress(OSError):  # a load never fails for its log
        root.mkdir(parents=True, exist_ok=True)
        lines = path.read_text().splitlines()[-(_LOG_KEEP - 1):] if path.exists() else []
        lines.append(json.dumps({"at": time.time(), **entry}))
        tmp = path.with_name(f".{LOG_NAME}.{uuid.uuid4().hex}")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)


def recent_loads(root: Path, limit: int = 10) -> list[dict[str, Any]]:
    """The last ``limit`` loads recorded under ``root``, oldest first."""
    try:
        lines = (root / LOG_NAME).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines[-limit:]:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def _timed_reads(jobs: list[tuple[int, int]], read: Callable[[int, int], int],
                 workers: int) -> tuple[int, float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        total = sum(pool.map(lambda job: read(*job), jobs))
    return total, time.perf_counter() - start


def local_limits(folder: Path, size_bytes: int = 512 << 20, workers: int = 4) -> dict[str, float]:
    """Cold sequential read and page-cache read of a scratch file in ``folder``, in GB/s."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".bench-{uuid.uuid4().hex}"
    block = os.urandom(1 << 20)
    try:
        with open(path, "wb") as f:
            for _ in range(size_bytes >> 20):
                f.write(block)
        evict(path)  # flushes first; then no page of it is in memory
        fd = os.open(path, os.O_RDONLY)
        try:
            jobs = [(a, min(_CHUNK, size_bytes - a)) for a in range(0, size_bytes, _CHUNK)]

            def read(offset: int, length: int) -> int:
                return len(os.pread(fd, length, offset))

            cold = _timed_reads(jobs, read, workers)
            warm = _timed_reads(jobs, read, workers)
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return {"disk_cold_gbps": cold[0] / cold[1] / 1e9, "page_cache_gbps": warm[0] / warm[1] / 1e9}


def regional_limit(config: LoaderConfig) -> float | None:
    """Ranged-GET GB/s of the regional tier's largest blob; ``None`` without a tier or blob."""
    from ember.loaders._fetch import regional_tier

    tier = regional_tier(config)
    entries = sorted(tier.entries(), key=lambda e: e.size) if tier is not None else []
    if tier is None or not entries:
        return None
    biggest = entries[-1]
    path = f"{tier.base}/{biggest.namespace}/blobs/{biggest.sha256}"
    return _ranged_gets(tier.fs, path, biggest.size)


def _ranged_gets(fs: Any, path: str, size: int, *, max_bytes: int = 512 << 20,
                 range_bytes: int = 8 << 20, workers: int = 8) -> float:
    """Parallel ranged GETs of one object (its first ``max_bytes``), in GB/s."""
    end = min(size, max_bytes)
    jobs = [(a, min(a + range_bytes, end)) for a in range(0, end, range_bytes)]

    def read(start: int, stop: int) -> int:
        return len(fs.cat_file(path, start=start, end=stop))

    total, seconds = _timed_reads(jobs, read, workers)
    return total / seconds / 1e9


def path_of(entry: dict[str, Any]) -> str:
    """Which limit a recorded load is held against: ``page_cache``, ``disk`` or ``fill``."""
    if not entry.get("restored"):
        return "fill"
    return "disk" if entry.get("read_bytes", 0) else "page_cache"
