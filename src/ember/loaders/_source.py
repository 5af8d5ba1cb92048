"""The weight-source interface: where the original bytes of a checkpoint live."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from ember.errors import ObjectChanged, ShortRead, SourceError

#: Largest non-weights file (a shard index) read whole.
SMALL_FILE_CAP_BYTES = 16 << 20


@dataclass(frozen=True)
class ObjectInfo:
    """What a source says about one file, captured once and checked on every read.

    Attributes:
        name: the file's name relative to the source root.
        size: its size in bytes.
        version: a token that changes whenever the bytes change (ETag, commit, size+mtime).
        sha256: the content checksum, when the origin publishes one.
        blake3: a BLAKE3 checksum of the same bytes, when the origin records one (the
            regional cache's marker); a reader verifies it instead of ``sha256``.
        check: what each read compares against when it differs from ``version`` (a
            file's size/mtime when the version is a commit hash).
    """

    name: str
    size: int
    version: str
    sha256: str | None = None
    check: str | None = None
    blake3: str | None = None


class WeightSource(ABC):
    """A directory-like origin (local directory, object-store prefix, HTTP folder, HF repo).

    Every read names the :class:`ObjectInfo` captured by :meth:`stat`; an implementation
    raises :class:`ObjectChanged` when the object no longer matches it.
    """

    #: Canonical URL of the root, for messages.
    url: str
    #: Cache directory name for this origin and repository (one path component).
    namespace: str

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether ``name`` exists under the root."""

    @abstractmethod
    def stat(self, name: str) -> ObjectInfo:
        """Size and version of ``name``.

        Raises:
            WeightsNotFound: no such file.
        """

    @abstractmethod
    def read_range(self, info: ObjectInfo, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object described by ``info``.

        Raises:
            RangeNotSupported: the server returned the whole object.
            ShortRead: fewer bytes arrived.
            ObjectChanged: the object no longer matches ``info``.
        """

    def read_into(self, info: ObjectInfo, start: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``start``; the default copies from :meth:`read_range`."""
        data = self.read_range(info, start, start + len(out))
        out[:] = data

    def confirm(self, info: ObjectInfo) -> None:
        """Raise :class:`ObjectChanged` if the object no longer matches ``info``."""
        now = self.stat(info.name)
        if (now.size, now.version) != (info.size, info.version):
            raise ObjectChanged(
                f"version {info.version} became {now.version}", url=self.describe(info.name)
            )

    def describe(self, name: str) -> str:
        """The URL of ``name``, for messages."""
        return f"{self.url.rstrip('/')}/{name}"

    def read_small(self, name: str) -> bytes:
        """Read a small file (a shard index) whole, refusing anything over 16 MiB."""
        info = self.stat(name)
        if info.size > SMALL_FILE_CAP_BYTES:
            raise SourceError(
                f"{info.size} bytes is too large for an index", url=self.describe(name)
            )
        if info.size == 0:
            return b""
        data = self.read_range(info, 0, info.size)
        if len(data) != info.size:
            raise ShortRead(url=self.describe(name), start=0, end=info.size, got=len(data))
        return data

    def close(self) -> None:  # noqa: B027 - optional hook; most sources hold nothing
        """Release connections or file handles."""
