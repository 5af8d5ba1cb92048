"""A tiny seeded Llama with a character tokenizer, LoRA adapters over it as peft saves them,
and peft's own greedy ``generate()`` as the reference: for the unit and the live LoRA tests.

Imports transformers and peft when called, so a test module that lacks them can skip first.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch


def _module(name: str) -> Any:
    """``transformers``, ``peft`` or ``tokenizers``, untyped (their stubs are partial)."""
    return importlib.import_module(name)


def tokenizer() -> Any:
    """One token per printable character, an end-of-sequence token at 127."""
    tokenizers = _module("tokenizers")
    transformers = _module("transformers")

    vocab = {chr(i): i for i in range(32, 127)} | {"<eos>": 127}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def llama(hidden: int = 64) -> Any:
    """A random two-layer Llama, weights drawn wide so greedy tokens vary."""
    transformers = _module("transformers")

    config = transformers.LlamaConfig(
        vocab_size=128, bos_token_id=None, eos_token_id=127, hidden_size=hidden,
        intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)
    return transformers.AutoModelForCausalLM.from_config(config)


def adapter(base: Any, path: Path, seed: int, targets: list[str]) -> Path:
    """A LoRA adapter over ``base`` with random non-zero A and B, saved as peft saves one."""
    peft = _module("peft")

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets,
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # wide enough that the adapter changes the greedy tokens
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


def model_dirs(root: Path) -> dict[str, Path]:
    """The base model directory and three adapters: two over it, one over another base."""
    transformers = _module("transformers")

    torch.manual_seed(0)
    llama().save_pretrained(root / "base")
    tokenizer().save_pretrained(root / "base")
    load = transformers.AutoModelForCausalLM.from_pretrained
    return {
        "base": root / "base",
        "a": adapter(load(root / "base"), root / "a", 1, ["q_proj", "v_proj"]),
        "b": adapter(load(root / "base"), root / "b", 2,
                     ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"]),
        "other": adapter(llama(hidden=32), root / "other", 3, ["q_proj", "v_proj"]),
    }


def reference(dirs: dict[str, Path], name: str | None, prompt: str, n: int) -> list[int]:
    """Greedy tokens of ``generate()``: the base's, or peft's over it with adapter ``name``."""
    peft = _module("peft")
    transformers = _module("transformers")

    model = transformers.AutoModelForCausalLM.from_pretrained(dirs["base"]).eval()
    if name is not None:
        model = peft.PeftModel.from_pretrained(model, dirs[name]).eval()
    ids = torch.tensor([[ord(c) for c in prompt]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=127)
    return [int(t) for t in out[0, ids.shape[1]:]]
