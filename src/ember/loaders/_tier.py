"""The cache-tier interface and the keys that name immutable blobs."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from ember.loaders._paths import check_relative, component


@dataclass(frozen=True)
class BlobKey:
    """Names one origin file version: origin + repository, version (ETag/commit), file name.

    A key never names mutable content: a new ETag or commit is a new key.
    """

    namespace: str
    version: str
    name: str

    def parts(self) -> tuple[str, str, str]:
        """Safe path components: namespace, version directory, relative file name."""
        return component(self.namespace), component(self.version), check_relative(self.name)

    def digest(self) -> str:
        """A fixed-length id for lease files."""
        text = f"{self.namespace}\0{self.version}\0{self.name}"
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:40]


@dataclass(frozen=True)
class BlobRecord:
    """What a marker says about a published blob.

    Attributes:
        sha256: the blob's name and content checksum.
        size: its size in bytes.
        blake3: a second checksum of the same bytes, where the tier records one (the
            regional tier): a reader verifies it several times faster than SHA-256, and it
            vouches for ``sha256`` because the marker binds the two.
    """

    sha256: str
    size: int
    blake3: str = ""


@dataclass(frozen=True)
class CacheEntry:
    """One published blob, as listed by ``ember cache ls``."""

    namespace: str
    sha256: str
    size: int
    last_used_s: float
    names: tuple[str, ...]


class CacheTier(ABC):
    """A place that holds verified, immutable blobs keyed by :class:`BlobKey`."""

    #: Where the tier lives (a directory or an fsspec URL), for messages.
    location: str

    @abstractmethod
    def lookup(self, key: BlobKey) -> BlobRecord | None:
        """The record of the blob published for ``key``, or ``None`` on a miss.

        A blob whose size disagrees with its marker counts as a miss and is removed.
        """

    @abstractmethod
    def publish_file(self, key: BlobKey, path: Path, record: BlobRecord) -> None:
        """Publish a verified local file as the blob for ``key`` (atomically)."""

    @abstractmethod
    def entries(self) -> list[CacheEntry]:
        """Every published blob."""

    @abstractmethod
    def remove(self, namespace: str, sha256: str) -> bool:
        """Remove one blob (by unlinking); ``False`` when it was not there."""
