"""Page-cache residency of node-cache blobs: what is in memory, bring in the rest, drop it.

A blob mapped by a replica is read lazily, one page fault at a time (the kernel's readahead
on a mapping is a few hundred KB), which on a cold page cache reads at a fraction of the
disk's speed. :func:`prefetch` instead reads the pages that are not resident with large
parallel ``pread`` calls (the GIL is released while each one waits), so the mapping's later
faults are minor ones; pages already resident, as for a second replica of the same model
on the node, are found with ``mincore(2)`` and skipped, so its start does not grow with the
model's size. :func:`evict` drops a file's clean, unmapped pages (benches and ``ember cache
bench`` use it to measure a cold page cache).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import os
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

_PAGE = mmap.PAGESIZE
_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value
#: Resident runs closer than this are read through: one large read beats two seeks.
_MERGE_GAP_BYTES = 1 << 20
CHUNK_BYTES = 16 << 20
#: Larger for :func:`populate`: the kernel reads ahead within one call. Eight calls of
#: 32 MiB in flight kept this virtual disk busier than four of 64 MiB
#: (``bench/page_reads.py`` compares them).
POPULATE_CHUNK_BYTES = 32 << 20
POPULATE_WORKERS = 8

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.syscall.restype = ctypes.c_long
#: Linux 5.14's ``MADV_POPULATE_READ``/``_WRITE`` (Python 3.11's ``mmap`` lacks them).
_POPULATE_READ = 22
_POPULATE_WRITE = 23
_MADV_NORMAL = 0
_MADV_SEQUENTIAL = 2
_EINVAL = 22


#: Where Linux lists virtio devices; a balloon's ``device`` is 0x0005, and bit 5 of its
#: negotiated ``features`` (one character per bit, bit 0 first) is free page reporting.
VIRTIO_DEVICES = Path("/sys/bus/virtio/devices")
_VIRTIO_BALLOON = 0x0005
_BALLOON_F_REPORTING = 5


@functools.cache  # a device's negotiated features hold until the machine restarts
def free_page_reporting(devices: Path = VIRTIO_DEVICES) -> bool:
    """Whether this (virtual) machine hands its free memory back to the host as it frees it
    (a virtio balloon that negotiated free page reporting, as Firecracker's and QEMU's can).

    On such a host a 2 MiB page-cache folio read cold must first be backed by the host again,
    and ``bench/page_reads.py --at-rest`` reads large folios at 0.57-0.65x the small ones.
    """
    for device in devices.glob("*") if devices.is_dir() else ():
        with contextlib.suppress(OSError, ValueError):
            if int((device / "device").read_text(), 16) != _VIRTIO_BALLOON:
                continue
            bits = (device / "features").read_text().strip()
            if len(bits) > _BALLOON_F_REPORTING and bits[_BALLOON_F_REPORTING] == "1":
                return True
    return False


def residency(path: Path) -> bytes:
    """One byte per page of ``path``: bit 0 set when the page is in the page cache.

    Raises:
        OSError: the file cannot be opened or mapped.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        addr = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = ctypes.create_string_buffer((size + _PAGE - 1) // _PAGE)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return vec.raw
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache now: ``cachestat(2)`` (Linux 6.5), else
    ``mincore(2)`` over a mapping of the file.

    Every load counts what it will read with this, so it is on a replica's start path:
    ``cachestat`` walks the page cache's folios without building a mapping, several times
    faster at gigabytes than ``mincore``'s page-by-page answer.
    """
    cached = _cachestat_pages(path)
    if cached is None:
        vec = residency(path)
        cached = len(vec) - vec.count(b"\x00") if vec else 0
    return min(cached * _PAGE, os.stat(path).st_size)


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]  # len 0: to the end


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


#: ``cachestat``'s number, the same on every architecture (syscalls from 424 on share one
#: table); cleared once the kernel says it has none.
_cachestat_nr: int | None = 451 if sys.platform == "linux" else None
_ENOSYS = 38


def _cachestat_pages(path: Path) -> int | None:
    """Pages of ``path`` in the page cache, or ``None`` where the kernel has no cachestat.

    Raises:
        OSError: the file cannot be opened, or cachestat refused it.
    """
    global _cachestat_nr
    if _cachestat_nr is None:
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        stat = _Cachestat()
        if _libc.syscall(ctypes.c_long(_cachestat_nr), ctypes.c_long(fd),
                         ctypes.byref(_CachestatRange(0, 0)), ctypes.byref(stat),
                         ctypes.c_long(0)) == 0:
            return int(stat.nr_cache)
        errno = ctypes.get_errno()
        if errno != _ENOSYS:
            raise OSError(errno, f"cachestat of {path} failed: {os.strerror(errno)}")
        _cachestat_nr = None
        return None
    finally:
        os.close(fd)


def missing_ranges(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of ``path`` not in the page cache, runs closer than 1 MiB merged."""
    vec = residency(path)
    size = os.stat(path).st_size
    absent = np.concatenate(([0], (np.frombuffer(vec, dtype=np.uint8) & 1) ^ 1, [0]))
    edges = np.flatnonzero(np.diff(absent.astype(np.int8)))
    out: list[tuple[int, int]] = []
    for first, last in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        start_b, end_b = first * _PAGE, min(last * _PAGE, size)
        if out and start_b - out[-1][1] <= _MERGE_GAP_BYTES:
            out[-1] = (out[-1][0], end_b)
        else:
            out.append((start_b, end_b))
    return out


def _chunks(ranges: Sequence[tuple[int, int]], chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, end)) for start, end in ranges for a in range(start, end, chunk)]


def prefetch(paths: Sequence[Path], *, workers: int = 4, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Read every non-resident page of ``paths`` into the page cache, files in order.

    Args:
        paths: the files, in the order their tensors are first used.
        workers: reads in flight at once.
        chunk_bytes: the size of each read.

    Returns:
        The bytes read from storage (0 when everything was resident).
    """
    jobs = [(p, a, b) for p in paths for a, b in _chunks(missing_ranges(p), chunk_bytes)]
    if not jobs:
        return 0
    fds = {p: os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths}
    buffers: dict[int, bytearray] = {}

    def read(job: tuple[Path, int, int]) -> int:
        path, start, end = job
        buf = buffers.setdefault(threading.get_ident(), bytearray(chunk_bytes))
        return os.preadv(fds[path], [memoryview(buf)[: end - start]], start)

    try:
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="ember-prefetch") as pool:
            return sum(pool.map(read, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


def populate(spans: Sequence[tuple[int, int]], *, workers: int = POPULATE_WORKERS,
             chunk_bytes: int = POPULATE_CHUNK_BYTES, sequential: bool = True) -> bool:
    """Map every page of each ``(address, length)`` span of this process's file mappings,
    reading the ones not in the page cache; ``False`` where the kernel cannot (before Linux
    5.14, or not Linux), and the caller then reads with :func:`prefetch` instead.

    Unlike :func:`prefetch`, nothing is copied: the kernel reads straight into the page
    cache and maps those pages into the spans, so the model's first forward takes no page
    faults and no throwaway buffer costs a memcpy per byte. Chunks go to ``workers``
    threads in span order; ctypes releases the GIL for each call. With ``sequential`` the
    spans are advised ``MADV_SEQUENTIAL`` while they are read (see :func:`_advise`), and
    ``MADV_NORMAL`` after; ``bench/page_reads.py`` turns it off to time the difference.

    Raises:
        OSError: the kernel could not bring a page in (an I/O error, a truncated file).
    """
    jobs = [(a, min(chunk_bytes, end - a)) for address, length in spans
            for end in [address + length] for a in range(address, end, chunk_bytes)]
    if sys.platform != "linux" or not jobs:
        return sys.platform == "linux"
    if sequential:
        _advise(spans, _MADV_SEQUENTIAL)
    try:
        if (errno := _populate_read(*jobs[0])) == _EINVAL:  # older than MADV_POPULATE_READ
            return False
        if not errno:
            with ThreadPoolExecutor(max(1, workers), thread_name_prefix="ember-populate") as p:
                errno = next((e for e in p.map(lambda j: _populate_read(*j), jobs[1:]) if e), 0)
    finally:
        # A sequential mapping's pages lose their recency when unmapped and go first under
        # memory pressure: right for one pass, wrong for weights read on every forward.
        if sequential:
            _advise(spans, _MADV_NORMAL)
    if errno:
        raise OSError(errno, f"MADV_POPULATE_READ failed: {os.strerror(errno)}")
    return True


def _advise(spans: Sequence[tuple[int, int]], advice: int) -> None:
    """``madvise`` each span (a hint: a failure changes nothing but the speed).

    ``MADV_SEQUENTIAL`` lets a populate fault read the mapping's whole readahead window
    ahead instead of around the page; with the file's ``POSIX_FADV_SEQUENTIAL``
    (:class:`ember.loaders._tensors.MappedFile`) the cold reads come in larger requests.
    ``bench/page_reads.py`` times populate with and without the hints against plain reads.
    """
    for address, length in spans:
        first = address & ~(_PAGE - 1)
        _libc.madvise(first, address + length - first, advice)


def _populate_read(address: int, length: int) -> int:
    """0, or the errno of this thread's failed call; on success the chunk is touched."""
    first = address & ~(_PAGE - 1)  # madvise wants a page-aligned start
    if int(_libc.madvise(first, address + length - first, _POPULATE_READ)) == 0:
        touch(first, address + length - first)
        return 0
    return ctypes.get_errno()


def touch(address: int, length: int) -> int:
    """Read one byte of every page of ``[address, address + length)``; the pages touched.

    A page the disk has just filled was written by the device, not by a CPU. In a virtual
    machine whose host backs guest memory lazily (free page reporting, ballooning, as in
    Firecracker), the first CPU access to such a page traps to the host: on the VM this
    project is developed on, a replica's first forward after a cold load took 3.6-6.6x a
    warm one, with no page faults (``bench/results/coldstart_sizes.run3.json``: 2 and 6 GB,
    ``first_forward_s`` on ``disk_cold`` against ``disk_warm``).
    Touching each chunk right after its read pays that in the populate workers, while the
    disk is still reading the next chunks; on bare metal it is one cache miss per page.
    numpy's reduction runs without the GIL, so the workers touch side by side.
    """
    pages = (length + _PAGE - 1) // _PAGE
    if pages:
        view = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))
        view[::_PAGE].sum(dtype=np.uint64)
    return pages


def evict(path: Path) -> None:
    """Drop ``path``'s clean pages that no process maps from the page cache."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def prefault(address: int, start: int, end: int) -> bool:
    """Allocate the pages of ``[address + start, address + end)`` in one call, without the
    GIL (ctypes releases it, ``mmap.madvise`` does not); ``False`` where the kernel cannot
    (before Linux 5.14, or not Linux), and the bytes then fault their pages in as they arrive.

    One call allocates a range's pages in a batch, cheaper than a fault per 4 KiB page
    inside the socket read, and each range-read thread does its own, beside the others.
    """
    if sys.platform != "linux" or end <= start:
        return False
    first = (address + start) & ~(_PAGE - 1)
    return int(_libc.madvise(first, address + end - first, _POPULATE_WRITE)) == 0


_PROT_WRITE = 0x2
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10


def remap_onto(buffer: mmap.mmap, path: Path) -> bool:
    """Put ``path``'s pages where ``buffer``'s anonymous ones are, at the same addresses, and
    map them in; ``False`` (nothing changed) where the file's size differs or the kernel
    refuses.

    A write-behind load builds its tensors on an anonymous buffer, and the node cache then
    holds the same bytes in its blob's page cache: two copies for the replica's life. Once
    the blob is published (its bytes verified equal to the buffer's), a ``MAP_FIXED``
    mapping of it over the buffer swaps the pages under every tensor at once, with no
    tensor or parameter changed; the kernel frees the anonymous pages. A forward reading
    meanwhile sees the same bytes from either. The mapping is private (a write to a
    weight copies its page, never reaching the blob), like a snapshot's restore.

    The caller keeps ``buffer`` open and referenced while this runs: a closed buffer's
    addresses may belong to another mapping by then. (The size and the file are checked
    first: what the kernel can still refuse then is memory for its own tables.)
    """
    if sys.platform != "linux" or buffer.closed:
        return False
    size = len(buffer)
    view = ctypes.c_char.from_buffer(buffer)  # an export: the buffer cannot close meanwhile
    try:
        address = ctypes.addressof(view)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != size:
                return False
            got = _libc.mmap(address, size, _PROT_READ | _PROT_WRITE,
                             _MAP_PRIVATE | _MAP_FIXED, fd, 0)
        finally:
            os.close(fd)
        if got != address:
            return False
        populate([(address, size)], sequential=False)  # page tables now, not in a forward
        return True
    finally:
        del view
