"""The engine runs a ``transformers`` causal LM from a local directory, batched or not."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from ember.deployments._textgen_backend import TransformersBackend
from ember.deployments._textgen_engine import Engine, EngineConfig
from ember.deployments._textgen_sampling import SamplingParams

# Importing transformers alone takes a few seconds.
pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

PROMPTS = ["hello", "a", "the end of", "xyz"]
LENGTHS = [7, 12, 3, 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 and a character tokenizer, saved as a model directory would be."""
    vocab = {chr(i): i for i in range(32, 127)} | {"<eos>": 127}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=128, n_embd=32, n_layer=2,
                                     n_head=2, bos_token_id=None, eos_token_id=127)
    path = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


async def _generate(backend: TransformersBackend, max_num_seqs: int) -> list[list[int]]:
    engine = Engine(backend, EngineConfig(max_num_seqs=max_num_seqs))

    async def one(prompt: str, n: int) -> list[int]:
        params = SamplingParams(max_tokens=n, temperature=0)
        return [t async for c in engine.generate(backend.encode(prompt), params)
                for t in c.token_ids]

    outs = await asyncio.gather(*(one(p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)))
    await engine.close()
    return list(outs)


def test_a_local_transformers_model_batched_equals_its_own_greedy_generate(
        model_dir: Path) -> None:
    backend = TransformersBackend.from_directory(model_dir)
    backend.eos_token_id = None  # run every sequence to its length
    batched = asyncio.run(_generate(backend, 3))
    alone = asyncio.run(_generate(backend, 1))
    assert batched == alone and [len(t) for t in batched] == LENGTHS
    for prompt, n, got in zip(PROMPTS, LENGTHS, batched, strict=True):
        ids = torch.tensor([backend.encode(prompt)])
        want = backend.model.generate(ids, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False)[0, ids.shape[1]:].tolist()
        assert got == want


def test_missing_model_directory_is_not_downloaded(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        TransformersBackend.from_directory(tmp_path / "nothing-here")


def test_the_textgen_app_serves_the_model_ember_textgen_model_names(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.deployments.textgen import load_backend, served_model

    monkeypatch.setenv("EMBER_TEXTGEN_MODEL", str(model_dir))
    where, name = served_model()
    assert (where, name) == (str(model_dir), model_dir.name)
    assert isinstance(load_backend(where), TransformersBackend)
    monkeypatch.setenv("EMBER_TEXTGEN_MODEL", "hf://org/tiny@main")
    assert served_model() == ("hf://org/tiny@main", "org/tiny")
