"""Train the small byte-level model that ``ember.deployments.textgen`` serves.

The corpus is text every Python installation carries: the licence (``LICENSE.txt`` under
``sys.base_prefix``) and the docstrings of a fixed list of standard-library modules. One CPU
thread, a fixed seed and a fixed number of steps (about five minutes here): deterministic by
construction on the same torch build, though no test retrains to check it. The result is a
0.8M-parameter model: it continues text in the style of Python's documentation and licence,
and is honest about being that small.

    python bench/train_textgen.py            # writes src/ember/deployments/textgen_model/
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ember.deployments._tinylm import BOS, EOS, TinyLM, TinyLMConfig

OUT = Path(__file__).resolve().parents[1] / "src/ember/deployments/textgen_model"
MODULES = (
    "abc", "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fnmatch",
    "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "html", "http.client",
    "inspect", "io", "itertools", "json", "logging", "math", "operator", "os", "pathlib",
    "pprint", "queue", "random", "re", "sched", "secrets", "selectors", "shutil", "socket",
    "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "time", "traceback", "types", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "weakref", "zipfile",
)


def corpus() -> list[str]:
    """The licence and every docstring of the listed modules and their public members."""
    docs = [(Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}."
             f"{sys.version_info.minor}" / "LICENSE.txt").read_text()]
    for name in MODULES:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module) or "")
        for attr in sorted(vars(module)):
            member = getattr(module, attr)
            if attr.startswith("_") or getattr(member, "__module__", None) != name:
                continue
            doc = inspect.getdoc(member)
            if doc:
                docs.append(f"{attr}\n{doc}")
    return [d for d in docs if len(d) > 40]


def token_stream(docs: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for doc in docs:
        ids += [BOS, *doc.encode("utf-8"), EOS]
    return torch.tensor(ids, dtype=torch.long)


def train(steps: int, batch: int, lr: float, seed: int) -> tuple[TinyLM, dict[str, float]]:
    torch.manual_seed(seed)
    config = TinyLMConfig()
    data = token_stream(corpus())
    model = TinyLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    ctx = config.train_context
    started, loss_value = time.monotonic(), math.nan
    for step in range(steps):
        # Cosine decay after a short warm-up.
        scale = min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr * max(scale, 0.05)
        starts = torch.randint(0, len(data) - ctx - 1, (batch,))
        window = torch.stack([data[s:s + ctx + 1] for s in starts.tolist()])
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = float(loss.detach())
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step} loss {loss_value:.3f} ({time.monotonic() - started:.0f} s)",
                  flush=True)
    return model, {"final_loss": round(loss_value, 4), "corpus_bytes": float(len(data)),
                   "train_s": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, stats = train(args.steps, args.batch, args.lr, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(args.out / "model.safetensors"))
    config = {**model.config.model_dump(), "training": {**stats, "steps": args.steps,
                                                         "batch": args.batch, "seed": args.seed}}
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
