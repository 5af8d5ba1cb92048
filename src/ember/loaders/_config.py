"""Loader configuration: one Pydantic model, units in the field names."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from ember import settings
from ember.loaders.pages import free_page_reporting

MiB = 1 << 20
GiB = 1 << 30
#: The safetensors format caps the JSON header at 100 MB; Ember never reads more.
HEADER_CAP_BYTES = 100_000_000


def default_cache_dir() -> Path:
    """The node cache directory: ``EMBER_CACHE_DIR`` or ``~/.cache/ember``."""
    configured = settings.load().cache_dir
    return configured.expanduser() if configured else Path.home() / ".cache" / "ember"


class LoaderConfig(BaseModel):
    """How weights are fetched and cached.

    Args:
        range_bytes: size of each merged range read of tensor bytes.
        max_concurrency: range reads in flight at once, per file.
        cache_dir: node cache directory; ``None`` reads ``EMBER_CACHE_DIR`` (default
            ``~/.cache/ember``) when the loader runs.
        regional_cache: fsspec URL of the regional tier; ``None`` reads
            ``EMBER_REGIONAL_CACHE``; an empty string disables the tier.
        cache_max_bytes: LRU cap on the node cache's blob bytes (a blob a live process maps
            is never evicted: unlinking it would free no disk).
        min_free_bytes: free disk space a fill must leave behind.
        lease_timeout_s: a fill lease whose heartbeat is older than this is taken over.
        lease_heartbeat_s: how often a filler refreshes its lease.
        poll_interval_s: how often a waiter in another process checks a fill.
        max_header_bytes: largest safetensors header accepted (at most 100 MB).
        staging_bytes: size of the pinned buffer used for host-to-device copies.
        verify_hits: re-hash a node-cache blob on every hit (slow, thorough).
        huge_pages: map node-cache blobs ``MADV_HUGEPAGE``: a cold read brings the pages
            into 2 MiB folios, and every later mapping of them (the next replica on the
            node, the next start from zero) takes one page-table entry per 2 MiB instead of
            512. ``bench/page_reads.py`` on this project's VM: later mappings 4.7-7.4x
            faster; cold reads 2.0-2.4x faster into memory the host still backs, but
            0.57-0.65x once freed memory went back to the host (free page reporting).
            ``"auto"`` (the default) is on unless this machine's balloon reports free pages
            (:meth:`maps_huge`, docs/coldstart-sizes.md). Linux with a filesystem that
            caches large folios (ext4, xfs); elsewhere a no-op.
        cache_write: ``"behind"``: a load returns once its bytes are in memory, and the node
            cache is filled from those bytes in the background; ``"through"``: every byte
            is written to the node cache as it arrives and the load returns once the blob
            is published (:func:`~ember.loaders.resolve` always works this way);
            ``"auto"``: behind for remote origins; for ``file://``, through, but the
            load returns before the fsync and the publication (see :meth:`writes_behind`
            and :meth:`seals_behind`).
        storage_options: keyword arguments for the origin's fsspec filesystem
            (e.g. ``{"endpoint_url": ...}`` for s3fs).
        regional_storage_options: the same for the regional tier's filesystem.

    Raises:
        pydantic.ValidationError: a value is out of range, or the heartbeat is not well
            under the lease timeout.

    Example:
        >>> LoaderConfig(range_bytes=4 << 20, max_concurrency=4).max_concurrency
        4
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    range_bytes: PositiveInt = 8 * MiB
    max_concurrency: int = Field(default=8, ge=1, le=256)
    cache_dir: Path | None = None
    regional_cache: str | None = None
    cache_max_bytes: PositiveInt = 64 * GiB
    min_free_bytes: int = Field(default=256 * MiB, ge=0)
    lease_timeout_s: PositiveFloat = 30.0
    lease_heartbeat_s: PositiveFloat = 5.0
    poll_interval_s: PositiveFloat = 0.05
    max_header_bytes: int = Field(default=HEADER_CAP_BYTES, ge=2, le=HEADER_CAP_BYTES)
    staging_bytes: PositiveInt = 64 * MiB
    verify_hits: bool = False
    huge_pages: bool | Literal["auto"] = "auto"
    cache_write: Literal["auto", "behind", "through"] = "auto"
    storage_options: dict[str, Any] = Field(default_factory=dict)
    regional_storage_options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _heartbeat_under_timeout(self) -> LoaderConfig:
        # A heartbeat slower than half the timeout lets a live filler look dead.
        if self.lease_heartbeat_s * 2 > self.lease_timeout_s:
            raise ValueError(
                f"lease_heartbeat_s ({self.lease_heartbeat_s}) must be at most half of "
                f"lease_timeout_s ({self.lease_timeout_s})"
            )
        return self

    def node_root(self) -> Path:
        """The node cache directory this config resolves to now."""
        return (self.cache_dir or default_cache_dir()).expanduser()

    def writes_behind(self, url: str) -> bool:
        """Whether a load of ``url`` fills the node cache after it returns.

        ``"auto"`` writes behind for remote origins, where waiting for a synced disk write
        would double the network read, and through for ``file://``: there the read is the
        disk's own, and a replica whose tensors map the node cache shares its pages with
        the replicas that start after it (a write-behind replica too, once its blobs are
        published: :func:`ember.loaders.pages.remap_onto`).

        Example:
            >>> LoaderConfig().writes_behind("s3://b/m/"), LoaderConfig().writes_behind("file:///m")
            (True, False)
        """
        if self.cache_write == "auto":
            return not url.lower().startswith("file:")
        return self.cache_write == "behind"

    def seals_behind(self, url: str) -> bool:
        """Whether a load of ``url`` that writes through returns before its fills are sealed.

        ``"auto"`` does, for ``file://``: the bytes are in the page cache under their blob
        name when the load maps them; the fsync (bound by the disk's durable write speed,
        which can be slower than its reads), the marker and the snapshot link follow on a
        background thread. ``"through"`` waits for them.

        Example:
            >>> LoaderConfig().seals_behind("file:///m"), LoaderConfig(cache_write="through").seals_behind("file:///m")
            (True, False)
        """
        return self.cache_write == "auto" and not self.writes_behind(url)

    def maps_huge(self) -> bool:
        """Whether node-cache blobs are mapped ``MADV_HUGEPAGE`` on this machine.

        ``"auto"`` maps them so unless the machine hands freed memory back to its host
        (:func:`ember.loaders.pages.free_page_reporting`): there, the 2 MiB folios a cold
        read allocates come from memory the host must back again, and the cold start,
        the one a user waits for, reads slower; everywhere else they read faster too.

        Example:
            >>> [LoaderConfig(huge_pages=on).maps_huge() for on in (False, True)]
            [False, True]
        """
        if self.huge_pages == "auto":
            return not free_page_reporting()
        return self.huge_pages

    def regional_url(self) -> str | None:
        """The regional tier's URL, or ``None`` when there is no regional tier."""
        url = self.regional_cache
        if url is None:
            url = settings.load().regional_cache
        return url or None


def as_config(config: LoaderConfig | Mapping[str, Any] | None) -> LoaderConfig:
    """Accept a model, a mapping of fields, or ``None`` for the defaults."""
    if config is None:
        return LoaderConfig()
    if isinstance(config, LoaderConfig):
        return config
    return LoaderConfig.model_validate(dict(config))
