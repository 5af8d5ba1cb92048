"""Streaming safetensors loading through a regional and a node cache.

One URL names the weights (``file://``, ``s3://``, ``gs://``, ``https://``,
``hf://org/repo@revision[/file]``); only safetensors is accepted and nothing is ever
unpickled. A node-cache hit is memory-mapped; a miss streams concurrent range reads from the
regional tier (``EMBER_REGIONAL_CACHE``) or the origin, writing through to the node cache
(``EMBER_CACHE_DIR``, default ``~/.cache/ember``).

Example:
    >>> from ember.loaders import load
    >>> tensors = load("file:///models/mlp/model.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ember.errors import (
    CacheFull,
    HeaderInvalid,
    IntegrityError,
    ObjectChanged,
    RangeNotSupported,
    ShortRead,
    SnapshotError,
    SnapshotInvalid,
    SourceError,
    UnsafeFormat,
    UnsafePath,
    WeightsNotFound,
)
from ember.loaders._api import LocalWeights, load, resolve, stream
from ember.loaders._config import LoaderConfig
from ember.loaders._model_files import (
    read_beside,
    read_present_beside,
    snapshot_blobs,
    weights_bytes,
)
from ember.loaders._snapshot import (
    SnapshotLoad,
    max_snapshot_bytes_from_env,
    snapshot_key,
    snapshot_load,
)
from ember.loaders._snapshot_admin import (
    SnapshotInfo,
    drop_all,
    drop_snapshot,
    list_snapshots,
    preload_snapshot,
)
from ember.loaders._source_s3 import warm_client as warm_s3_client
from ember.loaders._tier import CacheEntry
from ember.loaders._tier_node import NodeTier
from ember.loaders._writebehind import wait_all as wait_for_cache_writes

if TYPE_CHECKING:
    from ember.loaders._staging import StagingCopier


def __getattr__(name: str) -> Any:
    """``StagingCopier`` on first use: its module imports torch, which the processes that only
    list, fill or map the cache (the CLI, the driver of ``ember run``, an app that never uses
    torch) should not pay for (about a second of CPU and 180 MB)."""
    if name == "StagingCopier":
        from ember.loaders._staging import StagingCopier

        return StagingCopier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CacheEntry",
    "CacheFull",
    "HeaderInvalid",
    "IntegrityError",
    "LoaderConfig",
    "LocalWeights",
    "NodeTier",
    "ObjectChanged",
    "RangeNotSupported",
    "ShortRead",
    "SnapshotError",
    "SnapshotInfo",
    "SnapshotInvalid",
    "SnapshotLoad",
    "SourceError",
    "StagingCopier",
    "UnsafeFormat",
    "UnsafePath",
    "WeightsNotFound",
    "drop_all",
    "drop_snapshot",
    "list_snapshots",
    "load",
    "max_snapshot_bytes_from_env",
    "preload_snapshot",
    "read_beside",
    "read_present_beside",
    "resolve",
    "snapshot_blobs",
    "snapshot_key",
    "snapshot_load",
    "stream",
    "wait_for_cache_writes",
    "warm_s3_client",
    "weights_bytes",
]
