"""Pieces of ``bench/loaders.py``: the fresh-interpreter trial, test files, moto's ranges.

Children import ``ember.loaders`` alone (the package ``__init__`` pulls in the serving stack,
which is not what is measured) and time only the load plus touching every page.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
TENSOR_MB = 16

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


def run(mode: str, target: str, options: dict[str, Any]) -> dict[str, Any]:
    """Run one trial in a fresh interpreter; its JSON report."""
    out = subprocess.run([sys.executable, "-c", CHILD, mode, target, json.dumps(options)],
                         check=True, capture_output=True, text=True, timeout=600)
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


def median_s(runs: list[dict[str, Any]]) -> float:
    return float(statistics.median(r["seconds"] for r in runs))


def same_total(runs: list[dict[str, Any]]) -> None:
    """Every trial must have read the same tensors (same sum)."""
    totals = {round(r["total"], 1) for r in runs}
    if len(totals) != 1:
        raise RuntimeError(f"trials disagree on the tensor sums: {totals}")


def shim_ranges(server: Any) -> None:
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
            ("Content-Range", f"bytes {first}-{last}/{key.size}")])
        return [body]

    server._server.app = ranged
