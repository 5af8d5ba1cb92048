"""The streaming safetensors reader.

Two small range reads fetch the header (the 8-byte length, then the JSON), which is
validated before anything large is read or allocated. The tensor bytes are then fetched as
large range reads, concurrently, straight into one preallocated buffer (and, when a sink
is given, written through to the cache file at the same offsets). Tensors are yielded in
file order as soon as every byte before their end has arrived, so a caller can build its
model while the rest downloads.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import queue
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import blake3

from ember.errors import IntegrityError, ShortRead
from ember.loaders._config import LoaderConfig
from ember.loaders._header import PREFIX_BYTES, Header, TensorSpec, parse_header, parse_length
from ember.loaders._source import ObjectInfo, WeightSource
from ember.loaders.pages import prefault

#: ``sink(offset, data)`` persists bytes at a file offset (the cache's write-through).
Sink = Callable[[int, memoryview], None]
#: ``progress(bytes_done, bytes_total)``.
Progress = Callable[[int, int], None]
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0)


def plan_ranges(start: int, end: int, range_bytes: int) -> list[tuple[int, int]]:
    """Split ``[start, end)`` into consecutive reads of at most ``range_bytes``.

    The header forbids gaps between tensors, so the merged reads are simply the data region
    cut into large pieces; many small tensors share one read, a large one spans several.

    Example:
        >>> plan_ranges(8, 30, 10)
        [(8, 18), (18, 28), (28, 30)]
    """
    return [(a, min(a + range_bytes, end)) for a in range(start, end, range_bytes)]


def read_header(source: WeightSource, info: ObjectInfo, cap_bytes: int) -> tuple[Header, bytes]:
    """Fetch and validate the header with two small range reads.

    Returns:
        The validated header and its raw bytes (prefix included).

    Raises:
        HeaderInvalid, UnsafeFormat, ShortRead, RangeNotSupported, ObjectChanged.
    """
    name = source.describe(info.name)
    if info.size < PREFIX_BYTES:
        prefix = source.read_range(info, 0, info.size) if info.size else b""
    else:
        prefix = source.read_range(info, 0, PREFIX_BYTES)
    length = parse_length(prefix, name=name, file_size=info.size, cap_bytes=cap_bytes)
    raw = source.read_range(info, PREFIX_BYTES, PREFIX_BYTES + length)
    if len(raw) != length:
        raise ShortRead(url=name, start=PREFIX_BYTES, end=PREFIX_BYTES + length, got=len(raw))
    return parse_header(raw, name=name, file_size=info.size), prefix + raw


def anonymous_buffer(size: int) -> mmap.mmap:
    """A private anonymous mapping of ``size`` bytes; its pages are allocated by the range
    reads that fill them (:func:`ember.loaders.pages.prefault`).

    Populating the whole file when it is mapped (``MAP_POPULATE``) held back the first range
    read until every page of the file existed, about 0.1-0.2 s per 200 MB on a small
    machine; 2 MiB pages (``MADV_HUGEPAGE``) were slower still on a long-running node, whose
    free memory must first be compacted into huge pages.
    """
    return mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | _MAP_ANONYMOUS)


def buffer_address(buffer: mmap.mmap) -> int:
    """Where ``buffer``'s memory starts (for :func:`ember.loaders.pages.prefault`); the
    mapping stays closable."""
    view = ctypes.c_char.from_buffer(buffer)
    address = ctypes.addressof(view)
    del view  # releases the export, which would otherwise forbid closing the mapping
    return address


class StreamingReader:
    """Reads one safetensors object into an anonymous mapping.

    Args:
        source: where the bytes come from.
        info: the object's size and version, captured once.
        config: range size and concurrency.
        sink: optional write-through of every byte at its offset.
        progress: optional ``(bytes_done, bytes_total)`` callback.
        hash_bytes: hash the bytes in file order as they arrive (and check the origin's
            checksum, when it publishes one); ``False`` leaves the hash to the cache write.

    After :meth:`run` is exhausted, :attr:`sha256` holds the checksum of the bytes (empty
    when ``hash_bytes`` is ``False``). Where ``info`` carries a BLAKE3 as well (a regional
    marker binds the two), the reader computes and checks that instead, and the verified
    bytes take the marker's SHA-256.
    """

    def __init__(
        self,
        source: WeightSource,
        info: ObjectInfo,
        config: LoaderConfig,
        *,
        sink: Sink | None = None,
        progress: Progress | None = None,
        hash_bytes: bool = True,
    ) -> None:
        self.source = source
        self.info = info
        self.config = config
        self.sink = sink
        self.progress = progress
        self.sha256 = ""
        self.header, raw = read_header(source, info, config.max_header_bytes)
        # One buffer for the whole file; tensors are views on it. Anonymous mappings are
        # page-aligned, so every tensor offset keeps its dtype alignment.
        self.buffer = anonymous_buffer(info.size)
        self._address = buffer_address(self.buffer)
        self.buffer[: len(raw)] = raw
        # A BLAKE3 beside the SHA-256 (a regional marker binds the two): check that, faster.
        self._vouched = bool(info.blake3 and info.sha256)
        self._hasher: Any = None
        if hash_bytes:
            self._hasher = blake3.blake3(raw) if self._vouched else hashlib.sha256(raw)
        self._spans: dict[Future[None], tuple[int, int]] | None = None
        self._done: queue.SimpleQueue[Future[None]] = queue.SimpleQueue()
        self._own_pool: ThreadPoolExecutor | None = None
        if sink is not None:
            self.attach_sink(sink)

    def attach_sink(self, sink: Sink) -> None:
        """Write every byte through to ``sink`` too (set after the header is validated)."""
        self.sink = sink
        raw_end = self.header.data_start
        with memoryview(self.buffer)[:raw_end] as view:
            sink(0, view)

    def _fetch(self, start: int, end: int) -> None:
        view = memoryview(self.buffer)[start:end]
        try:
            prefault(self._address, start, end)
            self.source.read_into(self.info, start, view)
            if self.sink is not None:
                self.sink(start, view)
        finally:
            view.release()

    def start(self, pool: ThreadPoolExecutor | None = None) -> None:
        """Queue every range read, on ``pool`` (shared by a load's files) or a pool of its own.

        A load starts its next file before it consumes this one, so the next file's header
        and buffer are ready, and its reads queued, when this one's last reads finish.
        """
        if self._spans is not None:
            return
        ranges = plan_ranges(self.header.data_start, self.info.size, self.config.range_bytes)
        if pool is None:
            workers = max(1, min(self.config.max_concurrency, len(ranges)))
            pool = self._own_pool = ThreadPoolExecutor(workers, thread_name_prefix="ember-range")
        self._spans = {}
        for start, end in ranges:
            fut = pool.submit(self._fetch, start, end)
            self._spans[fut] = (start, end)
            fut.add_done_callback(self._done.put)

    def cancel(self) -> None:
        """Drop the reads not started and wait for the others (nothing writes afterwards)."""
        if self._own_pool is not None:
            self._own_pool.shutdown(wait=True, cancel_futures=True)
            return
        spans = self._spans or {}
        for fut in spans:
            fut.cancel()
        wait_futures(list(spans))

    def run(self) -> Iterator[TensorSpec]:
        """Fetch every tensor byte; yield each tensor once its bytes have all arrived.

        Raises:
            ShortRead, ObjectChanged, RangeNotSupported, SourceError: a read failed.
            IntegrityError: the checksum differs from the one the origin published.
        """
        tensors = iter(self.header.tensors)
        pending = next(tensors, None)
        cursor = self.header.data_start
        while pending is not None and pending.end <= cursor:  # zero-size tensors first
            yield pending
            pending = next(tensors, None)
        self.start()
        spans = dict(self._spans or {})
        try:
            arrived: dict[int, int] = {}
            received = cursor
            for _ in range(len(spans)):
                fut = self._done.get()
                fut.result()
                start, end = spans.pop(fut)
                arrived[start] = end
                received += end - start
                if self.progress is not None:
                    self.progress(received, self.info.size)
                cursor = self._advance(cursor, arrived)
                while pending is not None and pending.end <= cursor:
                    yield pending
                    pending = next(tensors, None)
        finally:
            self.cancel()
        self._finish(cursor)

    def _advance(self, cursor: int, arrived: dict[int, int]) -> int:
        # Hash in file order as the contiguous prefix grows; hashlib releases the GIL.
        while cursor in arrived:
            end = arrived.pop(cursor)
            if self._hasher is not None:
                with memoryview(self.buffer)[cursor:end] as view:
                    self._hasher.update(view)
            cursor = end
        return cursor

    def _finish(self, cursor: int) -> None:
        name = self.source.describe(self.info.name)
        if cursor != self.info.size:
            raise ShortRead(url=name, start=cursor, end=self.info.size, got=0)
        # Sources without If-Match (plain fsspec) are re-checked once at the end.
        self.source.confirm(self.info)
        if self._hasher is None:
            return
        actual = str(self._hasher.hexdigest())
        expected = self.info.blake3 if self._vouched else self.info.sha256
        if expected and expected != actual:
            raise IntegrityError(what="blake3" if self._vouched else "sha256", name=name,
                                 expected=expected, actual=actual)
        self.sha256 = (self.info.sha256 or "") if self._vouched else actual
