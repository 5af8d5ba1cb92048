"""LoRA adapters: tokens/s of batches mixing adapters against the base alone, same requests.

One seeded random Llama (4 layers, hidden 256, a character vocabulary; written once under
``~/.cache/ember-bench/lora``) and three LoRA adapters over it (rank 8 on the attention
projections), served by the generation engine (``max_num_seqs=16``) in this process on one
torch thread, as a ``num_cpus=1`` replica. 16 closed-loop clients send the same requests
(seeded lengths 16-64 tokens, EOS ignored) in four modes:

* ``base``: no adapter loaded; the plain model;
* ``base_with_adapters``: the three adapters loaded, every request to the base (peft's
  layers are in the model, each row skips them);
* ``one_adapter``: every request to one adapter;
* ``mixed``: requests cycle base, a1, a2, a3: each decode step mixes four kinds of rows,
  run in one forward (peft's mixed-batch ``adapter_names``).

Then a forward-level comparison of the two ways to run a mixed batch: one forward with an
adapter name per row (what the engine does: peft's mixed-batch layers) against one forward
per adapter group with that adapter active (``set_adapter``), 16 rows of 64 tokens in four
groups.

Usage:
    .venv/bin/python bench/lora.py [--short] [--requests 48] [--rounds 3]
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h
import torch

from ember.deployments._textgen_engine import Engine, EngineConfig
from ember.deployments._textgen_hf import TransformersBackend
from ember.deployments._textgen_lora import fetch
from ember.deployments._textgen_sampling import SamplingParams

ROOT = Path.home() / ".cache" / "ember-bench" / "lora"
ADAPTERS = ("a1", "a2", "a3")
PROMPTS = ("Return the", "The socket module", "If the file", "Copyright (c)", "class Path")
MODES: dict[str, tuple[str | None, ...]] = {
    "base": (None,), "base_with_adapters": (None,), "one_adapter": ("a1",),
    "mixed": (None, *ADAPTERS),
}


def build_models() -> None:
    """The base and the adapters, once (seeded: the same files every time)."""
    import peft
    import tokenizers
    import transformers

    if (ROOT / ADAPTERS[-1] / "adapter_config.json").exists():
        return
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, bos_token_id=None, eos_token_id=127, hidden_size=256,
        intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=512)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(ROOT / "base")
    vocab = {chr(i): i for i in range(32, 127)} | {"<eos>": 127}  # a character vocabulary
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>"
                                         ).save_pretrained(ROOT / "base")
    for seed, name in enumerate(ADAPTERS, start=1):
        torch.manual_seed(seed)
        base = transformers.AutoModelForCausalLM.from_pretrained(ROOT / "base")
        lora = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        peft.get_peft_model(base, lora).save_pretrained(ROOT / name)


def backend(with_adapters: bool) -> TransformersBackend:
    out = TransformersBackend.from_directory(ROOT / "base")
    out.eos_token_id = None  # forced lengths
    for name in ADAPTERS if with_adapters else ():
        out.lora.add(name, fetch((ROOT / name).as_uri()))
    return out


async def run_mode(mode: str, work: list[tuple[str, int]], concurrency: int) -> dict[str, Any]:
    model = backend(with_adapters=mode != "base")
    engine = Engine(model, EngineConfig(max_num_seqs=16, max_waiting_seqs=len(work)))
    kinds = MODES[mode]
    queue = [(i, p, n) for i, (p, n) in enumerate(work)]
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        while queue:
            i, prompt, length = queue.pop(0)
            params = SamplingParams(max_tokens=length, temperature=0, ignore_eos=True)
            async for chunk in engine.generate(model.encode(prompt), params,
                                               adapter=kinds[i % len(kinds)]):
                tokens += len(chunk.token_ids)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    took = time.perf_counter() - started
    await engine.close()
    return {"mode": mode, "tokens": tokens, "seconds": took, "tokens_per_s": tokens / took,
            "steps": engine.steps}


@torch.inference_mode()
def forward_ways(repeats: int) -> dict[str, float]:
    """Seconds per mixed 16x64 forward: one with adapter_names, or one per adapter group."""
    model = backend(with_adapters=True)
    peft_model = model.lora.peft
    ids = torch.randint(32, 127, (16, 64))
    names = [(None, *ADAPTERS)[i % 4] or "__base__" for i in range(16)]
    groups = {n: [i for i, m in enumerate(names) if m == n] for n in dict.fromkeys(names)}

    def mixed() -> None:  # as the engine runs a mixed step
        with model.lora.rows([None if n == "__base__" else n for n in names]) as m:
            m(input_ids=ids)

    def grouped() -> None:
        for name, rows in groups.items():
            if name == "__base__":
                with peft_model.disable_adapter():
                    peft_model(input_ids=ids[rows])
            else:
                peft_model.set_adapter(name)
                peft_model(input_ids=ids[rows])

    out = {}
    for label, fn in (("one_forward_adapter_names_s", mixed),
                      ("forward_per_group_s", grouped)):
        fn()  # warm
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[label] = (time.perf_counter() - started) / repeats
    return out


def main() -> int:
    parser = h.parser(__doc__, deadline_s=540)
    parser.add_argument("--requests", type=int, help="requests per mode and round (48; short 32)")
    parser.add_argument("--rounds", type=int, help="rounds of every mode (3; short 1)")
    parser.add_argument("--concurrency", type=int, default=16)
    args = h.pick(parser.parse_args(), requests=(48, 32), rounds=(3, 1))
    torch.set_num_threads(1)
    build_models()
    rng = random.Random(0)
    work = [(rng.choice(PROMPTS), rng.choice((16, 32, 48, 64))) for _ in range(args.requests)]
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    forward: dict[str, float] = {}
    errors: list[str] = []
    with h.deadline_run(args.deadline_s, errors):
        for r in range(args.rounds):  # modes alternate, so a neighbour's burst hits all
            for mode in MODES:
                def one(m: str = mode, i: int = r) -> None:
                    result = asyncio.run(run_mode(m, work, args.concurrency))
                    rounds[m].append(result)
                    print(f"{m} #{i}: {result['tokens_per_s']:.0f} tokens/s", flush=True)
                h.section(f"{mode} #{r}", errors, one)
        h.section("forward", errors, lambda: forward.update(forward_ways(3 if args.short
                                                                         else 10)))
    tps = {m: h.median_or_none([x["tokens_per_s"] for x in rs]) for m, rs in rounds.items()}
    ratios = {f"{m}_over_base_tokens_per_s": h.ratio(tps[m], tps["base"])
              for m in MODES if m != "base"}
    # Each round's modes ran back to back: their ratio is less exposed to a neighbour's load
    # than the ratio of medians taken at different times.
    for m in MODES:
        if m != "base":
            ratios[f"{m}_over_base_paired_median"] = h.median_or_none([
                h.ratio(x["tokens_per_s"], b["tokens_per_s"])
                for x, b in zip(rounds[m], rounds["base"], strict=False)])
    ratios["forward_per_group_over_one_forward_s"] = h.ratio(
        forward.get("forward_per_group_s"), forward.get("one_forward_adapter_names_s"))
    h.print_table([["mode", "tokens/s (median)"],
                   *[[m, h.fmt(v, ".0f")] for m, v in tps.items()]])
    for key, value in ratios.items():
        print(f"{key}: {h.fmt(value, '.2f')}")
    h.write_results("lora", {
        "complete": not errors, "errors": errors, "ratios": ratios, "tokens_per_s": tps,
        "forward": forward, "rounds": rounds,
        "config": {"requests": args.requests, "rounds": args.rounds,
                   "concurrency": args.concurrency, "max_num_seqs": 16, "torch_threads": 1,
                   "model": "llama 4x256, char vocab", "adapters": "3 x rank 8 on q,k,v,o"},
    }, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
