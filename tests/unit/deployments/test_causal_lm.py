"""The causal-LM deployment's load: refused when it cannot fit, built on meta with the
mapped tensors assigned (no copy), and the page-cache residency it relies on."""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from ember.deployments.causal_lm import load_causal_lm, next_token
from ember.errors import HeaderInvalid, InsufficientMemory
from ember.loaders import pages, wait_for_cache_writes
from ember.loaders.pages import evict, populate, prefetch, resident_bytes
from ember.loaders.reservations import check_fits

from support import bench_module


@pytest.fixture(scope="module")
def ladder() -> ModuleType:
    return bench_module("model_ladder")


@pytest.fixture(scope="module")
def tiny(ladder: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder: Path = ladder.write_checkpoint(ladder.LADDER["tiny"],
                                           tmp_path_factory.mktemp("ladder") / "tiny")
    return folder


def test_a_replica_that_cannot_fit_is_refused_with_503_and_the_bytes() -> None:
    with pytest.raises(InsufficientMemory) as caught:
        check_fits(6_000_000_000, 1_500_000_000, what="llama-6gb")
    assert caught.value.status_code == 503
    message = str(caught.value)
    assert "6000000000" in message and "1500000000" in message and "llama-6gb" in message
    check_fits(1_500_000_000, 1_500_000_000, what="fits exactly")


def test_the_refusal_comes_before_anything_is_read(tiny: Path, tmp_path: Path) -> None:
    cache = tmp_path / "node"
    with pytest.raises(InsufficientMemory) as caught:
        load_causal_lm(tiny.as_uri(), config={"cache_dir": str(cache)}, free_bytes=1000)
    assert caught.value.fields["needed_bytes"] > 1000
    assert not list(cache.glob("*/blobs/*")), "weights were fetched before the refusal"
    assert not list(cache.glob("snapshots/*.json"))


def test_parameters_are_the_mapped_blobs_and_answer_like_from_pretrained(
    tiny: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    cache = tmp_path / "node"
    model, report = load_causal_lm(tiny.as_uri(), config={"cache_dir": str(cache)})
    assert wait_for_cache_writes(timeout_s=60)  # the node cache is filled after the load
    blobs = {p.stat().st_size for p in cache.glob("*/blobs/*")}
    for name, tensor in model.state_dict().items():
        assert not tensor.is_meta, name
        # A view on its file's one buffer (the blob's bytes), not storage of its own:
        # nothing was copied.
        assert tensor.untyped_storage().nbytes() in blobs, name
    assert report.weights_bytes == sum(blobs)
    reference = AutoModelForCausalLM.from_pretrained(str(tiny), local_files_only=True,
                                                     dtype=torch.bfloat16)
    for ids in ([1, 2, 3], [7, 300, 41, 5]):
        assert next_token(model, ids) == next_token(reference, ids)
    _again, second = load_causal_lm(tiny.as_uri(), config={"cache_dir": str(cache)})
    assert second.restored and second.read_bytes == 0


def test_prefetch_reads_only_what_is_not_resident(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"\x01" * (8 << 20))
    evict(path)
    assert resident_bytes(path) == 0
    assert prefetch([path], chunk_bytes=1 << 20) == 8 << 20
    assert resident_bytes(path) == 8 << 20
    assert prefetch([path]) == 0


def test_resident_bytes_counts_with_cachestat_and_agrees_with_mincore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"\x01" * (8 << 20))
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:  # a quarter of the pages, with no readahead around them
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for offset in range(0, 8 << 20, 16 << 10):
            os.pread(fd, 4096, offset)
    finally:
        os.close(fd)
    by_mincore = (len(vec := pages.residency(path)) - vec.count(b"\x00")) * 4096
    assert 0 < by_mincore < 8 << 20
    if pages._cachestat_pages(path) is None:
        pytest.skip("the kernel has no cachestat (before Linux 6.5)")
    with monkeypatch.context() as patch:  # the count must come from cachestat alone
        patch.setattr(pages, "residency", lambda _path: pytest.fail("mincore was used"))
        assert resident_bytes(path) == by_mincore
    monkeypatch.setattr(pages, "_cachestat_nr", None)  # a kernel without it: mincore
    assert resident_bytes(path) == by_mincore


def _mapped_rss_bytes(address: int, field: str = "Rss") -> int:
    """This process's resident (or ``field``) bytes of the mapping that starts at
    ``address`` (smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{address:x}-"))
    rss = next(line for line in lines[start + 1:] if line.startswith(f"{field}:"))
    return int(rss.split()[1]) * 1024


def _cold_mapping(path: Path) -> tuple[mmap.mmap, torch.Tensor]:
    """An 8 MiB file at ``path``, out of the page cache, mapped copy-on-write as the loader
    maps a blob; the mapping and a byte view of it."""
    path.write_bytes(b"\x01" * (8 << 20))
    evict(path)
    with path.open("rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def test_touch_reads_every_page_and_populate_touches_each_chunk_it_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mapping, flat = _cold_mapping(tmp_path / "blob")
    address = flat.data_ptr()
    touched: list[tuple[int, int]] = []
    real_touch = pages.touch

    def spy(address: int, length: int) -> int:
        touched.append((address, length))
        return real_touch(address, length)

    monkeypatch.setattr(pages, "touch", spy)
    assert populate([(address, 8 << 20)], chunk_bytes=1 << 20)
    # Every chunk, right after its read (in the worker that read it).
    assert sorted(touched) == [(address + i * (1 << 20), 1 << 20) for i in range(8)]
    # The CPU reads each page: the accessed bits cleared, then set again by touch() alone.
    Path("/proc/self/clear_refs").write_text("1")
    assert _mapped_rss_bytes(address, "Referenced") == 0
    assert real_touch(address, 8 << 20) == 2048
    assert _mapped_rss_bytes(address, "Referenced") == 8 << 20
    del flat
    mapping.close()


def test_populate_reads_into_the_mapping_itself_with_no_copy(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    mapping, flat = _cold_mapping(path)
    address = flat.data_ptr()
    assert resident_bytes(path) == 0 and _mapped_rss_bytes(address) == 0
    assert populate([(address, 8 << 20)], chunk_bytes=1 << 20)
    # Read from disk into the page cache, and those pages mapped here: the first use of
    # the weights takes no fault, and no buffer outside the mapping held a copy.
    assert resident_bytes(path) == 8 << 20
    assert _mapped_rss_bytes(address) == 8 << 20
    assert int(flat[::4096].sum()) == 2048
    del flat
    mapping.close()


def test_populate_reads_the_mapping_as_sequential_and_leaves_it_normal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel reads a whole readahead window per fault only on a sequential mapping
    # ("sr" in smaps' VmFlags); left sequential, the weights' pages would lose their
    # recency and go first under memory pressure.
    mapping, flat = _cold_mapping(tmp_path / "blob")
    address = flat.data_ptr()
    seen: list[bool] = []
    real_read = pages._populate_read

    def spy(address_: int, length: int) -> int:
        seen.append("sr" in _vm_flags(address))
        return real_read(address_, length)

    monkeypatch.setattr(pages, "_populate_read", spy)
    assert populate([(address, 8 << 20)], chunk_bytes=1 << 20)
    assert seen == [True] * 8
    assert "sr" not in _vm_flags(address)
    del flat
    mapping.close()


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that starts at ``address`` (smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{address:x}-"))
    return next(line for line in lines[start + 1:] if line.startswith("VmFlags:")).split()[1:]


def test_a_cold_load_reports_its_reads_and_leaves_the_weights_mapped_in(
        tiny: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    load_causal_lm(tiny.as_uri(), config={"cache_dir": str(cache)})
    assert wait_for_cache_writes(timeout_s=60)
    gc.collect()  # the first model's mappings pin its pages
    blobs = sorted(p for p in cache.glob("*/blobs/*") if p.suffix != ".json")
    for blob in blobs:
        evict(blob)
    assert sum(resident_bytes(p) for p in blobs) == 0
    model, report = load_causal_lm(tiny.as_uri(), config={"cache_dir": str(cache)})
    assert report.restored and report.read_bytes == sum(p.stat().st_size for p in blobs)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in model.state_dict().values()}
    assert sorted(storages.values()) == sorted(p.stat().st_size for p in blobs)
    for address, nbytes in storages.items():
        assert _mapped_rss_bytes(address) >= nbytes - 4096, "pages left to fault in"


NO_WASTE = """
import json, sys
import transformers.models.llama.modeling_llama  # the libraries, before the baseline
from ember.deployments.causal_lm import load_causal_lm, memory_bytes, next_token
before = memory_bytes()["rss_bytes"]
model, report = load_causal_lm(sys.argv[1], config={"cache_dir": sys.argv[2]})
loaded = memory_bytes()["rss_bytes"]
next_token(model, [1, 2, 3])
print(json.dumps({"before": before, "loaded": loaded, **memory_bytes(),
                  "weights": report.weights_bytes}), flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_half_a_gigabyte_model_costs_its_weights_once_and_two_replicas_share_them(
    ladder: ModuleType, tmp_path: Path
) -> None:
    """The 0.5 GB rung (the smallest where a second copy would stand out of the noise of
    the allocator): the load grows RSS by at most 1.2x the weights, the load and a forward
    by at most 1.3x (a second copy would be 2x), and two replicas' PSS split them."""
    import json

    folder = ladder.ensure("0.5gb")
    cache = str(tmp_path / "node")
    args = [sys.executable, "-c", textwrap.dedent(NO_WASTE), folder.as_uri(), cache]
    first = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    second = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and second.stdout is not None
        a = json.loads(first.stdout.readline())
        b = json.loads(second.stdout.readline())
        for got in (a, b):
            # On a two-core dev VM the load grows RSS by 1.02x the weights and a forward adds
            # 12 MiB; one CI machine measured 1.10x in all, with larger libraries
            # (``before``): the margins leave room for the machine, not for a copy.
            assert got["loaded"] - got["before"] <= 1.2 * got["weights"], got
            assert got["rss_bytes"] - got["before"] <= 1.3 * got["weights"], got
        import psutil

        pss = [psutil.Process(p.pid).memory_full_info().pss for p in (first, second)]
        # Each pays its libraries (``before``) and about half of the shared weights.
        for got, paid in zip((a, b), pss, strict=True):
            assert paid - got["before"] <= 0.75 * got["weights"], (paid, got)
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()


def test_the_model_is_built_on_meta_while_the_weights_load(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import ember.deployments.causal_lm as causal_lm
    import ember.loaders

    built = threading.Event()
    real_load, real_build = ember.loaders.snapshot_load, causal_lm.build_on_meta

    def load_once_built(*args: Any, **kwargs: Any) -> Any:
        # Serial phases would build only after this returns: the wait would time out.
        assert built.wait(30), "the model was not built while the weights loaded"
        return real_load(*args, **kwargs)

    def build(doc: dict[str, Any]) -> torch.nn.Module:
        model = real_build(doc)
        built.set()
        return model

    monkeypatch.setattr(ember.loaders, "snapshot_load", load_once_built)
    monkeypatch.setattr(causal_lm, "build_on_meta", build)
    model, report = load_causal_lm(tiny.as_uri(), config={"cache_dir": str(tmp_path / "node")})
    assert wait_for_cache_writes(timeout_s=60)
    assert {"check", "map", "construct", "pages_wait", "assign", "total"} <= set(report.phases_s)
    assert isinstance(next_token(model, [1, 2, 3]), int)


def _copy(folder: Path, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, to))


@pytest.mark.parametrize("change", [{"model_type": "nope"}, {"hidden_size": "wide"}])
def test_a_bad_config_is_refused_before_any_weight_is_fetched(
    tiny: Path, tmp_path: Path, change: dict[str, Any]
) -> None:
    import json

    folder = _copy(tiny, tmp_path / "bad")
    doc = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**doc, **change}))
    cache = tmp_path / "node"
    with pytest.raises(HeaderInvalid) as caught:
        load_causal_lm(folder.as_uri(), config={"cache_dir": str(cache)})
    assert "config.json" in str(caught.value) and caught.value.status_code == 503
    assert wait_for_cache_writes(timeout_s=60)
    assert not list(cache.glob("*/blobs/*")), "weights were fetched for a bad config"
    assert not list(cache.glob("snapshots/*.json"))


def test_a_weight_of_another_dtype_is_refused_at_load_not_at_the_first_forward(
    tiny: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny, tmp_path / "mixed")
    shard = sorted(folder.glob("*.safetensors"))[-1]
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.float16)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(HeaderInvalid, match="mixed dtypes") as caught:
        load_causal_lm(folder.as_uri(), config={"cache_dir": str(tmp_path / "node")})
    assert f"{name} is float16" in str(caught.value)
    assert wait_for_cache_writes(timeout_s=60)
