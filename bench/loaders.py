"""The weights path against its peers: warm node-cache load and cold load from S3.

Each trial runs in a fresh interpreter and touches every page (a sum over every tensor):

* warm node-cache load (``ember.loaders`` streaming a memory-mapped hit) of a generated
  safetensors file against ``safetensors.torch.load_file`` on the same cached blob;
* cold load from moto's S3 server on loopback (``ember.loaders``, empty node cache, 8 MiB
  ranges, 8 at a time) against one whole-object s3fs read of the same object;
* the time until the first tensor is available on the cold load, and the share of bytes
  that had arrived by then.

moto builds every GET response from the whole object and then slices it for a Range
request, so one ranged GET costs as much as reading the object (S3 itself serves a range in
proportion to its length). The bench therefore serves ranged GETs of plain objects straight
from moto's stored bytes (``_weights_child.shim_ranges``); ``--moto-native-ranges`` turns that
off. Trials alternate Ember and the peer; medians reported.

Usage:
    .venv/bin/python bench/loaders.py [--short] [--size-mb 1024] [--s3-size-mb 512] [--trials 3]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import _harness as h
import _weights_child as child


def bench_warm(work: Path, size_mb: int, trials: int) -> dict[str, Any]:
    """Warm node-cache hit vs ``safetensors.torch.load_file`` on the same cached blob."""
    from ember.loaders import resolve

    path = work / "warm.safetensors"
    child.generate(path, size_mb)
    options = {"cache_dir": str(work / "node"), "min_free_bytes": 0}
    blob = resolve(path.as_uri(), config=options).paths[0].resolve()
    ours, peer = [], []
    for _ in range(trials):
        ours.append(child.run("ember", path.as_uri(), options))
        peer.append(child.run("load_file", str(blob), {}))
    child.same_total(ours + peer)
    return {"ember_s": child.median_s(ours), "peer_s": child.median_s(peer),
            "peer": "safetensors.torch.load_file", "size_mb": size_mb,
            "raw": {"ember": ours, "peer": peer}}


def bench_cold(work: Path, size_mb: int, trials: int, native: bool) -> dict[str, Any]:
    """Cold load from moto S3 (empty node cache) vs one whole-object s3fs read."""
    import s3fs
    from moto.server import ThreadedMotoServer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address=h.HOST, port=0, verbose=False)
    server.start()
    try:
        if not native:
            child.shim_ranges(server)
        host, port = server.get_host_and_port()
        s3 = {"key": "testing", "secret": "testing",
              "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
        fs = s3fs.S3FileSystem(**s3)
        fs.mkdir("bench")
        path = work / "cold.safetensors"
        child.generate(path, size_mb)
        fs.put_file(str(path), "bench/cold.safetensors")
        path.unlink()
        ours, peer = [], []
        for trial in range(trials):
            cache = work / f"cold-node-{trial}"
            options = {"cache_dir": str(cache), "min_free_bytes": 0, "storage_options": s3,
                       "range_bytes": 8 << 20, "max_concurrency": 8}
            ours.append(child.run("ember", "s3://bench/cold.safetensors", options))
            shutil.rmtree(cache)
            peer.append(child.run("s3fs", "bench/cold.safetensors", s3))
        child.same_total(ours + peer)
    finally:
        server.stop()
    return {"ember_s": child.median_s(ours), "peer_s": child.median_s(peer),
            "peer": "s3fs whole-object read", "size_mb": size_mb,
            "first_tensor_s": statistics.median(r["first"][0] for r in ours),
            "first_tensor_bytes_share": statistics.median(r["first"][1] for r in ours),
            "moto_ranges": "native" if native else "shimmed (O(range))",
            "raw": {"ember": ours, "peer": peer}}


def print_summary(warm: dict[str, Any] | None, cold: dict[str, Any] | None) -> None:
    lines = [["measurement", "Ember [s]", "peer [s]", "Ember / peer", "peer"]]
    for label, row in (("warm load (node-cache hit)", warm),
                       ("cold load from S3 (moto, loopback)", cold)):
        if row:
            lines.append([f"{label}, {row['size_mb']} MB", h.fmt(row["ember_s"]),
                          h.fmt(row["peer_s"]), h.fmt_ratio(row["ember_s"], row["peer_s"]),
                          row["peer"]])
    if cold:
        lines.append([f"first tensor ready ({cold['first_tensor_bytes_share']:.1%} of bytes)",
                      h.fmt(cold["first_tensor_s"]), h.fmt(cold["ember_s"]),
                      h.fmt_ratio(cold["first_tensor_s"], cold["ember_s"]),
                      "Ember's full cold load"])
    print()
    h.print_table(lines)


def main() -> int:
    parser = h.parser(__doc__, deadline_s=900)
    parser.add_argument("--size-mb", type=int, help="warm-load file size (1024; short 128)")
    parser.add_argument("--s3-size-mb", type=int, help="cold S3 object size (512; short 64)")
    parser.add_argument("--trials", type=int, help="trials per side (3; short 1)")
    parser.add_argument("--moto-native-ranges", action="store_true",
                        help="use moto's own (whole-object) Range handling")
    args = h.pick(parser.parse_args(), size_mb=(1024, 128), s3_size_mb=(512, 64),
                  trials=(3, 1))
    deadline = h.install_deadline(args.deadline_s)
    found: dict[str, Any] = {}
    errors: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
            h.section("warm", errors, lambda: found.update(
                warm=bench_warm(Path(tmp), args.size_mb, args.trials)))
            deadline.left()
            h.section("cold", errors, lambda: found.update(cold=bench_cold(
                Path(tmp), args.s3_size_mb, args.trials, args.moto_native_ranges)))
    except h.DeadlineExceeded as exc:
        errors.append(f"DeadlineExceeded: {exc}")
    finally:
        h.clear_deadline()
    print_summary(found.get("warm"), found.get("cold"))
    h.write_results("loaders", {
        "complete": not errors, "errors": errors, **found,
        "config": {"size_mb": args.size_mb, "s3_size_mb": args.s3_size_mb,
                   "trials": args.trials, "tensor_mb": child.TENSOR_MB,
                   "fresh_process_per_trial": True, "every_page_touched": True},
    }, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
