"""``LoaderConfig.huge_pages``: a node-cache blob read cold through a mapping advised
``MADV_HUGEPAGE`` comes into the page cache in 2 MiB folios, which this and every later mapping
of the blob map one page-table entry each (``FilePmdMapped``), instead of 512."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ember.loaders import LoaderConfig, snapshot_load
from ember.loaders.pages import evict, populate, resident_bytes

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or not _THP.exists() or "[never]" in _THP.read_text(),
    reason="transparent huge pages are off on this kernel")


def _pmd_mapped_bytes(path: Path) -> int:
    """Bytes of this process's mappings of ``path`` mapped 2 MiB at a time."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            inside = len(fields) == 6 and fields[5] == str(path)
        elif inside and fields[0] == "FilePmdMapped:":
            total += int(fields[1]) * 1024
    return total


def _cold_restore(url: str, config: LoaderConfig) -> tuple[dict[str, torch.Tensor], Path]:
    """The node's snapshot of ``url`` mapped with its blob's pages dropped first, then every
    page brought in as a replica's load brings them in."""
    first = snapshot_load(url, config=config)
    blob = next(iter(first.blobs))
    del first
    gc.collect()
    evict(blob)
    assert resident_bytes(blob) == 0
    got = snapshot_load(url, config=config)
    assert got.restored
    spans = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for t in got.tensors.values()}
    assert populate(list(spans.items()))
    return got.tensors, blob


@pytest.mark.parametrize("huge_pages", [True, False])
def test_a_cold_blob_mapped_with_huge_pages_is_mapped_two_mib_at_a_time(
        tmp_path: Path, config: LoaderConfig, huge_pages: bool) -> None:
    path = tmp_path / "model.safetensors"
    gen = torch.Generator().manual_seed(0)
    want = {f"w{i}": torch.randn(1 << 20, generator=gen) for i in range(8)}  # 32 MiB
    safetensors.torch.save_file(want, path)
    cfg = config.model_copy(update={"huge_pages": huge_pages})
    tensors, blob = _cold_restore(path.as_uri(), cfg)
    assert all(torch.equal(tensors[k], v) for k, v in want.items())
    size = blob.stat().st_size
    if huge_pages:
        assert _pmd_mapped_bytes(blob) >= size // 2, "the blob was not read into 2 MiB folios"
    else:  # off: the sequential advice reads small folios (faster at rest on this VM)
        assert _pmd_mapped_bytes(blob) < size // 2
