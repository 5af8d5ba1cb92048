"""A fresh node's first load of a ladder model from a ``file://`` origin: sealed behind the
load (``cache_write="auto"``) against waiting for the seal (``"through"``, the old way) and
against ``from_pretrained`` on the same folder (what a plain Ray Serve user writes; it fills
no cache).

Each trial is a fresh process that runs ``load_causal_lm`` on one ladder rung
(``bench/model_ladder.py``) into an empty node cache, with the origin's pages dropped from
the page cache first. Both ways read the origin, write the node cache's temp file and hash
every byte before the load returns; ``through`` also waits for the fsync, the marker and
the snapshot link, which ``auto`` leaves to a background thread. ``load_s`` is the load's
wall time, ``sealed_s`` the time until every file is published (``auto``: the load plus
``wait_for_cache_writes``). Each round also reads the same files cold with plain readers
(``_sizes_limits.disk_bandwidth``): ``disk_read_s`` is the bytes at that speed, the floor
for any load of them from this disk.

``from_pretrained`` runs in a fresh process of its own the same way (imports before the
clock, the folder's pages dropped), bf16, ``local_files_only``; it publishes nothing, so
its ``sealed_s`` is its ``load_s``.

Trials alternate the three ways, ``--rounds`` times; the medians and their ratio go to
``bench/results/first_fill[.short].json``.

Usage:
    .venv/bin/python bench/first_fill.py [--short] [--size 2gb] [--rounds 3]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import _harness as h
import _sizes_limits as lim
import model_ladder

WAYS = ("auto", "through", "from_pretrained")
KEYS = ("load_s", "sealed_s")
CHILD = """
import json, sys, time
from ember.deployments.causal_lm import load_causal_lm
from ember.loaders import wait_for_cache_writes
start = time.perf_counter()
model, report = load_causal_lm(sys.argv[1], config={"cache_dir": sys.argv[2],
                                                    "cache_write": sys.argv[3]})
load_s = time.perf_counter() - start
assert wait_for_cache_writes(timeout_s=600)
print(json.dumps({"load_s": load_s, "sealed_s": time.perf_counter() - start,
                  "phases_s": report.phases_s}), flush=True)
"""
PEER = """
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16,
                                             local_files_only=True)
load_s = time.perf_counter() - start
print(json.dumps({"load_s": load_s, "sealed_s": load_s}), flush=True)
"""


def one(way: str, folder: Path, deadline: h.Deadline) -> dict[str, Any]:
    """One fresh process's first load into an empty node cache, the origin's pages dropped."""
    if lim.drop(sorted(folder.glob("*.safetensors"))):
        raise RuntimeError("pages stayed resident after the drop")
    cache = Path(tempfile.mkdtemp(prefix="ember-first-fill-"))
    try:
        argv = ([textwrap.dedent(PEER), str(folder)] if way == "from_pretrained" else
                [textwrap.dedent(CHILD), folder.as_uri(), str(cache), way])
        out = subprocess.run(
            [sys.executable, "-c", *argv],
            capture_output=True, text=True, check=True, timeout=deadline.left(),
        )
        got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return got
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> int:
    parser = h.parser(__doc__, deadline_s=900)
    parser.add_argument("--size", help="ladder rung (2gb; short 0.5gb)")
    parser.add_argument("--rounds", type=int, help="rounds of the three ways (3; short 2)")
    args = h.pick(parser.parse_args(), size=("2gb", "0.5gb"), rounds=(3, 2))
    deadline = h.install_deadline(args.deadline_s)
    folder = model_ladder.ensure(args.size)
    files = sorted(folder.glob("*.safetensors"))
    nbytes = sum(p.stat().st_size for p in files)
    trials: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    disk_s: list[float] = []
    for i in range(args.rounds):
        for way in WAYS:
            trials[way].append(one(way, folder, deadline))
        disk_s.append(round(nbytes / lim.disk_bandwidth(files)["gbps"] / 1e9, 3))
        print(f"round {i}: " + ", ".join(
            f"{w} load {trials[w][-1]['load_s']:.2f} s, sealed {trials[w][-1]['sealed_s']:.2f} s"
            for w in WAYS) + f", disk read {disk_s[-1]:.2f} s", flush=True)
    h.clear_deadline()
    medians = {way: {k: round(statistics.median(t[k] for t in trials[way]), 3) for k in KEYS}
               for way in WAYS}
    disk_read_s = statistics.median(disk_s)
    out: dict[str, Any] = {
        "size": args.size, "bytes": nbytes, "trials": trials, "median_s": medians,
        "disk_read_s": disk_s, "median_disk_read_s": disk_read_s,
        "ratios": {
            "load_auto_over_disk_read": h.ratio(medians["auto"]["load_s"], disk_read_s),
            "load_through_over_auto": h.ratio(medians["through"]["load_s"],
                                              medians["auto"]["load_s"]),
            "load_from_pretrained_over_auto": h.ratio(medians["from_pretrained"]["load_s"],
                                                      medians["auto"]["load_s"]),
            "sealed_auto_over_through": h.ratio(medians["auto"]["sealed_s"],
                                                medians["through"]["sealed_s"]),
        },
    }
    print(out["median_s"], out["ratios"], flush=True)
    h.write_results("first_fill", out, short=args.short)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
