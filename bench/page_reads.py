"""How fast a cold model's pages come in, by the way they are read: the causal-LM load's
``populate`` (``MADV_POPULATE_READ`` on a mapping) at two settings and without its sequential
advice, against plain ``pread`` and ``O_DIRECT`` reads into private buffers.

On one ladder rung's safetensors files (``bench/model_ladder.py``), every page dropped from
the page cache before each trial (``POSIX_FADV_DONTNEED``, checked with ``mincore``):

* ``populate_4x64mib`` / ``populate_8x32mib``: the files mapped copy-on-write as a replica
  maps them, then ``ember.loaders.pages.populate`` with four calls of 64 MiB in flight (the
  earlier setting) or eight of 32 MiB (the default now), file and mapping advised
  sequential as a replica's are; ``populate_8x32mib_unhinted`` the same without the advice
  (the loader before it);
* ``pread_4``: four plain readers of 16 MiB chunks into fresh buffers (the disk limit that
  ``bench/coldstart_sizes.py`` measures);
* ``pread_4_then_populate``: the pages read into the page cache by four plain readers
  (``prefetch``, through one reused buffer each), then the mapping populated as above;
* ``populate_8x32mib_huge``: as ``populate_8x32mib``, the mappings advised ``MADV_HUGEPAGE``
  instead of sequential, so the kernel reads the pages into 2 MiB folios and maps each with
  one page-table entry; ``populate_8x32mib_huge_seq`` with the sequential advice as well;
* ``stream_1x32mib`` / ``stream_per_file_32mib``: the default's mapping and advice, but each
  file populated in order by one worker (32 MiB a call), one worker for all files or one per
  file: the kernel's readahead grows its folios to 2 MiB on a file read in order, which the
  default's eight workers, interleaved over one file, never let it do;
* ``direct_8x16mib``: each file read with ``O_DIRECT`` into a private anonymous buffer,
  eight 16 MiB reads in flight, each chunk's pages allocated before its read and touched
  after it, as ``populate`` touches its chunks (fastsafetensors' CPU reads use ``O_DIRECT`` too).

Trials alternate the ways, ``--rounds`` times; GB/s per trial and the median of each way go
to ``bench/results/page_reads[.short].json``. After each trial that leaves the pages in the
page cache, a fresh mapping of the files is populated (``remap_gbps``): what the next replica
on the node pays to map the same, now resident, pages, which depends on the size of the
folios the cold read left in the page cache (``file_pmd_mapped_bytes``: how much of it one
2 MiB entry each could map). With ``--at-rest`` every trial lets the
memory its drop freed come to rest before it reads (``_sizes_limits.settle``: on a VM that
hands freed memory back to its host, a read right after the drop reuses that memory for
less) and the results go to ``page_reads_at_rest[.short].json``; ``pread_4`` always reads
at rest, as the ladder's limit does.

Usage:
    .venv/bin/python bench/page_reads.py [--short] [--size 2gb] [--rounds 4] [--at-rest]
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _harness as h
import _sizes_limits as lim
import model_ladder
import torch

from ember.loaders._reader import anonymous_buffer, buffer_address
from ember.loaders.pages import populate, prefault, prefetch, touch

WAYS = ("populate_4x64mib", "populate_8x32mib", "populate_8x32mib_unhinted",
        "populate_8x32mib_huge", "populate_8x32mib_huge_seq", "pread_4", "direct_8x16mib",
        "pread_4_then_populate", "stream_1x32mib", "stream_per_file_32mib")
SETTINGS = {"populate_4x64mib": (4, 64 << 20), "populate_8x32mib": (8, 32 << 20)}


def cold(files: list[Path], at_rest: bool) -> None:
    """Drop ``files`` from the page cache; with ``at_rest``, wait until the memory the drop
    freed is at rest (after the drop: a read right after it would reuse that memory)."""
    if lim.drop(files):
        raise RuntimeError("pages stayed resident after the drop")
    if at_rest:
        lim.settle(sum(p.stat().st_size for p in files))


def _map(files: list[Path], *, sequential: bool, huge: bool) -> list[torch.Tensor]:
    flats = []
    for path in files:
        with path.open("rb") as f:
            if sequential:  # as MappedFile maps a blob
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            if huge:
                buffer.madvise(mmap.MADV_HUGEPAGE)
            flats.append(torch.frombuffer(buffer, dtype=torch.uint8))
    return flats


def file_pmd_mapped_bytes() -> int:
    """This process's file pages mapped 2 MiB at a time (``FilePmdMapped``)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("FilePmdMapped:"):
            return int(line.split()[1]) * 1024
    return 0


def remap(files: list[Path]) -> tuple[float, int]:
    """GB/s of populating a fresh mapping of the resident ``files`` (the next replica's
    mapping), and the bytes of it mapped 2 MiB at a time."""
    start = time.perf_counter()
    flats = _map(files, sequential=False, huge=False)
    if not populate([(t.data_ptr(), t.numel()) for t in flats], sequential=False):
        raise RuntimeError("this kernel has no MADV_POPULATE_READ")
    seconds = time.perf_counter() - start
    pmd = file_pmd_mapped_bytes()
    del flats
    return sum(p.stat().st_size for p in files) / seconds / 1e9, pmd


def populate_gbps(files: list[Path], workers: int, chunk_bytes: int,
                  at_rest: bool = False, read_first: bool = False,
                  sequential: bool = True, huge: bool = False,
                  per_span: bool = False) -> float:
    """GB/s of mapping ``files`` and populating every page, from a cold page cache; with
    ``read_first``, the pages are first read into the page cache by four plain readers
    (``ember.loaders.pages.prefetch``), so that populate only maps them; without
    ``sequential``, neither the files nor the mappings are advised sequential; with
    ``huge``, the mappings are advised ``MADV_HUGEPAGE``; with ``per_span``, each file
    is populated in order by one of ``workers``."""
    cold(files, at_rest)
    start = time.perf_counter()
    if read_first:
        prefetch(files, workers=4)
    flats = _map(files, sequential=sequential, huge=huge)
    spans = [(t.data_ptr(), t.numel()) for t in flats]
    if per_span:  # one worker per file, each reading its file in order
        with ThreadPoolExecutor(workers) as pool:
            done = all(pool.map(lambda span: populate([span], workers=1, chunk_bytes=chunk_bytes,
                                                      sequential=sequential), spans))
    else:
        done = populate(spans, workers=workers, chunk_bytes=chunk_bytes, sequential=sequential)
    if not done:
        raise RuntimeError("this kernel has no MADV_POPULATE_READ")
    seconds = time.perf_counter() - start
    return sum(t.numel() for t in flats) / seconds / 1e9


def direct_gbps(files: list[Path], at_rest: bool = False, workers: int = 8,
                chunk_bytes: int = 16 << 20) -> float:
    """GB/s of reading ``files`` with ``O_DIRECT`` into private buffers, from a cold page
    cache; each chunk's pages allocated before its read and touched after it."""
    cold(files, at_rest)
    start = time.perf_counter()
    buffers = []
    total = 0
    for path in files:
        size = path.stat().st_size
        span = (size + 4095) & ~4095  # O_DIRECT reads whole blocks
        buffer = anonymous_buffer(span)
        address = buffer_address(buffer)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)

        def read(offset: int, fd: int = fd, buffer: mmap.mmap = buffer,
                 address: int = address, span: int = span) -> int:
            end = min(offset + chunk_bytes, span)
            prefault(address, offset, end)
            with memoryview(buffer)[offset:end] as view:
                got = os.preadv(fd, [view], offset)
            touch(address + offset, end - offset)
            return got

        try:
            with ThreadPoolExecutor(workers) as pool:
                total += sum(pool.map(read, range(0, span, chunk_bytes)))
        finally:
            os.close(fd)
        buffers.append(buffer)
    seconds = time.perf_counter() - start
    for buffer in buffers:
        buffer.close()
    return total / seconds / 1e9


def one(way: str, files: list[Path], at_rest: bool) -> float:
    if way == "pread_4":  # drops, and lets the memory come to rest, itself
        return float(lim.disk_bandwidth(files)["readers_4"]["gbps"])
    if way == "direct_8x16mib":
        return direct_gbps(files, at_rest)
    if way == "populate_8x32mib_unhinted":
        return populate_gbps(files, *SETTINGS["populate_8x32mib"], at_rest=at_rest,
                             sequential=False)
    if way.startswith("populate_8x32mib_huge"):
        return populate_gbps(files, *SETTINGS["populate_8x32mib"], at_rest=at_rest,
                             huge=True, sequential=way.endswith("_seq"))
    if way.startswith("stream_"):  # each file read in order by one worker, 32 MiB a call
        workers = 1 if way == "stream_1x32mib" else len(files)
        return populate_gbps(files, workers, 32 << 20, at_rest=at_rest, per_span=True)
    if way == "pread_4_then_populate":
        return populate_gbps(files, *SETTINGS["populate_8x32mib"], at_rest=at_rest,
                             read_first=True)
    return populate_gbps(files, *SETTINGS[way], at_rest=at_rest)


def main() -> int:
    parser = h.parser(__doc__, deadline_s=900)
    parser.add_argument("--size", help="ladder rung (2gb; short 0.5gb)")
    parser.add_argument("--rounds", type=int, help="rounds of the ways (4; short 2)")
    parser.add_argument("--at-rest", action="store_true",
                        help="let freed memory come to rest before every trial")
    args = h.pick(parser.parse_args(), size=("2gb", "0.5gb"), rounds=(4, 2))
    h.install_deadline(args.deadline_s)
    files = sorted(model_ladder.ensure(args.size).glob("*.safetensors"))
    trials: dict[str, list[float]] = {way: [] for way in WAYS}
    remaps: dict[str, list[float]] = {way: [] for way in WAYS if way != "direct_8x16mib"}
    pmd: dict[str, list[int]] = {way: [] for way in remaps}
    for i in range(args.rounds):
        for way in WAYS:
            trials[way].append(round(one(way, files, args.at_rest), 3))
            if way in remaps:  # O_DIRECT leaves nothing in the page cache to map
                gbps, pmd_bytes = remap(files)
                remaps[way].append(round(gbps, 3))
                pmd[way].append(pmd_bytes)
        print(f"round {i}: " + ", ".join(f"{w} {trials[w][-1]} GB/s" for w in WAYS), flush=True)
        print("  remapped: " + ", ".join(f"{w} {v[-1]} GB/s" for w, v in remaps.items()),
              flush=True)
    h.clear_deadline()
    medians = {way: statistics.median(v) for way, v in trials.items()}
    remap_medians = {way: statistics.median(v) for way, v in remaps.items()}
    out: dict[str, Any] = {
        "size": args.size, "bytes": sum(p.stat().st_size for p in files),
        "gbps": trials, "median_gbps": medians,
        "remap_gbps": remaps, "remap_median_gbps": remap_medians,
        "file_pmd_mapped_bytes": pmd,
        "ratios": {"populate_8x32mib_over_4x64mib": h.ratio(medians["populate_8x32mib"],
                                                             medians["populate_4x64mib"]),
                   "populate_8x32mib_over_pread_4": h.ratio(medians["populate_8x32mib"],
                                                            medians["pread_4"]),
                   "populate_8x32mib_over_direct_8x16mib": h.ratio(
                       medians["populate_8x32mib"], medians["direct_8x16mib"]),
                   "populate_8x32mib_over_unhinted": h.ratio(
                       medians["populate_8x32mib"], medians["populate_8x32mib_unhinted"]),
                   "pread_4_then_populate_over_populate_8x32mib": h.ratio(
                       medians["pread_4_then_populate"], medians["populate_8x32mib"]),
                   "populate_8x32mib_huge_over_populate_8x32mib": h.ratio(
                       medians["populate_8x32mib_huge"], medians["populate_8x32mib"]),
                   "remap_after_huge_over_remap_after_populate_8x32mib": h.ratio(
                       remap_medians["populate_8x32mib_huge"],
                       remap_medians["populate_8x32mib"]),
                   # LoaderConfig.huge_pages: the sequential advice kept, MADV_HUGEPAGE added.
                   "populate_8x32mib_huge_seq_over_populate_8x32mib": h.ratio(
                       medians["populate_8x32mib_huge_seq"], medians["populate_8x32mib"]),
                   "remap_after_huge_seq_over_remap_after_populate_8x32mib": h.ratio(
                       remap_medians["populate_8x32mib_huge_seq"],
                       remap_medians["populate_8x32mib"])},
        "at_rest": args.at_rest,
    }
    print(out["ratios"], flush=True)
    h.write_results("page_reads_at_rest" if args.at_rest else "page_reads", out,
                    short=args.short)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
