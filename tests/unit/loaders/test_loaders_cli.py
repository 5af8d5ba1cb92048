"""``ember cache`` subcommands, driven through argparse as the main CLI will."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ember.cli.cache import register
from ember.loaders import LoaderConfig, resolve
from ember.loaders.pages import free_page_reporting

Writer = Callable[[dict[str, torch.Tensor], str], Path]


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="ember")
    register(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    code: int = args.func(args)
    return code


def test_warm_ls_verify_evict(
    write_file: Writer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = str(tmp_path / "cli-cache")
    path = write_file({"w": torch.ones(1000)}, "model.safetensors")
    assert _run("cache", "--cache-dir", cache, "warm", path.as_uri()) == 0
    out = capsys.readouterr()
    assert "snapshots" in out.out and "warm" in out.err  # link printed; progress bar drawn
    assert _run("cache", "--cache-dir", cache, "ls") == 0
    listing = capsys.readouterr().out
    assert "1 blobs" in listing and "model.safetensors" in listing
    assert _run("cache", "--cache-dir", cache, "verify") == 0
    link = resolve(path.as_uri(), config=LoaderConfig(cache_dir=Path(cache))).paths[0]
    blob = link.resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert _run("cache", "--cache-dir", cache, "verify") == 1
    assert not blob.exists()
    assert _run("cache", "--cache-dir", cache, "warm", path.as_uri()) == 0
    key = link.resolve().name
    capsys.readouterr()
    assert _run("cache", "--cache-dir", cache, "evict", "../../etc") == 2
    assert "unsafe path" in capsys.readouterr().err
    assert _run("cache", "--cache-dir", cache, "evict", "ffffffffff") == 1
    assert _run("cache", "--cache-dir", cache, "evict", key[:10]) == 0
    assert not link.exists() and not (link.parents[2] / "blobs" / key).exists()
    assert _run("cache", "--cache-dir", cache, "warm", path.as_uri()) == 0
    assert _run("cache", "--cache-dir", cache, "evict", "--all") == 0
    assert "removed 1 blob(s)" in capsys.readouterr().out


def test_warm_reports_errors_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"\x80\x04")
    assert _run("cache", "--cache-dir", str(tmp_path / "c"), "warm", bad.as_uri()) == 2
    assert "convert it to safetensors" in capsys.readouterr().err


def test_bench_prints_the_limits_and_each_recent_load_against_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ember.loaders.limits import record_load

    cache = tmp_path / "cli-cache"
    record_load(cache, {"url": "file:///m/cold/", "bytes": 2_000_000_000,
                        "read_bytes": 2_000_000_000, "restored": True, "seconds": 4.0})
    record_load(cache, {"url": "file:///m/warm/", "bytes": 2_000_000_000, "read_bytes": 0,
                        "restored": True, "seconds": 0.5})
    assert _run("cache", "--cache-dir", str(cache), "bench", "--size-mb", "8") == 0
    out = capsys.readouterr().out
    assert "disk_cold_gbps" in out and "page_cache_gbps" in out
    cold = next(line for line in out.splitlines() if "/m/cold/" in line)
    warm = next(line for line in out.splitlines() if "/m/warm/" in line)
    assert "0.50" in cold and " disk " in cold  # 2 GB in 4 s, held against the disk
    assert "4.00" in warm and " page_cache " in warm
    huge = next(line for line in out.splitlines() if line.startswith("huge_pages"))
    assert huge.split()[1:3] == (["off", "(auto:"] if free_page_reporting() else ["on", "(auto)"])
    assert not list(cache.glob(".bench-*")), "the scratch file was left behind"
