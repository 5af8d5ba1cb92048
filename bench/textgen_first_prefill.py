"""A TextGen replica's first prefill and decode step against the next ones, and what the KV
slot table costs it: lazily backed (``_textgen_slots.lazy_zeros``) or zero-filled.

Each trial is a fresh process set up as a warm-runtime worker is (the backend's module
imported, ``control/torch_warm`` run, one torch thread), which loads the size ladder's
Llama through the loaders (``TransformersBackend.from_url``, as ``EMBER_TEXTGEN_MODEL``
gives a replica), allocates the table for TextGen's 16 slots, then times three rounds of
one prefill and one decode step, each with the wall and CPU seconds and the minor page
faults. Two questions, one run: does a first forward cost more than the next ones (it is
what a warm-up forward would save), and how many pages does the first prefill touch with
each table.

Usage:
    .venv/bin/python bench/textgen_first_prefill.py [--sizes 0.5gb 2gb] [--trials 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h

HERE = Path(__file__).resolve().parent
TABLES = ("lazy", "zero_filled")
PROMPTS = ("warm up", "def main():\n    ", "hello there")


def _child(folder: Path, table: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    import ember.control.torch_warm  # noqa: F401  # a warm-runtime worker ran it at start
    from ember.deployments import _textgen_slots as slots
    from ember.deployments._textgen_hf import TransformersBackend
    from ember.deployments.textgen import ENGINE

    if table == "zero_filled":  # the table as it was: torch.zeros, every page written
        slots._zeros_like = lambda like, *shape: like.new_zeros(*shape)
    backend = TransformersBackend.from_url(folder.as_uri() + "/")
    backend.allocate(ENGINE.max_num_seqs)

    def mark() -> tuple[float, float, int]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), time.thread_time(), usage.ru_minflt

    rounds = []
    for prompt in PROMPTS:
        a = mark()
        backend.prefill(0, backend.encode(prompt))
        b = mark()
        backend.decode([0], [32])
        c = mark()
        backend.free(0)
        rounds.append({"prefill_s": b[0] - a[0], "prefill_cpu_s": b[1] - a[1],
                       "prefill_faults": b[2] - a[2], "decode_s": c[0] - b[0],
                       "decode_faults": c[2] - b[2]})
    return {"table": table, "rounds": rounds}


def run_child(folder: Path, table: str, cache: Path) -> dict[str, Any]:
    env = {**os.environ, "EMBER_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(HERE)}
    done = subprocess.run([sys.executable, __file__, "--child", table, str(folder)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{table} trial failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over trials of the first round and of the later ones."""
    def med(key: str, first: bool) -> float:
        values = [r[key] for t in trials for r in (t["rounds"][:1] if first else t["rounds"][1:])]
        return round(statistics.median(values), 4)

    keys = ("prefill_s", "prefill_cpu_s", "prefill_faults", "decode_s")
    return {"first": {k: med(k, True) for k in keys}, "later": {k: med(k, False) for k in keys}}


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_child(Path(sys.argv[3]), sys.argv[2])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["0.5gb", "2gb"])
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()
    import textgen_sizes as sizes

    rows = []
    for size in args.sizes:
        folder = sizes.folder_for(size)
        cache = folder.parent.parent / "textgen-node-cache"
        run_child(folder, "lazy", cache)  # fills the node cache (untimed)
        trials: dict[str, list[dict[str, Any]]] = {t: [] for t in TABLES}
        for r in range(args.trials):
            for table in (TABLES if r % 2 == 0 else TABLES[::-1]):
                trials[table].append(run_child(folder, table, cache))
        for table in TABLES:
            row = {"size": size, "table": table, **summary(trials[table]),
                   "trials": trials[table]}
            rows.append(row)
            print(f"{size} {table}: first prefill {row['first']['prefill_s']:.3f} s "
                  f"({row['first']['prefill_faults']:.0f} faults), later "
                  f"{row['later']['prefill_s']:.3f} s; decode first "
                  f"{row['first']['decode_s']:.3f} s, later {row['later']['decode_s']:.3f} s",
                  flush=True)
    out = HERE / "results" / "textgen_first_prefill.json"
    out.write_text(json.dumps({"benchmark": "textgen_first_prefill", "trials": args.trials,
                               "rows": rows, "host": h.host_facts(False),
                               "complete": True}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
