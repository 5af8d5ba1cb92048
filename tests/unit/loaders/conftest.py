"""Fixtures for the loader unit tests: small safetensors files and isolated caches."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ember.loaders import LoaderConfig


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No test may touch the user's caches or a hub.
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.delenv("EMBER_REGIONAL_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def config(tmp_path: Path) -> LoaderConfig:
    """A config with a private node cache and small ranges, so files span many reads."""
    return LoaderConfig(
        cache_dir=tmp_path / "node",
        range_bytes=4096,
        max_concurrency=4,
        min_free_bytes=0,
        lease_timeout_s=2.0,
        lease_heartbeat_s=0.2,
        poll_interval_s=0.02,
        # The cache tests check the node cache right after a load returns; write-behind
        # (the default) has its own tests, which wait for the write.
        cache_write="through",
    )


@pytest.fixture
def sample_tensors() -> dict[str, torch.Tensor]:
    """A few tensors of mixed dtypes and shapes, large enough for several range reads."""
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(64, 48, generator=gen),
        "layer.0.bias": torch.randn(48, generator=gen).to(torch.float16),
        "layer.0.weight": torch.randn(48, 48, generator=gen).to(torch.bfloat16),
        "positions": torch.arange(100, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


@pytest.fixture
def write_file(tmp_path: Path) -> Callable[[dict[str, torch.Tensor], str], Path]:
    """Save tensors with safetensors itself under ``tmp_path/origin``."""

    def write(tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> Path:
        path = tmp_path / "origin" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file(tensors, str(path))
        return path

    return write


RawWriter = Callable[..., Path]


@pytest.fixture
def raw_file(tmp_path: Path) -> RawWriter:
    """Write ``origin/<name>`` as a safetensors-shaped file with an arbitrary header."""

    def write(
        header: object, data: bytes = b"", *, length: int | None = None, name: str = "x.safetensors"
    ) -> Path:
        body = header if isinstance(header, bytes) else json.dumps(header).encode()
        prefix = struct.pack("<Q", len(body) if length is None else length)
        path = tmp_path / "origin" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(prefix + body + data)
        return path

    return write
