"""Benchmark the weights path against its peers; prints a table and exits 0.

Each trial runs in a fresh subprocess and touches every page (a sum over every tensor):

* warm node-cache load (``ember.loaders.load``, a memory-mapped hit) of a generated
  safetensors file against ``safetensors.torch.load_file`` on the same file (target: no
  slower);
* cold load from moto's S3 server on loopback (``ember.loaders.load``, empty node cache)
  against one whole-object s3fs read of the same object (target: no slower);
* the time until the first tensor is available on the cold load, and the share of bytes
  that had arrived by then (target: under 20%).

moto builds every GET response from the whole object and then slices it for a Range
request, so one ranged GET costs as much as reading the object (S3 itself serves a range
in proportion to its length). The bench therefore serves ranged GETs of plain objects
straight from moto's stored bytes; ``--moto-native-ranges`` turns that off.

Usage:
    python bench/loaders_bench.py [--size-mb 1024] [--s3-size-mb 512] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
TENSOR_MB = 16

# Children import ember.loaders alone (the package __init__ pulls in the serving stack,
# which is not what is measured) and time only the load plus the page touching.
CHILD = f"""
import json, sys, time, types
pkg = types.ModuleType("ember"); pkg.__path__ = [{str(SRC / "ember")!r}]
sys.modules["ember"] = pkg
import torch, safetensors.torch, s3fs
from ember.loaders import LoaderConfig, load, stream
mode, target, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

def touch(tensors):
    return sum(float(t.sum()) for t in tensors)

def views(data):
    # Zero-copy tensors over the bytes s3fs returned, so the baseline copies nothing extra.
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    flat = torch.frombuffer(bytearray(0) if not data else memoryview(data), dtype=torch.uint8)
    return [flat[8 + n + a : 8 + n + b].view(torch.float32) for a, b in
            (h["data_offsets"] for h in header.values())]

first = None
start = time.perf_counter()
if mode == "ember":
    cfg = LoaderConfig(**options)
    seen = [0, 1]
    def progress(done, total):
        seen[:] = [done, total]
    out = []
    for name, tensor in stream(target, config=cfg, progress=progress):
        if first is None:
            first = (time.perf_counter() - start, seen[0] / seen[1])
        out.append(tensor)
    total = touch(out)
elif mode == "load_file":
    total = touch(safetensors.torch.load_file(target).values())
elif mode == "s3fs":
    fs = s3fs.S3FileSystem(**options)
    total = touch(views(fs.cat_file(target)))
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "first": first, "total": total}}))
"""


def child(mode: str, target: str, options: dict[str, Any]) -> dict[str, Any]:
    """Run one trial in a fresh interpreter and return its JSON report."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, target, json.dumps(options)],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def generate(path: Path, size_mb: int) -> None:
    """Write ``size_mb`` of float32 tensors, 16 MiB each, with safetensors itself."""
    import safetensors.torch
    import torch

    count = max(1, size_mb // TENSOR_MB)
    elems = TENSOR_MB * (1 << 20) // 4
    gen = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i:03d}.weight": torch.rand(elems, generator=gen) for i in range(count)}
    safetensors.torch.save_file(tensors, str(path))


def _shim_ranges(server: Any) -> None:
    """Serve ranged GETs of plain objects from moto's stored bytes in O(range)."""
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    app = server._server.app
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]

    def ranged(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", environ.get("HTTP_RANGE", ""))
        path = environ.get("PATH_INFO", "").lstrip("/")
        if environ["REQUEST_METHOD"] != "GET" or not match or environ.get("QUERY_STRING"):
            return app(environ, start_response)  # type: ignore[no-any-return]
        bucket, _, name = path.partition("/")
        key = backend.get_object(bucket, name)
        if key is None or environ.get("HTTP_IF_MATCH", key.etag) != key.etag:
            return app(environ, start_response)  # type: ignore[no-any-return]
        first, last = int(match.group(1)), min(int(match.group(2)), key.size - 1)
        with key.lock:
            key._value_buffer.seek(first)
            body = key._value_buffer.read(last - first + 1)
        start_response("206 Partial Content", [
            ("Content-Length", str(len(body))), ("ETag", key.etag),
            ("Content-Range", f"bytes {first}-{last}/{key.size}"),
        ])  # fmt: skip
        return [body]

    server._server.app = ranged


def median(runs: list[dict[str, Any]]) -> float:
    return statistics.median(r["seconds"] for r in runs)


def bench_warm(work: Path, size_mb: int, trials: int) -> list[tuple[str, float, float]]:
    """Warm node-cache hit vs safetensors.torch.load_file on the same cached blob."""
    from ember.loaders import resolve

    path = work / "warm.safetensors"
    generate(path, size_mb)
    options = {"cache_dir": str(work / "node"), "min_free_bytes": 0}
    blob = resolve(path.as_uri(), config=options).paths[0].resolve()
    ours, peer = [], []
    for _ in range(trials):
        ours.append(child("ember", path.as_uri(), options))
        peer.append(child("load_file", str(blob), {}))
    _same_total(ours + peer)
    return [("warm load (node-cache hit)", median(ours), median(peer))]


def bench_cold(
    work: Path, size_mb: int, trials: int, native: bool
) -> list[tuple[str, float, float]]:
    """Cold load from moto S3 (empty node cache) vs one whole-object s3fs read."""
    from moto.server import ThreadedMotoServer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        if not native:
            _shim_ranges(server)
        host, port = server.get_host_and_port()
        s3 = {"key": "testing", "secret": "testing",
              "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}  # fmt: skip
        import s3fs

        fs = s3fs.S3FileSystem(**s3)
        fs.mkdir("bench")
        path = work / "cold.safetensors"
        generate(path, size_mb)
        fs.put_file(str(path), "bench/cold.safetensors")
        path.unlink()
        ours, peer = [], []
        for trial in range(trials):
            cache = work / f"cold-node-{trial}"
            options = {"cache_dir": str(cache), "min_free_bytes": 0, "storage_options": s3,
                       "range_bytes": 8 << 20, "max_concurrency": 8}  # fmt: skip
            ours.append(child("ember", "s3://bench/cold.safetensors", options))
            shutil.rmtree(cache)
            peer.append(child("s3fs", "bench/cold.safetensors", s3))
        _same_total(ours + peer)
    finally:
        server.stop()
    first = statistics.median(r["first"][0] for r in ours)
    share = statistics.median(r["first"][1] for r in ours)
    return [
        ("cold load from S3 (moto, loopback)", median(ours), median(peer)),
        (f"first tensor ready ({share:.1%} of bytes in)", first, median(ours)),
    ]


def _same_total(runs: list[dict[str, Any]]) -> None:
    totals = {round(r["total"], 1) for r in runs}
    if len(totals) != 1:
        raise SystemExit(f"trials disagree on the tensor sums: {totals}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="warm-load file size")
    parser.add_argument("--s3-size-mb", type=int, default=512, help="cold S3 object size")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--moto-native-ranges", action="store_true",
                        help="use moto's own (whole-object) Range handling")  # fmt: skip
    args = parser.parse_args(argv)
    sys.path.insert(0, str(SRC))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        rows = bench_warm(Path(tmp), args.size_mb, args.trials)
        rows += bench_cold(Path(tmp), args.s3_size_mb, args.trials, args.moto_native_ranges)
    print(f"\n{'measurement':<44}{'ember s':>10}{'peer s':>10}{'ratio':>8}  peer")
    peers = ["safetensors.torch.load_file", "s3fs whole-object read", "ember full cold load"]
    for (label, ours, peer), name in zip(rows, peers, strict=True):
        print(f"{label:<44}{ours:>10.3f}{peer:>10.3f}{ours / peer:>8.2f}  {name}")
    print(f"(median of {args.trials} trials, fresh process each; "
          f"{args.size_mb} MB warm, {args.s3_size_mb} MB cold; "
          f"{time.perf_counter() - started:.0f} s total)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
