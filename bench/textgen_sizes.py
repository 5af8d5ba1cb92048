"""Generation at model size from a fresh process: load to first token, Ember's loader against
``from_pretrained``, the same ladder Llama, the same engine, in one run.

Each trial is a fresh Python process that imports torch, transformers and Ember first (not
timed: both contenders pay the same), then times from the backend's construction until the
generation engine yields the first token of a short prompt (``ttft_s``), and until the
eighth (``eight_s``). The contenders build the same ``TransformersBackend``:

* **Ember**: ``TransformersBackend.from_url(file://<folder>/)``, what ``EMBER_TEXTGEN_MODEL``
  set to a weights URL gives a replica: mapped from the node cache (filled once, untimed,
  before the trials), built on ``meta``, the tokenizer read beside the weights;
* **from_pretrained**: ``TransformersBackend.from_directory(<folder>)``, what a plain
  ``transformers`` user writes (``AutoModelForCausalLM.from_pretrained``, bf16 as saved).

Paths: ``disk_warm`` (every file either contender reads is in the page cache) and
``disk_cold`` (evicted with ``posix_fadvise(DONTNEED)`` before each trial). Before every
trial the memory the last one freed gets the same wait (``_sizes_limits.settle``). Rounds
alternate the order. One torch thread each, as a one-CPU replica runs. The folder is the
size ladder's rung (``model_ladder.ensure``) with hard links to its files and a tokenizer
that names every id beside them (:func:`ladder_tokenizer`), so both read the very same
inodes' bytes.

Usage:
    .venv/bin/python bench/textgen_sizes.py [--sizes 0.5gb 2gb] [--rounds 5] [--short] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CONTENDERS = ("ember", "from_pretrained")
PROMPT = "def main():\n    "
TOKENS = 8


def _child(contender: str, folder: Path) -> dict[str, Any]:
    """One trial in this fresh process (``--child``)."""
    import torch

    torch.set_num_threads(1)
    from ember.deployments._textgen_engine import Engine, EngineConfig
    from ember.deployments._textgen_hf import TransformersBackend
    from ember.deployments._textgen_sampling import SamplingParams

    start = time.perf_counter()
    backend = (TransformersBackend.from_url(folder.as_uri() + "/") if contender == "ember"
               else TransformersBackend.from_directory(folder))
    loaded = time.perf_counter()
    backend.eos_token_id = None
    marks: list[float] = []

    async def run() -> list[int]:
        engine = Engine(backend, EngineConfig(max_num_seqs=1))
        params = SamplingParams(max_tokens=TOKENS, temperature=0)
        tokens = []
        async for chunk in engine.generate(backend.encode(PROMPT), params):
            tokens += chunk.token_ids
            marks.extend(time.perf_counter() for _ in chunk.token_ids)
        await engine.close()
        return tokens

    tokens = asyncio.run(run())
    param = next(backend.model.parameters())
    report = getattr(backend, "load_report", None)
    return {"contender": contender, "load_s": loaded - start, "ttft_s": marks[0] - start,
            "eight_s": marks[-1] - start, "tokens": tokens, "dtype": str(param.dtype),
            "restored": bool(report.restored) if report else None,
            "load_phases_s": dict(report.phases_s) if report else None}


def ladder_tokenizer(vocab: int) -> Any:
    """One token per printable character (ids 32-126), an end-of-sequence token at 127, and a
    name of its own for every other id (``<5000>``), so that any token a random model picks
    decodes to text that a stream carries."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = {chr(i): i for i in range(32, 127)} | {"<eos>": 127}
    pieces |= {f"<{i}>": i for i in [*range(32), *range(128, vocab)]}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=pieces, unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def folder_for(size: str) -> Path:
    """The rung's files hard-linked beside a tokenizer (the same inodes as the ladder's)."""
    import model_ladder

    rung = model_ladder.ensure(size)
    folder = rung.parent.parent / "textgen" / size
    folder.mkdir(parents=True, exist_ok=True)
    for path in rung.iterdir():
        link = folder / path.name
        if path.is_file() and not link.exists():
            os.link(path, link)
    vocab = int(json.loads((rung / "config.json").read_text())["vocab_size"])
    ladder_tokenizer(vocab).save_pretrained(folder)  # the same bytes every time
    return folder


def run_child(contender: str, folder: Path, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--child", contender, str(folder)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{contender} trial failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def files_read(folder: Path, cache: Path) -> list[Path]:
    """Every large file either contender reads: the rung's shards, the node cache's blobs."""
    return [*folder.glob("*.safetensors"), *(p for p in cache.rglob("blobs/*") if p.is_file())]


def measure(size: str, rounds: int) -> list[dict[str, Any]]:
    import _sizes_limits as limits

    folder = folder_for(size)
    cache = folder.parent.parent / "textgen-node-cache"
    env = {**os.environ, "EMBER_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(HERE)}
    run_child("ember", folder, env)  # fills the node cache and writes the snapshot record
    nbytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    rows = []
    for path in ("disk_warm", "disk_cold"):
        trials: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
        for r in range(rounds):
            for contender in (CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]):
                files = files_read(folder, cache)
                if path == "disk_cold":
                    limits.drop(files)
                else:
                    limits.pagecache_bandwidth(files)  # reads every file: all resident
                limits.settle(nbytes)
                trials[contender].append(run_child(contender, folder, env))
        rows.append(_row(size, path, nbytes, trials))
    return rows


def _row(size: str, path: str, nbytes: int,
         trials: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = {c: {k: round(statistics.median(t[k] for t in trials[c]), 4)
               for k in ("load_s", "ttft_s", "eight_s")} for c in CONTENDERS}
    same = all(t["tokens"] == trials["ember"][0]["tokens"] for c in CONTENDERS
               for t in trials[c])
    return {"size": size, "size_gb": round(nbytes / 1e9, 3), "path": path, "medians": med,
            "ttft_ratio_peer_over_ember": round(med["from_pretrained"]["ttft_s"]
                                                / med["ember"]["ttft_s"], 3),
            "same_tokens": same, "dtypes": sorted({t["dtype"] for c in CONTENDERS
                                                   for t in trials[c]}),
            "trials": trials}


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], Path(sys.argv[3]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["0.5gb", "2gb"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--short", action="store_true", help="0.5gb, two rounds")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write (default bench/results/textgen_sizes[.short].json)")
    args = parser.parse_args()
    sizes, rounds = (["0.5gb"], 2) if args.short else (args.sizes, args.rounds)
    rows = [row for size in sizes for row in measure(size, rounds)]
    for row in rows:
        e, p = row["medians"]["ember"], row["medians"]["from_pretrained"]
        print(f"{row['size']:>6} {row['path']:<10} ttft ember {e['ttft_s']:.2f} s, "
              f"from_pretrained {p['ttft_s']:.2f} s: {row['ttft_ratio_peer_over_ember']:.2f}x "
              f"(same tokens: {row['same_tokens']})")
    name = "textgen_sizes.short.json" if args.short else "textgen_sizes.json"
    out = {"benchmark": "textgen_sizes", "rows": rows, "rounds": rounds,
           "host": h.host_facts(args.short), "complete": True}
    path = args.out or RESULTS / name
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
