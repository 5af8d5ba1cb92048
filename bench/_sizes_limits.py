"""The machine's own limits for bench/coldstart_sizes.py, measured on the bench's files.

* cold sequential read: every file's pages dropped (``POSIX_FADV_DONTNEED``, checked with
  ``mincore``), then plain ``pread`` of 16 MiB chunks, one reader and four; the faster counts;
* page cache: the same reads once every page is resident;
* S3 ceiling: a plain boto3 client, N parallel ranged GETs of 8 MiB over the same objects;
* memory at first use: anonymous pages allocated (``MADV_POPULATE_WRITE``) at rest and just
  after the same amount was freed (:func:`first_use`).

Every timed load, and the cold read, first waits the same time for the memory freed before
it (:func:`settle`). The VM this is developed on returns free guest memory to its host (the
balloon's free page reporting, in 2 MiB blocks, a pass every 2 s), and the first use of a
returned page traps to the host: a page freed a moment ago is reused at the cost of zeroing
it, one returned costs several times more (``first_use`` records both). A load timed right
after the one before it freed its model would reuse that memory and look faster than one
timed after a wait, so the order of the contenders would decide between them. How much the
VM hands back within the wait varies with its state; the wait makes the conditions the same
for every contender, and ``first_use`` records what a run met.

The S3-protocol server is moto on loopback in a process of its own, with ranged GETs of
plain objects served from its stored bytes in O(range) (``_weights_child.shim_ranges``):
moto's own Range handling reads the whole object for every range.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ember.loaders._reader import anonymous_buffer, buffer_address
from ember.loaders.pages import evict, prefault, resident_bytes

CHUNK = 16 << 20
S3_RANGE = 8 << 20
#: The wait before a timed load. The kernel hands free memory back in passes 2 s apart, a
#: bounded share of it per pass, so the wait grows with what was freed. Each run's
#: ``memory_first_use`` allocates 1 GiB after this wait that follows freeing as much, and
#: again right after a free: the two differ when the wait did its work.
SETTLE_BASE_S = 4.0
SETTLE_S_PER_GB = 1.0


def settle(freed_bytes: int) -> float:
    """Give the host time to take back the memory freed before (about ``freed_bytes``);
    the seconds waited."""
    wait = SETTLE_BASE_S + SETTLE_S_PER_GB * freed_bytes / 1e9
    time.sleep(wait)
    return wait


def first_use(nbytes: int = 1 << 30) -> dict[str, Any]:
    """GB/s of allocating ``nbytes`` of anonymous memory after :func:`settle` and just after
    freeing as much: what a load pays per byte for its memory before any byte is read.
    Allocated and freed once first, so the wait is measured after a free, as in the runs."""
    def allocate() -> float:
        buffer = anonymous_buffer(nbytes)
        start = time.perf_counter()
        prefault(buffer_address(buffer), 0, nbytes)
        seconds = time.perf_counter() - start
        buffer.close()
        return seconds

    allocate()  # freed at once, as the load before a timed one leaves its memory
    settle(nbytes)
    rest = allocate()
    again = allocate()
    return {"bytes": nbytes, "at_rest_gbps": round(nbytes / rest / 1e9, 3),
            "just_freed_gbps": round(nbytes / again / 1e9, 3),
            "call": "MADV_POPULATE_WRITE, one thread"}


def drop(paths: Sequence[Path]) -> int:
    """Evict ``paths`` from the page cache; the bytes still resident afterwards."""
    for path in paths:
        evict(path)
    return sum(resident_bytes(p) for p in paths)


def _read_all(paths: Sequence[Path], workers: int) -> tuple[int, float]:
    jobs = [(p, a) for p in paths for a in range(0, p.stat().st_size, CHUNK)]

    def read(job: tuple[Path, int]) -> int:
        path, offset = job
        fd = os.open(path, os.O_RDONLY)
        try:
            return len(os.pread(fd, CHUNK, offset))
        finally:
            os.close(fd)

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        total = sum(pool.map(read, jobs))
    return total, time.perf_counter() - start


def disk_bandwidth(paths: Sequence[Path]) -> dict[str, Any]:
    """Cold sequential read of ``paths`` (1 and 4 readers); GB/s of the faster."""
    out: dict[str, Any] = {}
    for workers in (1, 4):
        left = drop(paths)
        settle(sum(p.stat().st_size for p in paths))
        nbytes, seconds = _read_all(paths, workers)
        out[f"readers_{workers}"] = {"bytes": nbytes, "s": round(seconds, 4),
                                     "gbps": round(nbytes / seconds / 1e9, 3),
                                     "resident_after_drop_bytes": left}
    out["gbps"] = max(v["gbps"] for v in out.values())
    return out


def pagecache_bandwidth(paths: Sequence[Path]) -> dict[str, Any]:
    """Reads of ``paths`` with every page resident (1 and 2 readers); GB/s of the faster."""
    _read_all(paths, 4)
    out: dict[str, Any] = {}
    for workers in (1, 2):
        nbytes, seconds = _read_all(paths, workers)
        out[f"readers_{workers}"] = {"bytes": nbytes, "s": round(seconds, 4),
                                     "gbps": round(nbytes / seconds / 1e9, 3)}
    out["gbps"] = max(v["gbps"] for v in out.values())
    return out


SERVER = """
import sys, time
sys.path.insert(0, {bench!r})
from moto.server import ThreadedMotoServer
import _weights_child
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
_weights_child.shim_ranges(server)
host, port = server.get_host_and_port()
print(f"http://{{host}}:{{port}}", flush=True)
sys.stdin.read()
"""


def start_s3() -> tuple[subprocess.Popen[str], str]:
    """moto on loopback in its own process; its endpoint URL."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    code = SERVER.format(bench=str(Path(__file__).resolve().parent))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
    assert proc.stdout is not None
    endpoint = proc.stdout.readline().strip()
    if not endpoint.startswith("http://"):
        proc.kill()
        raise RuntimeError("the S3 server did not start")
    return proc, endpoint


def s3_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1",
                        config=Config(max_pool_connections=32))


def upload(endpoint: str, bucket: str, prefix: str, folder: Path) -> str:
    """Put every file of ``folder`` under ``s3://bucket/prefix/``; returns that URL."""
    from boto3.s3.transfer import TransferConfig

    client = s3_client(endpoint)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    config = TransferConfig(multipart_threshold=1 << 40)  # one plain object per file
    for path in sorted(folder.iterdir()):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.name}", Config=config)
    return f"s3://{bucket}/{prefix}/"


def s3_ceiling(endpoint: str, bucket: str, keys: Sequence[tuple[str, int]],
               parallel: int = 8) -> dict[str, Any]:
    """N parallel 8 MiB ranged GETs over ``keys`` (name, size) with a plain boto3 client."""
    client = s3_client(endpoint)
    jobs = [(k, a, min(a + S3_RANGE, size)) for k, size in keys for a in range(0, size, S3_RANGE)]

    def get(job: tuple[str, int, int]) -> int:
        key, start, end = job
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        return len(body["Body"].read())

    start = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        total = sum(pool.map(get, jobs))
    seconds = time.perf_counter() - start
    return {"bytes": total, "s": round(seconds, 4), "parallel": parallel,
            "range_bytes": S3_RANGE, "gbps": round(total / seconds / 1e9, 3),
            "client": "boto3 get_object, parallel ranges"}
