"""A fill from a local file that the kernel copies into the node cache's temp file.

When the load maps the fill's own temp file (``seal_behind``) and the origin is a local
file with no published checksum, the bytes need not pass through this process: each
range is copied file to file with ``copy_file_range``, on the reader's threads. There is
no anonymous buffer to allocate and fill, and no second copy out of it; the hash is left
to the seal. ``bench/first_fill.py`` times the whole first load this way against one
that waits for the seal and against ``from_pretrained``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from ember.errors import CacheFull, ShortRead, SourceError
from ember.loaders._config import LoaderConfig
from ember.loaders._header import Header, TensorSpec
from ember.loaders._reader import Progress, plan_ranges, read_header
from ember.loaders._source import ObjectInfo
from ember.loaders._source_file import FileSource
from ember.loaders._tier_node import TempBlob

# Kernels or filesystems without an in-kernel copy between these two files.
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)
_COPY_BYTES = 16 << 20


class FileCopy:
    """Copies one local safetensors file into a temp file, range by range.

    The interface is the part of :class:`~ember.loaders._reader.StreamingReader` that a
    write-through fill uses: ``header``, ``info``, ``sha256`` (always ``""``: the seal
    hashes), :meth:`start`, :meth:`run` and :meth:`cancel`.

    Args:
        source: the local origin.
        info: the file's size and version, captured once (checked before and after
            every range).
        config: range size and concurrency.
        progress: optional ``(bytes_done, bytes_total)`` callback.
    """

    def __init__(self, source: FileSource, info: ObjectInfo, config: LoaderConfig,
                 progress: Progress | None = None) -> None:
        self.source, self.info, self.config, self.progress = source, info, config, progress
        self.sha256 = ""
        self.header: Header
        self.header, self._raw = read_header(source, info, config.max_header_bytes)
        self._tmp: TempBlob | None = None
        self._futures: list[Future[int]] = []
        self._own_pool: ThreadPoolExecutor | None = None

    def attach_file(self, tmp: TempBlob) -> None:
        """Copy into ``tmp`` (set after the header is validated); writes the header now."""
        self._tmp = tmp
        tmp.write_at(0, memoryview(self._raw))

    def start(self, pool: ThreadPoolExecutor | None = None) -> None:
        """Queue every range's copy on ``pool`` (or a pool of its own)."""
        if self._futures or self._tmp is None:
            return
        ranges = plan_ranges(self.header.data_start, self.info.size,
                             max(self.config.range_bytes, _COPY_BYTES))
        if pool is None:
            workers = max(1, min(self.config.max_concurrency, 4, len(ranges)))
            pool = self._own_pool = ThreadPoolExecutor(workers, thread_name_prefix="ember-copy")
        self._futures = [pool.submit(self._copy, start, end) for start, end in ranges]

    def _copy(self, start: int, end: int) -> int:
        assert self._tmp is not None  # start() needs it
        fd = self.source.open_checked(self.info)
        try:
            done = _copy_range(fd, self._tmp, start, end, self.source.describe(self.info.name))
            if done < end - start:
                raise ShortRead(url=self.source.describe(self.info.name), start=start, end=end,
                                got=done)
            self.source.check(fd, self.info)  # a rewrite during the copy would mix versions
        finally:
            os.close(fd)
        return done

    def cancel(self) -> None:
        """Drop the copies not started and wait for the others."""
        if self._own_pool is not None:
            self._own_pool.shutdown(wait=True, cancel_futures=True)
            return
        for fut in self._futures:
            fut.cancel()
        wait_futures(self._futures)

    def run(self) -> Iterator[TensorSpec]:
        """Wait for every range; then yield the tensors (their bytes are all in the file).

        Raises:
            ShortRead, ObjectChanged: the origin shrank or changed during the copy.
            CacheFull: the temp file could not be written.
        """
        self.start()
        received = self.header.data_start
        try:
            for fut in self._futures:
                received += fut.result()
                if self.progress is not None:
                    self.progress(received, self.info.size)
        finally:
            self.cancel()
        self.source.confirm(self.info)
        yield from self.header.tensors


def _copy_range(src: int, tmp: TempBlob, start: int, end: int, where: str) -> int:
    """Copy ``[start, end)`` of ``src`` to the same offsets of ``tmp``; the bytes copied.

    Falls back to ``pread``/``pwrite`` through a small buffer where the kernel cannot copy
    between these files, or where ``copy_file_range`` stops short (some filesystems return
    0 before the end): a real end of file then shows there.

    Raises:
        CacheFull: the node cache's disk is full.
        SourceError: another read or write error.
    """
    done = 0
    try:
        while done < end - start:
            got = os.copy_file_range(src, tmp.fd, end - start - done, start + done, start + done)
            if got == 0:
                break
            done += got
        else:
            return done
    except OSError as exc:
        if exc.errno not in _NO_KERNEL_COPY:
            raise _copy_error(exc, tmp, where) from exc
    buffer = bytearray(min(_COPY_BYTES, end - start - done))
    try:
        while done < end - start:
            view = memoryview(buffer)[: min(len(buffer), end - start - done)]
            got = os.preadv(src, [view], start + done)
            if got == 0:
                return done
            tmp.write_at(start + done, view[:got])
            done += got
    except OSError as exc:
        raise _copy_error(exc, tmp, where) from exc
    return done


def _copy_error(exc: OSError, tmp: TempBlob, where: str) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return CacheFull(size=tmp.size, root=tmp.path.parent, reason=str(exc))
    return SourceError(f"copying into the node cache failed: {exc}", url=where)
