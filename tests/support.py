"""Helpers shared by the test layers (on ``sys.path`` through pytest's ``pythonpath``)."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import httpx
import pytest

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's
    ephemeral range: the rule of ``bench/_harness.py``, which the benchmarks and load tests
    use too (a port Ray's servers take by binding 0 failed an edge's start)."""
    return int(_bench_harness().free_port())


@functools.cache
def _bench_harness() -> ModuleType:
    return bench_module("_harness")


def wait_for(predicate: Callable[[], T | None], timeout_s: float, interval_s: float = 0.2,
             what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value and return that value.

    Fails the test after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


def admin_headers() -> dict[str, str]:
    """The admin key of ``EMBER_ADMIN_KEY`` when a test set it (else the loopback opt-in)."""
    key = os.environ.get("EMBER_ADMIN_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def deployment_status(url: str, name: str) -> dict[str, Any]:
    """One deployment's row of ``/-/status``."""
    reply = httpx.get(f"{url}/-/status", headers=admin_headers(), timeout=10)
    reply.raise_for_status()
    for row in reply.json()["deployments"]:
        if row["deployment"] == name:
            return dict(row)
    raise KeyError(name)


def replicas_up(url: str, name: str) -> int:
    """Replicas of ``name`` running or starting, as ``/-/status`` reports them."""
    row = deployment_status(url, name)
    return int(row["replicas_running"]) + int(row["replicas_starting"])


def wait_for_scale_down(url: str, name: str, *, to: int, timeout_s: float,
                        wake: Callable[[], object] | None = None) -> None:
    """Fail unless ``name`` is seen above ``to`` replicas and then seen at ``to``.

    A deployment that is already at ``to`` (never started, or status not yet polled) does
    not pass: the count must be observed going down. ``wake`` (say, one request) is called
    before each look until the deployment is seen above ``to``.
    """

    def above() -> bool:
        if wake is not None:
            wake()
        return replicas_up(url, name) > to

    wait_for(above, timeout_s, what=f"{name} above {to} replica(s) before it scales down",
             interval_s=0.1)
    wait_for(lambda: every_edge_sees(url, name, to), timeout_s,
             what=f"{name} to scale down to {to} replica(s), as every edge sees it")


def every_edge_sees(url: str, name: str, replicas: int) -> bool:
    """Whether every edge counts ``replicas`` of ``name`` running or starting.

    Each edge reads replica counts from Serve's controller about once a second, so right
    after a change they may differ; the kernel gives each new connection to either edge.
    """
    seen: dict[int, int] = {}
    expected = 1
    for _ in range(24):
        # A new connection each time.
        reply = httpx.get(f"{url}/-/status", headers=admin_headers(), timeout=10)
        reply.raise_for_status()
        status = reply.json()
        expected = max(expected, int(status["edges"]["running"]))
        row = next(r for r in status["deployments"] if r["deployment"] == name)
        seen[int(status["edges"]["pid"])] = (int(row["replicas_running"])
                                             + int(row["replicas_starting"]))
        if len(seen) >= expected:
            break
    return len(seen) >= expected and set(seen.values()) == {replicas}


def tail(path: Path, chars: int = 3000) -> str:
    """The end of a log file, for failure messages."""
    return path.read_text(errors="replace")[-chars:] if path.is_file() else "(no log)"


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` imported by path (the benchmarks are scripts, not a package).

    The environment is put back after the import: a bench module may set variables for the
    servers it starts, which no later test should run with."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    saved = dict(os.environ)
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return module


def char_llama(path: Path) -> Path:
    """A tiny seeded random Llama with a one-token-per-character tokenizer (ids 32-126, EOS
    127), saved once as a model directory at ``path``; transformers is imported only here."""
    if (path / "config.json").is_file():
        return path
    import tokenizers
    import torch
    import transformers

    vocab = {chr(i): i for i in range(32, 127)} | {"<eos>": 127}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=None, eos_token_id=127)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    transformers.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    return path
