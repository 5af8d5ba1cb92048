"""What a model deployment asks of its weights before and after the load: their size, small
files beside them (``config.json``, a tokenizer's), and the node-cache blobs its snapshot
maps."""

from __future__ import annotations

from pathlib import Path

from ember.errors import SourceError, WeightsNotFound
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


#: The most one file beside the weights may hold (a large vocabulary's ``tokenizer.json`` is
#: tens of MB; the weights themselves never come this way).
BESIDE_CAP_BYTES = 64 << 20


def read_present_beside(url: str, names: tuple[str, ...], config: LoaderConfig, *,
                        cap_bytes: int = BESIDE_CAP_BYTES) -> dict[str, bytes]:
    """Those of ``names`` that exist in the weights' folder, each read whole; a name that is
    not there is left out. One ``stat`` a name: only when it fails otherwise than "not
    found" does the source's ``exists`` judge (an HTTPS origin may answer 403 for a file it
    lacks, and a HEAD more for every file is one round trip each on the cold path).

    Raises:
        SourceError: a file is over ``cap_bytes``, or the origin failed.
    """
    source, file = open_source(url, config)
    folder = file.rpartition("/")[0] + "/" if file and "/" in file else ""
    found: dict[str, bytes] = {}
    try:
        for name in names:
            try:
                info = source.stat(folder + name)
            except (WeightsNotFound, FileNotFoundError):
                continue
            except SourceError:
                if not source.exists(folder + name):
                    continue
                raise
            if info.size > cap_bytes:
                raise SourceError(f"{info.size} bytes is over the {cap_bytes} a file beside the "
                                  "weights may have", url=source.describe(folder + name))
            found[name] = source.read_range(info, 0, info.size) if info.size else b""
    finally:
        source.close()
    return found


def snapshot_blobs(url: str, code_version: str, config: LoaderConfig) -> list[Path]:
    """The node-cache blobs the snapshot of ``url`` maps, in load order.

    Raises:
        OSError, ValueError: there is no readable snapshot record (load it first).
    """
    record = read_record(_record_path(url, code_version, config))
    root = config.node_root()
    return [root / f.path for f in record.files]
