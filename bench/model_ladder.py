"""A ladder of Llama-architecture causal LMs (0.5, 2 and 6 GB of bf16) for cold-start benches.

Each rung is a ``transformers.LlamaConfig`` with seeded random weights, written the way
``save_pretrained(max_shard_size=...)`` writes a sharded checkpoint: ``config.json``,
``model-0000i-of-0000n.safetensors`` shards filled in module order, and
``model.safetensors.index.json`` (``metadata.total_size`` and a sorted ``weight_map``).
Every tensor is generated and written on its own, so the 6 GB rung needs one tensor's
memory (at most a few hundred MB), never the model's; each shard's bytes are those
``safetensors.torch.save_file(..., metadata={"format": "pt"})`` writes (a unit test
compares them). The same seed gives the same bytes; ``--verify`` rebuilds a rung in a
temporary folder and compares the hashes.

Rungs are cached under ``~/.cache/ember-bench/ladder/<size>/`` (``EMBER_BENCH_LADDER``
overrides the root) and reused when their ``ladder.json`` stamp matches.

Usage:
    .venv/bin/python bench/model_ladder.py [0.5gb 2gb 6gb] [--verify]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import sys
import tempfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

#: Bumped whenever the bytes a rung's spec produces change.
FORMAT_VERSION = 1
INDEX_NAME = "model.safetensors.index.json"
STAMP_NAME = "ladder.json"
_INIT_STD = 0.02


@dataclass(frozen=True)
class Rung:
    """One model size: the Llama shape and the shard cap."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int = 32000
    max_shard_bytes: int = 1 << 30

    def config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.heads, max_position_embeddings=2048,
            tie_word_embeddings=False, dtype="bfloat16", architectures=["LlamaForCausalLM"],
        )


LADDER: dict[str, Rung] = {
    # For tests: a few MB, three shards.
    "tiny": Rung(hidden=64, intermediate=128, layers=2, heads=4, vocab=512,
                 max_shard_bytes=200_000),
    "0.5gb": Rung(hidden=1024, intermediate=2816, layers=14, heads=16, max_shard_bytes=200 << 20),
    "2gb": Rung(hidden=2048, intermediate=5632, layers=17, heads=32),
    "6gb": Rung(hidden=3072, intermediate=8192, layers=25, heads=24),
}


def ladder_root() -> Path:
    """Where rungs are cached: ``EMBER_BENCH_LADDER`` or ``~/.cache/ember-bench/ladder``."""
    env = os.environ.get("EMBER_BENCH_LADDER")
    return Path(env) if env else Path.home() / ".cache" / "ember-bench" / "ladder"


def param_shapes(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes in module order, from a model built on the meta device."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()]


def tensor_for(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The tensor ``name`` gets: norms are ones, everything else N(0, 0.02), seeded by name."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=gen) * _INIT_STD).to(torch.bfloat16)


def plan_shards(shapes: list[tuple[str, tuple[int, ...]]], cap: int) -> list[list[str]]:
    """Fill shards in module order up to ``cap`` bytes (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = 2 * _numel(shape)
        if shards[-1] and size + nbytes > cap:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out


def shard_header(names: list[str], shapes: dict[str, tuple[int, ...]]) -> tuple[bytes, list[str]]:
    """The safetensors header bytes (length prefix included) and the tensors' data order."""
    order = sorted(names)  # safetensors orders tensors of one dtype by name
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        end = offset + 2 * _numel(shapes[name])
        doc[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, order


def write_shard(path: Path, names: list[str], shapes: dict[str, tuple[int, ...]],
                seed: int) -> int:
    """Write one shard tensor by tensor; returns its data bytes."""
    header, order = shard_header(names, shapes)
    total = 0
    with open(path, "wb") as f:
        f.write(header)
        for name in order:
            data = tensor_for(name, shapes[name], seed)
            f.write(data.view(torch.uint8).numpy().tobytes())
            total += data.numel() * 2
            del data
    return total


def write_checkpoint(rung: Rung, folder: Path, seed: int = 0) -> Path:
    """Write ``rung`` into ``folder`` (config, shards, index, stamp); returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = rung.config()
    config.save_pretrained(folder)
    shapes_list = param_shapes(config)
    shapes = dict(shapes_list)
    plan = plan_shards(shapes_list, rung.max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(plan, start=1):
        shard = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        total += write_shard(folder / shard, names, shapes, seed)
        weight_map.update(dict.fromkeys(names, shard))
    meta = {"total_parameters": total // 2, "total_size": total}
    index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    stamp = {"format": FORMAT_VERSION, "seed": seed, "rung": asdict(rung),
             "total_bytes": total, "sha256": folder_digest(folder)}
    (folder / STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")
    return folder


def folder_digest(folder: Path) -> str:
    """One sha256 over every shard and the index, in name order."""
    digest = hashlib.sha256()
    for path in [*sorted(folder.glob("*.safetensors")), folder / INDEX_NAME]:
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def stamp_of(folder: Path) -> dict[str, Any] | None:
    """The rung's stamp, or ``None`` when it is missing or unreadable."""
    try:
        doc = json.loads((folder / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def ensure(size: str, seed: int = 0, root: Path | None = None) -> Path:
    """The cached folder of rung ``size``, written first when missing or stale."""
    rung = LADDER[size]
    folder = (root or ladder_root()) / size
    want = {"format": FORMAT_VERSION, "seed": seed, "rung": asdict(rung)}
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One writer at a time: test sessions and benchmarks may run side by side, and a second
    # writer's replace would delete the files the first one's readers have open.
    with open(folder.with_name(f".{size}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = stamp_of(folder)
        if stamp is not None and all(stamp.get(k) == v for k, v in want.items()):
            return folder
        tmp = folder.with_name(f".{size}.tmp-{os.getpid()}")
        write_checkpoint(rung, tmp, seed)
        if folder.exists():
            for old in folder.iterdir():
                old.unlink()
            folder.rmdir()
        tmp.rename(folder)  # a killed build leaves a temp folder, never a half-written rung
    return folder


def total_bytes(folder: Path) -> int:
    """The weights' bytes as the index states them."""
    return int(json.loads((folder / INDEX_NAME).read_text())["metadata"]["total_size"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sizes", nargs="*", default=["0.5gb", "2gb", "6gb"],
                        choices=sorted(LADDER))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify", action="store_true",
                        help="rebuild each rung in a temp folder and compare hashes")
    args = parser.parse_args()
    for size in args.sizes:
        folder = ensure(size, args.seed)
        stamp = stamp_of(folder) or {}
        print(f"{size}: {folder} {stamp.get('total_bytes', 0) / 1e9:.2f} GB "
              f"sha256={stamp.get('sha256', '')[:16]}", flush=True)
        if args.verify:
            with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
                again = folder_digest(write_checkpoint(LADDER[size], Path(tmp) / size, args.seed))
            same = again == stamp.get("sha256")
            print(f"  rebuilt: sha256={again[:16]} identical={same}", flush=True)
            if not same:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
