"""MiniLM's forward pass alone, no server: what batching can buy at most on this CPU.

CPU time per text of MiniLM's forward in this process (one torch thread; the same code the
servers run: ``find_model_files``, ``Tokenizer``, ``build_model``, ``embed``) at b = 1, 4,
16, 64, after one untimed call per size. The ratio t(1)/t(b) is what batching saves with zero
serving cost, so t(1)/t(64) bounds the batched / unbatched throughput ratio of
``bench/throughput.py`` from above when each forward gets the same cores; in that bench the
batched replica runs one forward at a time while the unbatched one runs several at once, so
there the bound is t(1) / (t(64) * cores). No server, so no peer: the row to compare with
is b = 1, one text per forward pass.

Usage:
    .venv/bin/python bench/model_ceiling.py [--short] [--texts 256]
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import _batching_apps as apps
import _harness as h
import torch
from safetensors.torch import load_file

from ember.deployments._minilm import MiniLMConfig, Tokenizer, build_model, embed, find_model_files

BATCH_SIZES = (1, 4, 16, 64)


def per_item_cpu_ms(texts: int) -> dict[str, float]:
    """CPU milliseconds per text at each batch size, over about ``texts`` texts."""
    torch.set_num_threads(1)
    files = find_model_files()
    model = build_model(load_file(str(files.weights), device="cpu"),
                        MiniLMConfig.from_file(files.config))
    tokenizer = Tokenizer(files.tokenizer)
    out: dict[str, float] = {}
    for b in BATCH_SIZES:
        embed(model, tokenizer, apps.TEXTS[:b], batch_size=64)  # untimed: first call allocates
        reps = max(4, texts // b)
        started = time.process_time()
        for i in range(reps):
            first = (i * b) % (len(apps.TEXTS) - b)
            embed(model, tokenizer, apps.TEXTS[first:first + b], batch_size=64)
        out[str(b)] = (time.process_time() - started) / (reps * b) * 1000.0
        print(f"  b={b:<3} {out[str(b)]:.3f} ms CPU per text", flush=True)
    return out


def summary(per_item: dict[str, float]) -> dict[str, Any]:
    one, last = per_item[str(BATCH_SIZES[0])], per_item[str(BATCH_SIZES[-1])]
    cores = os.cpu_count() or 1
    return {"per_item_cpu_ms": per_item, "batching_gain": one / last, "cores": cores,
            "bound_batched_over_unbatched_bench_layout": one / last / cores}


def print_summary(doc: dict[str, Any]) -> None:
    per_item = doc["per_item_cpu_ms"]
    one = per_item[str(BATCH_SIZES[0])]
    h.print_table([["batch size", "CPU ms per text", "gain over b=1"]] + [
        [b, h.fmt(v), h.fmt_ratio(one, v)] for b, v in per_item.items()])
    print(f"batching gain t(1)/t(64) = {doc['batching_gain']:.2f}x with zero serving cost; "
          f"{doc['bound_batched_over_unbatched_bench_layout']:.2f}x in the throughput "
          f"bench's layout (one batched forward at a time vs unbatched forwards on "
          f"{doc['cores']} cores)")


def main() -> int:
    parser = h.parser(__doc__, deadline_s=600)
    parser.add_argument("--texts", type=int, help="texts timed per batch size (256; short 64)")
    args = h.pick(parser.parse_args(), texts=(256, 64))
    deadline = h.install_deadline(args.deadline_s)
    doc: dict[str, Any] = {"model": "all-MiniLM-L6-v2, forward alone, one torch thread"}
    errors: list[str] = []
    try:
        h.section("model", errors, lambda: doc.update(summary(per_item_cpu_ms(args.texts))))
        deadline.left()
    except h.DeadlineExceeded as exc:
        errors.append(f"DeadlineExceeded: {exc}")
    finally:
        h.clear_deadline()
    if "per_item_cpu_ms" in doc:
        print_summary(doc)
    doc.update(complete=not errors, errors=errors,
               config={"texts": args.texts, "batch_sizes": list(BATCH_SIZES),
                       "torch_threads": 1, "clock": "process CPU time"})
    h.write_results("model_ceiling", doc, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
