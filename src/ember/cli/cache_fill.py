"""One fill of this node's cache from a weights URL: what ``ember cache warm`` runs, here or on
every node (``cache_nodes.py`` runs it in a Ray task pinned to each node)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Filled:
    """What one node's fill did: its files, where their bytes came from, its snapshot."""

    paths: tuple[Path, ...]
    sources: tuple[str, ...]
    total_bytes: int
    seconds: float
    snapshot_key: str | None = None


def fill(
    url: str,
    *,
    cache_dir: Path | None = None,
    regional: str | None = None,
    snapshot: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Filled:
    """Fill this node's cache (and the regional tier) for ``url``; record its snapshot.

    What ``ember cache warm`` runs here, and on each node with ``--all-nodes``.

    Args:
        url: the weights URL.
        cache_dir: the node cache; ``None`` reads ``EMBER_CACHE_DIR`` where this runs.
        regional: the regional tier's URL; ``None`` reads ``EMBER_REGIONAL_CACHE``.
        snapshot: a deployment's code version whose snapshot to record, or ``None``.
        progress: optional ``(bytes_done, bytes_total)`` callback, per file.

    Returns:
        A :class:`Filled`.

    Raises:
        WeightsError: the weights could not be fetched, verified or cached.
    """
    from ember.loaders import LoaderConfig, preload_snapshot, resolve  # torch: see cache.py

    started = time.monotonic()
    extra = {"regional_cache": regional} if regional else {}
    weights = resolve(url, config=LoaderConfig(cache_dir=cache_dir, **extra), progress=progress)
    key = None
    if snapshot is not None:
        info = preload_snapshot(url, code_version=snapshot,
                                config=LoaderConfig(cache_dir=cache_dir))
        key = info.key
    total = sum(path.stat().st_size for path in weights.paths)
    return Filled(weights.paths, weights.sources, total, time.monotonic() - started, key)
