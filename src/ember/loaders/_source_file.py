"""Weights in a local (or mounted) directory: ``file:///path/``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ember.errors import ObjectChanged, ShortRead, WeightsNotFound
from ember.loaders._paths import check_relative
from ember.loaders._source import ObjectInfo, WeightSource


def file_version(st: os.stat_result) -> str:
    """A token that changes when a file is rewritten or replaced."""
    return f"{st.st_size}-{st.st_mtime_ns}-{st.st_ino}"


class FileSource(WeightSource):
    """Reads with ``pread`` straight into the caller's buffer; checks size/mtime per read.

    Args:
        root: the directory that holds the weights.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = root.as_uri()
        digest = hashlib.sha256(str(root).encode("utf-8", "surrogatepass")).hexdigest()[:16]
        self.namespace = f"files--{root.name or 'root'}--{digest}"

    def _path(self, name: str) -> Path:
        return self.root / check_relative(name)

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def stat(self, name: str) -> ObjectInfo:
        try:
            st = os.stat(self._path(name))
        except FileNotFoundError:
            raise WeightsNotFound("no such file", url=self.describe(name)) from None
        return ObjectInfo(name=name, size=st.st_size, version=file_version(st))

    def read_range(self, info: ObjectInfo, start: int, end: int) -> bytes:
        out = bytearray(end - start)
        self.read_into(info, start, memoryview(out))
        return bytes(out)

    def open_checked(self, info: ObjectInfo) -> int:
        """An open descriptor of ``info``'s file, checked to be the version captured.

        Raises:
            ObjectChanged: the file was rewritten or replaced since ``info`` was captured.
        """
        fd = os.open(self._path(info.name), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self.check(fd, info)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_into(self, info: ObjectInfo, start: int, out: memoryview) -> None:
        fd = self.open_checked(info)
        try:
            done = 0
            while done < len(out):
                got = os.preadv(fd, [out[done:]], start + done)
                if got == 0:
                    raise ShortRead(
                        url=self.describe(info.name), start=start, end=start + len(out), got=done
                    )
                done += got
            # Checked after the read as well: a rewrite during the read would mix versions.
            self.check(fd, info)
        finally:
            os.close(fd)

    def check(self, fd: int, info: ObjectInfo) -> None:
        """Raise :class:`ObjectChanged` unless ``fd`` is still the version of ``info``."""
        now = file_version(os.fstat(fd))
        expected = info.check or info.version
        if now != expected:
            raise ObjectChanged(
                f"size/mtime/inode {expected} became {now}", url=self.describe(info.name)
            )
