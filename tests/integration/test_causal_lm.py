"""The smallest ladder model served through a real cluster: one forward pass per request,
the same answer as ``from_pretrained``, loaded from the node cache without a copy."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import httpx
import pytest
import torch

from ember.deployments.causal_lm import causal_lm_app, next_token

from serving import ServeApp

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        ladder = importlib.import_module("model_ladder")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    folder: Path = ladder.write_checkpoint(ladder.LADDER["tiny"],
                                           tmp_path_factory.mktemp("ladder") / "tiny")
    return folder


def test_the_tiny_ladder_model_answers_like_from_pretrained(
    serve_app: ServeApp, tiny: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny), local_files_only=True,
                                                     dtype=torch.bfloat16)
    app = causal_lm_app(tiny.as_uri(), name="causal-lm-tiny", num_cpus=0.25,
                        loader_options={"cache_dir": str(tmp_path / "node")})
    with serve_app(app, ready_timeout_s=180) as base:
        for n, ids in enumerate(([1, 2, 3], [9, 400, 17, 3, 88]), start=1):
            reply = httpx.post(f"{base}/lm", json=ids, timeout=180)
            assert reply.status_code == 200, reply.text
            body = reply.json()
            assert body["next_token"] == next_token(reference, ids)
            # No warm-up forward before ready: the first request's forward is the first
            # (a warm-up pass would double the forward on the cold path).
            assert body["forwards"] == n, body["forwards"]
        assert body["load"]["weights_bytes"] == sum(
            p.stat().st_size for p in tiny.glob("*.safetensors"))
        bad = httpx.post(f"{base}/lm", json={"not": "ids"}, timeout=60)
        assert bad.status_code in (400, 422), bad.text
    assert list((tmp_path / "node").glob("*/blobs/*")), "not loaded through the node cache"
