"""From a weights URL to a source and the safetensors files it names."""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ember.errors import HeaderInvalid, SourceError, UnsafeFormat, WeightsNotFound
from ember.loaders._config import LoaderConfig
from ember.loaders._paths import check_relative
from ember.loaders._source import WeightSource

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_PICKLE_DEFAULTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt")
_FILE_SUFFIXES = (".safetensors", ".json", *PICKLE_SUFFIXES)
_FSSPEC_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "memory")


@dataclass(frozen=True)
class Target:
    """What a URL resolves to.

    Attributes:
        source: where the files live.
        files: safetensors file names relative to the source root, in load order.
        weight_map: tensor name -> file name, for a sharded checkpoint.
        revision: the branch or tag asked for (``hf://`` only).
    """

    source: WeightSource
    files: tuple[str, ...]
    weight_map: dict[str, str] | None = None
    revision: str | None = None


def open_source(url: str, config: LoaderConfig) -> tuple[WeightSource, str | None]:
    """Open the source for ``url``; also return the file the URL names, if it names one.

    Raises:
        SourceError: the scheme is not supported.
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "file":
        from ember.loaders._source_file import FileSource

        path = Path(unquote(urlsplit(url).path))
        if path.is_dir():
            return FileSource(path), None
        return FileSource(path.parent), path.name
    if scheme in ("http", "https"):
        from ember.loaders._source_http import HttpSource

        base, name = _split_file(url)
        return HttpSource(base, max_connections=config.max_concurrency), name
    if scheme == "hf":
        from ember.loaders._source_hf import open_hf

        return open_hf(url)
    if scheme in _FSSPEC_SCHEMES:
        from ember.loaders._source_fsspec import FsspecSource

        base, name = _split_file(url)
        s3 = _s3_source(base, config) if scheme in ("s3", "s3a") else None
        if s3 is not None:
            return s3, name
        root = base.split("://", 1)[1]
        return FsspecSource.from_url(base, root, dict(config.storage_options)), name
    raise SourceError("unsupported scheme; use file://, s3://, gs://, https:// or hf://", url=url)


def _s3_source(base: str, config: LoaderConfig) -> WeightSource | None:
    """botocore's client for ``s3://`` (see ``_source_s3``); ``None``: use s3fs instead."""
    from ember.loaders._source_s3 import S3Source, client_args

    options = dict(config.storage_options)
    if client_args(options) is None:
        return None
    try:
        return S3Source(base, options, max_connections=config.max_concurrency)
    except ImportError:  # botocore comes with s3fs; without either, s3fs's error is clearer
        return None


def _split_file(url: str) -> tuple[str, str | None]:
    # Object stores have no directories: a last component with a known suffix is a file.
    if url.endswith("/"):
        return url, None
    head, _, last = url.rpartition("/")
    if "://" in head and last.lower().endswith(_FILE_SUFFIXES):
        return head + "/", unquote(last)
    return url + "/", None


def resolve_target(url: str, config: LoaderConfig) -> Target:
    """Open ``url`` and list the safetensors files to load.

    Raises:
        UnsafeFormat: the URL names (or the folder holds only) pickle-based weights.
        WeightsNotFound: there are no safetensors weights.
        HeaderInvalid: a shard index is malformed.
        UnsafePath: a name in the URL or index could escape its directory.
    """
    source, name = open_source(url, config)
    revision = None
    if url.startswith("hf://"):
        from ember.loaders._source_hf import parse_hf_url

        revision = parse_hf_url(url).revision
    name = check_relative(name) if name else _default_name(source, url)
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise UnsafeFormat(name=source.describe(name))
    if name.endswith(".index.json"):
        files, weight_map = _read_index(source, name)
        return Target(source, files, weight_map, revision)
    if not name.endswith(".safetensors"):
        raise WeightsNotFound("only .safetensors files are accepted", url=source.describe(name))
    return Target(source, (name,), None, revision)


def _default_name(source: WeightSource, url: str) -> str:
    for candidate in (SINGLE_NAME, INDEX_NAME):
        if source.exists(candidate):
            return candidate
    for candidate in _PICKLE_DEFAULTS:
        if source.exists(candidate):
            raise UnsafeFormat(name=source.describe(candidate))
    raise WeightsNotFound(f"neither {SINGLE_NAME} nor {INDEX_NAME} found", url=url)


def _read_index(source: WeightSource, name: str) -> tuple[tuple[str, ...], dict[str, str]]:
    where = source.describe(name)
    try:
        doc: Any = json.loads(source.read_small(name))
    except (ValueError, UnicodeDecodeError) as exc:
        raise HeaderInvalid(name=where, reason=f"index is not JSON ({exc})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise HeaderInvalid(name=where, reason="index has no weight_map object")
    folder = posixpath.dirname(name)
    resolved: dict[str, str] = {}
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            raise HeaderInvalid(name=where, reason=f"weight_map[{tensor!r}] is not a string")
        check_relative(shard)
        if shard.lower().endswith(PICKLE_SUFFIXES):
            raise UnsafeFormat(name=source.describe(shard))
        if not shard.endswith(".safetensors"):
            raise HeaderInvalid(name=where, reason=f"shard {shard!r} is not .safetensors")
        resolved[tensor] = posixpath.join(folder, shard) if folder else shard
    return tuple(sorted(set(resolved.values()))), resolved
