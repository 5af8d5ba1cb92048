"""A generation model in S3 (moto on loopback): weights, config and tokenizer come through the
loaders' S3 source, and the engine generates what ``from_pretrained`` of the same folder does."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from ember.loaders import LoaderConfig

from harness import s3_options

transformers = pytest.importorskip("transformers")
_hf = pytest.importorskip("ember.deployments._textgen_hf")

PROMPTS = ["hello", "0123456789 abc"]


def _saved_model(folder: Path) -> Path:
    import lora_models

    torch.manual_seed(0)
    lora_models.llama().save_pretrained(folder)
    lora_models.tokenizer().save_pretrained(folder)
    return folder


async def _greedy(backend: Any) -> list[list[int]]:
    from ember.deployments._textgen_engine import Engine, EngineConfig
    from ember.deployments._textgen_sampling import SamplingParams

    backend.eos_token_id = None
    engine = Engine(backend, EngineConfig(max_num_seqs=2))
    params = SamplingParams(max_tokens=8, temperature=0)
    outs = [[t async for c in engine.generate(backend.encode(p), params) for t in c.token_ids]
            for p in PROMPTS]
    await engine.close()
    return outs


def test_a_model_in_s3_generates_through_the_loaders(s3: Any, s3_endpoint: str,
                                                     tmp_path: Path) -> None:
    folder = _saved_model(tmp_path / "model")
    for path in folder.iterdir():
        s3.put(str(path), f"{s3.bucket}/models/tiny/{path.name}")
    config = LoaderConfig(cache_dir=tmp_path / "node", storage_options=s3_options(s3_endpoint),
                          min_free_bytes=0)
    got = _hf.TransformersBackend.from_url(f"s3://{s3.bucket}/models/tiny/", config=config)
    want = _hf.TransformersBackend.from_directory(folder)
    assert asyncio.run(_greedy(got)) == asyncio.run(_greedy(want))
    assert got.tokenizer("hi")["input_ids"] == want.tokenizer("hi")["input_ids"]
    report = got.load_report
    assert report is not None and report.weights_bytes == (folder / "model.safetensors").stat(
        ).st_size
    # The weights went through the node cache (its blobs hold them now), not around it.
    blobs = [p for p in (tmp_path / "node").rglob("blobs/*") if p.is_file()]
    assert sum(p.stat().st_size for p in blobs) >= report.weights_bytes
