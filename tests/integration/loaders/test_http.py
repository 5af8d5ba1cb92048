"""https:// semantics against a stdlib HTTP server on loopback."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from ember.loaders import (
    LoaderConfig,
    ObjectChanged,
    RangeNotSupported,
    ShortRead,
    load,
    read_present_beside,
    stream,
)

from loaders.origins import HttpOrigin, make_weights


def _serve(origin: HttpOrigin, tmp_path: Path, n: int = 16) -> tuple[str, dict[str, torch.Tensor]]:
    path = tmp_path / "weights" / "model.safetensors"
    tensors = make_weights(path, n=n)
    return origin.put("model.safetensors", path.read_bytes()), tensors


def test_http_load_equals_and_reads_ranges(
    http_origin: HttpOrigin, tmp_path: Path, config: LoaderConfig
) -> None:
    url, tensors = _serve(http_origin, tmp_path)
    got = load(url, config=config)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    gets = http_origin.ranged_gets("model.safetensors")
    # Two small header reads, then the data region in 16 KiB ranges.
    assert gets[0] == "bytes=0-7" and gets[1].startswith("bytes=8-")
    assert len(gets) == 2 + -(-(16 * 4096 * 4) // (16 << 10))
    load(url, config=config)
    assert len(http_origin.ranged_gets("model.safetensors")) == len(gets)  # a node hit


def test_server_ignoring_range_is_refused(
    http_origin: HttpOrigin, tmp_path: Path, config: LoaderConfig
) -> None:
    url, _ = _serve(http_origin, tmp_path)
    http_origin.ignore_range = True
    with pytest.raises(RangeNotSupported, match="status 200, expected 206"):
        load(url, config=config)
    assert not list(Path(str(config.cache_dir)).glob("*/blobs/*"))


def test_short_reads_are_refused(
    http_origin: HttpOrigin, tmp_path: Path, config: LoaderConfig
) -> None:
    url, _ = _serve(http_origin, tmp_path)
    http_origin.short_by = 1
    with pytest.raises(ShortRead, match="bytes 0-8 returned 7"):
        load(url, config=config)


def test_object_changing_mid_stream_is_refused(
    http_origin: HttpOrigin, tmp_path: Path, config: LoaderConfig
) -> None:
    url, _ = _serve(http_origin, tmp_path, n=32)
    http_origin.delay_s = 0.03
    replacement = tmp_path / "v2" / "model.safetensors"
    make_weights(replacement, n=33)
    # Detected by the ETag (If-Match) or by the size, whichever read sees the change first.
    with pytest.raises(ObjectChanged, match=r"ETag|changed while it was being read"):
        for _name, _tensor in stream(url, config=config):
            http_origin.put("model.safetensors", replacement.read_bytes())
    assert not list(Path(str(config.cache_dir)).glob("*/blobs/*"))


def test_threads_share_one_fetch_and_one_error(
    http_origin: HttpOrigin, tmp_path: Path, config: LoaderConfig
) -> None:
    url, tensors = _serve(http_origin, tmp_path)
    http_origin.delay_s = 0.02
    results: list[object] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        try:
            results.append(load(url, config=config))
        except Exception as exc:  # collected and asserted below
            results.append(exc)

    def run_all() -> None:
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    run_all()
    assert all(
        isinstance(r, dict) and torch.equal(r["layer.03.weight"], tensors["layer.03.weight"])
        for r in results
    )
    assert http_origin.ranged_gets("model.safetensors").count("bytes=0-7") == 1
    # A failing fill: every waiting thread gets the leader's typed error.
    results.clear()
    http_origin.put("model.safetensors", b"\x10" + b"\0" * 7 + b"{}")
    http_origin.log.clear()
    http_origin.delay_s = 1.0  # the threads wait on the leader while its fill fails
    run_all()
    assert len(results) == 8 and all(type(r).__name__ == "HeaderInvalid" for r in results)
    # Waiters got the leader's error instead of fetching themselves (on a loaded machine a
    # thread may start only after the failure and then fetches, and fails, on its own).
    assert http_origin.ranged_gets("model.safetensors").count("bytes=0-7") <= 2


@pytest.mark.parametrize("missing_status", [404, 403])
def test_files_beside_the_weights_cost_one_head_each_and_absent_ones_are_left_out(
    http_origin: HttpOrigin, tmp_path: Path, config: LoaderConfig, missing_status: int
) -> None:
    http_origin.missing_status = missing_status
    url, _ = _serve(http_origin, tmp_path, n=2)
    http_origin.put("config.json", b'{"model_type": "llama"}')
    http_origin.put("tokenizer.json", b"{}")
    got = read_present_beside(url, ("config.json", "tokenizer.json", "vocab.txt"), config)
    assert got == {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}"}
    assert http_origin.heads("config.json") == http_origin.heads("tokenizer.json") == 1
    # A 403 is told from a failure by one more HEAD, for the absent file only.
    assert http_origin.heads("vocab.txt") == (1 if missing_status == 404 else 2)
