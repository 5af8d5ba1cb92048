"""What a model deployment asks of its weights before and after the load: their size, a
small file beside them (``config.json``), and the node-cache blobs its snapshot maps."""

from __future__ import annotations

from pathlib import Path

from ember.loaders._config import LoaderConfig
from ember.loaders._resolve import open_source, resolve_target
from ember.loaders._snapshot import SNAPSHOT_DIR, read_record, snapshot_key


def _record_path(url: str, code_version: str, cfg: LoaderConfig) -> Path:
    return cfg.node_root() / SNAPSHOT_DIR / f"{snapshot_key(url, code_version)}.json"


def weights_bytes(url: str, code_version: str, config: LoaderConfig) -> int:
    """The weights' size: from the node's snapshot record, else from the origin's files.

    Raises:
        WeightsError: the origin cannot be listed.
    """
    record = _record_path(url, code_version, config)
    if record.exists():
        try:
            return read_record(record).total_bytes
        except (OSError, ValueError):
            pass  # the load falls back to the origin and rewrites the record
    target = resolve_target(url, config)
    try:
        return sum(target.source.stat(name).size for name in target.files)
    finally:
        target.source.close()


def read_beside(url: str, name: str, config: LoaderConfig) -> bytes:
    """A small file (``config.json``) in the same folder as the weights ``url`` names."""
    source, file = open_source(url, config)
    folder = file.rpartition("/")[0] + "/" if file and "/" in file else ""
    try:
        return source.read_small(folder + name)
    finally:
        source.close()


def snapshot_blobs(url: str, code_version: str, config: LoaderConfig) -> list[Path]:
    """The node-cache blobs the snapshot of ``url`` maps, in load order.

    Raises:
        OSError, ValueError: there is no readable snapshot record (load it first).
    """
    record = read_record(_record_path(url, code_version, config))
    root = config.node_root()
    return [root / f.path for f in record.files]
