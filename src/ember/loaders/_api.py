"""The public entry points: ``load``, ``stream`` and ``resolve``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ember.errors import HeaderInvalid, IntegrityError, SourceError
from ember.loaders._config import LoaderConfig, as_config
from ember.loaders._fetch import Fill, obtain, regional_tier
from ember.loaders._reader import Progress, StreamingReader
from ember.loaders._resolve import Target, resolve_target
from ember.loaders._tier_node import NodeHit, NodeTier
from ember.loaders._writebehind import done

if TYPE_CHECKING:
    import torch

    from ember.loaders._tensors import MappedFile

ConfigLike = LoaderConfig | Mapping[str, Any] | None
T = TypeVar("T")
_HIT_ATTEMPTS = 3


@dataclass(frozen=True)
class LocalWeights:
    """Node-cache paths of a URL's safetensors files, after the cache was filled.

    Attributes:
        url: the URL that was resolved.
        paths: one snapshot link per file (``.../snapshots/<version>/<name>``), in order;
            each resolves to an immutable, verified blob.
        weight_map: tensor name -> file name for a sharded checkpoint, else ``None``.
        sources: where each file's bytes came from, in order: ``"node"`` (already in the
            node cache), ``"regional"`` or ``"origin"``.
        files: each file's name relative to the URL's root, in the order of ``paths``.
        published: one future per path, giving its published blob (from
            :func:`resolve_and_use` with ``seal_behind``, done once the file is sealed;
            until then its path is the fill's temp file).
    """

    url: str
    paths: tuple[Path, ...]
    weight_map: dict[str, str] | None = None
    sources: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    published: tuple[Future[NodeHit | None], ...] = ()

    def load(self, *, device: str = "cpu", config: ConfigLike = None) -> dict[str, torch.Tensor]:
        """Map every file (no copy on CPU) and return its tensors.

        Raises:
            HeaderInvalid: a blob no longer validates.
        """
        from ember.loaders._tensors import MappedFile

        cfg = as_config(config)
        copier = _copier(device, cfg)
        out: dict[str, torch.Tensor] = {}
        for path in self.paths:
            for name, tensor in MappedFile(path, cfg.max_header_bytes,
                                             huge_pages=cfg.maps_huge()).tensors():
                out[name] = copier.copy(tensor) if copier else tensor
        return out


def _copier(device: str, cfg: LoaderConfig) -> Any:
    from ember.loaders._staging import StagingCopier, select_device

    chosen = select_device(device)
    return StagingCopier(chosen, cfg.staging_bytes) if chosen.type != "cpu" else None


def _map_hit(node: NodeTier, hit: NodeHit, cfg: LoaderConfig) -> MappedFile | None:
    from ember.loaders._tensors import MappedFile

    try:
        mapped = MappedFile(hit.path, cfg.max_header_bytes, huge_pages=cfg.maps_huge())
        if cfg.verify_hits:
            mapped.verify(hit.record.sha256)
    except (FileNotFoundError, HeaderInvalid, IntegrityError):
        # Evicted under us, or corrupted on disk: drop it and fetch again.
        node.remove(hit.path.parent.parent.name, hit.record.sha256)
        return None
    return mapped


@dataclass(frozen=True)
class _Mapped:
    """A node hit and its mapping."""

    hit: NodeHit
    file: MappedFile


def _begin(
    node: NodeTier,
    target: Target,
    name: str,
    progress: Progress | None,
    pool: ThreadPoolExecutor,
    behind: bool,
) -> Fill | _Mapped:
    """One file's node hit, mapped, or its fill with the range reads queued on ``pool``."""
    for _ in range(_HIT_ATTEMPTS):
        _, outcome = obtain(node, target.source, name, progress, behind=behind)
        if isinstance(outcome, Fill):
            outcome.start(pool)
            return outcome
        mapped = _map_hit(node, outcome, node.config)
        if mapped is not None:
            return _Mapped(outcome, mapped)
    raise SourceError("the cached blob kept disappearing", url=target.source.describe(name))


def _file_tensors(begun: Fill | _Mapped) -> Iterator[tuple[str, torch.Tensor]]:
    """One file's tensors: views on the fill's buffer, or on the mapped hit."""
    from ember.loaders._tensors import flat_view, tensor_view

    if not isinstance(begun, Fill):
        yield from begun.file.tensors()
        return
    flat = None
    for spec in begun.run():
        if flat is None and isinstance(begun.reader, StreamingReader):
            flat = flat_view(begun.reader.buffer)
        if flat is not None:
            yield spec.name, tensor_view(flat, spec)


def _published(files: list[Fill | _Mapped]) -> list[Future[NodeHit | None]]:
    """Each consumed file's node-cache blob (queuing the write-behind of the fills)."""
    return [f.publish() if isinstance(f, Fill) else done(f.hit) for f in files]


def _check_shard(target: Target, file: str, tensor: str, seen: set[str]) -> None:
    if target.weight_map is None:
        return
    if target.weight_map.get(tensor) != file or tensor in seen:
        raise HeaderInvalid(name=file, reason=f"tensor {tensor!r} is not mapped to it by the index")
    seen.add(tensor)


def stream(
    url: str, *, device: str = "cpu", config: ConfigLike = None, progress: Progress | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` as each tensor's bytes become available.

    A node-cache hit maps the blob (tensors are views on the page cache); a miss streams
    from the regional tier or the origin into memory, and the node cache is filled from
    the same bytes (after the load returns: ``LoaderConfig.writes_behind``).

    Args:
        url: ``file://``, ``s3://``, ``gs://``, ``https://`` or ``hf://org/repo@rev[/file]``.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"``.
        config: a :class:`LoaderConfig` or a mapping of its fields.
        progress: optional ``(bytes_done, bytes_total)`` callback, per file.

    Returns:
        An iterator of ``(name, tensor)`` pairs.

    Raises:
        UnsafeFormat: the weights are pickle-based.
        HeaderInvalid: a header or index lies about the file.
        WeightsError: any other failure to fetch, verify or cache the weights.

    Example:
        >>> for name, tensor in stream("file:///models/mlp/model.safetensors"):  # doctest: +SKIP
        ...     model.get_parameter(name).data = tensor
    """
    cfg = as_config(config)
    target = resolve_target(url, cfg)
    yield from stream_target(url, target, cfg, _copier(device, cfg), progress, [])


def stream_target(
    url: str,
    target: Target,
    cfg: LoaderConfig,
    copier: Any,
    progress: Progress | None,
    published: list[Future[NodeHit | None]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`stream` once the URL is resolved; ``published`` receives one future per file
    that gives its node-cache blob (``None`` when the cache write failed). Closes the source.
    """
    node = NodeTier(cfg)
    seen: set[str] = set()
    files = list(target.files)
    behind = cfg.writes_behind(url)
    pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="ember-range")
    begun: list[Fill | _Mapped] = []
    consumed: list[Fill | _Mapped] = []
    try:
        for i, name in enumerate(files):
            if not begun:
                begun.append(_begin(node, target, name, progress, pool, behind))
            if i + 1 < len(files):  # the next file's header and buffer, while this one reads
                begun.append(_begin(node, target, files[i + 1], progress, pool, behind))
            consumed.append(begun.pop(0))
            for tensor_name, tensor in _file_tensors(consumed[-1]):
                _check_shard(target, name, tensor_name, seen)
                yield tensor_name, copier.copy(tensor) if copier else tensor
        if target.weight_map is not None and len(seen) != len(target.weight_map):
            missing = sorted(set(target.weight_map) - seen)[:5]
            raise HeaderInvalid(name=url, reason=f"index lists tensors no shard has: {missing}")
    finally:
        for left in begun:
            if isinstance(left, Fill):
                left.abandon()
        pool.shutdown(wait=True, cancel_futures=True)
        target.source.close()
        # Every file read whole is published, even when a later one failed.
        published.extend(_published([f for f in consumed if not isinstance(f, Fill) or f.read]))


def load(
    url: str, *, device: str = "cpu", config: ConfigLike = None, progress: Progress | None = None
) -> dict[str, torch.Tensor]:
    """Load every tensor of ``url`` (see :func:`stream` for the arguments and errors).

    A blob from the regional tier that fails its checksum is dropped there and the load is
    retried once from the origin.

    Returns:
        A dict of tensor name to tensor.

    Example:
        >>> tensors = load("hf://sentence-transformers/all-MiniLM-L6-v2")  # doctest: +SKIP
    """
    try:
        return dict(stream(url, device=device, config=config, progress=progress))
    except IntegrityError:
        return dict(stream(url, device=device, config=config, progress=progress))


def resolve(
    url: str, *, config: ConfigLike = None, progress: Progress | None = None
) -> LocalWeights:
    """Fill the node (and regional) cache for ``url`` and return the local paths.

    Args:
        url: the weights URL (as for :func:`stream`).
        config: a :class:`LoaderConfig` or a mapping of its fields.
        progress: optional ``(bytes_done, bytes_total)`` callback, per file.

    Returns:
        :class:`LocalWeights` with one node-cache path per safetensors file.

    Raises:
        WeightsError: as for :func:`stream`.
    """
    weights, _ = resolve_and_use(url, as_config(config), None, progress=progress)
    return weights


def resolve_and_use(
    url: str,
    cfg: LoaderConfig,
    use: Callable[[LocalWeights], T] | None,
    *,
    progress: Progress | None = None,
    seal_behind: bool = False,
) -> tuple[LocalWeights, T | None]:
    """Fill the node cache for ``url`` and call ``use`` with the paths before returning.

    With ``seal_behind``, a file filled from the origin is handed to ``use`` as its
    complete temp file; once ``use`` returns (having opened or mapped it), a background
    thread hashes it, renames it to its blob name, fsyncs it and publishes its marker and
    snapshot link (``published``). Until then no lookup trusts it, and a crash leaves only
    files the next fill sweeps.

    Raises:
        WeightsError: as for :func:`stream`; or what ``use`` raises.
    """
    target = resolve_target(url, cfg)
    node = NodeTier(cfg)
    regional = regional_tier(cfg)
    paths: list[Path] = []
    sources: list[str] = []
    outcomes: list[Fill | NodeHit] = []
    futures: tuple[Future[NodeHit | None], ...] = ()
    try:
        for name in target.files:
            key, outcome = obtain(node, target.source, name, progress, seal_behind=seal_behind)
            outcomes.append(outcome)
            if isinstance(outcome, Fill):
                for _ in outcome.run():
                    pass
                outcome.release_buffer()  # the caller maps the file: one buffer at a time
                path = outcome.filled or (outcome.hit.link if outcome.hit else None)
                if path is None:
                    raise SourceError("fill finished without publishing", url=url)
                sources.append(outcome.tier)
            else:
                if regional is not None and regional.lookup(key) is None:
                    regional.publish_file(key, outcome.path, outcome.record)
                path = outcome.link
                sources.append("node")
            paths.append(path)
        weights = LocalWeights(url, tuple(paths), target.weight_map, tuple(sources), target.files)
        used = use(weights) if use is not None else None
    finally:
        target.source.close()
        # Every filled file is sealed, even when a later one failed: it holds the ticket.
        futures = tuple(o.publish() if isinstance(o, Fill) else _done(o) for o in outcomes
                        if not isinstance(o, Fill) or o.read)
    return replace(weights, published=futures), used


def _done(hit: NodeHit) -> Future[NodeHit | None]:
    return done(hit)


def cache_root(config: ConfigLike = None) -> Path:
    """The node cache directory the given config (or the environment) selects."""
    return as_config(config).node_root()
