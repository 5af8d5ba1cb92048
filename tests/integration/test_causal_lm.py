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


@pytest.mark.slow
def test_a_replica_stopped_right_after_a_fresh_fill_leaves_it_published(
    serve_app: ServeApp, tmp_path: Path
) -> None:
    """The first load on a node returns before its fill is sealed (hash, fsync, marker,
    record): a replica stopped just after its first answer must finish that first, or the
    next replica fills from the origin again. The 0.5 GB rung's seal takes about a second."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        folder: Path = importlib.import_module("model_ladder").ensure("0.5gb")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    node = tmp_path / "node"
    app = causal_lm_app(folder.as_uri(), name="causal-lm-half", num_cpus=0.25,
                        loader_options={"cache_dir": str(node)})
    with serve_app(app, ready_timeout_s=300) as base:
        reply = httpx.post(f"{base}/lm", json=[1, 2, 3], timeout=300)
        assert reply.status_code == 200, reply.text
        assert reply.json()["load"]["restored"] is False  # this replica filled the node
    # The app is deleted: its replica has stopped.
    blobs = sorted(p for p in node.glob("*/blobs/*") if not p.name.startswith("."))
    shards = sorted(folder.glob("*.safetensors"))
    assert len(blobs) == len(shards), (blobs, list(node.glob("*/blobs/*")))
    for blob in blobs:
        assert (blob.parent.parent / "markers" / f"{blob.name}.json").exists(), blob
    assert not list(node.glob("*/blobs/.tmp-*")), "a fill's temp file was left"
    assert list((node / "snapshots").glob("*.json")), "no snapshot record"
