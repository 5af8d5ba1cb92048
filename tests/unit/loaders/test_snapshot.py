"""Snapshots: restore without the origin, fall back on every bad record, cap, list, CLI."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ember.loaders._resolve as resolve_module
from ember.cli.snapshot import register
from ember.loaders import (
    LoaderConfig,
    SnapshotLoad,
    drop_all,
    drop_snapshot,
    list_snapshots,
    preload_snapshot,
    snapshot_key,
    snapshot_load,
)
from ember.loaders._snapshot_admin import resident_bytes

Writer = Callable[[dict[str, torch.Tensor], str], Path]


def _record(config: LoaderConfig, got: SnapshotLoad) -> Path:
    return config.node_root() / "snapshots" / f"{got.key}.json"


def _edit(path: Path, change: Callable[[dict[str, object]], None]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _files(record: Path) -> list[dict[str, object]]:
    files: list[dict[str, object]] = json.loads(record.read_text())["files"]
    return files


def _set_first_path(record: Path, path: str) -> None:
    doc = json.loads(record.read_text())
    doc["files"][0]["path"] = path
    record.write_text(json.dumps(doc))


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _no_origin(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the origin was contacted")

    monkeypatch.setattr(resolve_module, "open_source", refuse)


def test_first_load_records_second_restores_without_the_origin(
    write_file: Writer,
    config: LoaderConfig,
    sample_tensors: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = write_file(sample_tensors, "model.safetensors")
    first = snapshot_load(path.as_uri(), code_version="v1", config=config)
    assert not first.restored and first.fallback_reason is None
    assert {"resolve", "map", "record"} <= set(first.phases)
    _same(first.tensors, sample_tensors)
    doc = json.loads(_record(config, first).read_text())
    assert doc["url"] == path.as_uri() and doc["code_version"] == "v1"
    assert doc["total_bytes"] == path.stat().st_size and doc["revision"]
    assert [f["name"] for f in doc["files"]] == ["model.safetensors"]
    path.rename(path.with_suffix(".gone"))  # the origin is down
    _no_origin(monkeypatch)
    second = snapshot_load(path.as_uri(), code_version="v1", config=config)
    assert second.restored and second.key == first.key and second.fallback_reason is None
    assert set(second.phases) == {"resolve", "verify", "map"}
    _same(second.tensors, sample_tensors)
    full = snapshot_load(path.as_uri(), code_version="v1", config=config, verify="full")
    assert full.restored


def test_a_record_that_cannot_be_written_fails_no_load(
    write_file: Writer,
    config: LoaderConfig,
    sample_tensors: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import ember.loaders._snapshot as snapshot_module

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot_module, "_write_record", disk_full)
    path = write_file(sample_tensors, "model.safetensors")
    config = config.model_copy(update={"cache_write": "through"})  # the record in the load
    first = snapshot_load(path.as_uri(), code_version="v1", config=config)
    _same(first.tensors, sample_tensors)  # the tensors were mapped: the load stands
    assert "record not written" in caplog.text
    monkeypatch.undo()
    again = snapshot_load(path.as_uri(), code_version="v1", config=config)
    assert not again.restored  # no record: the next load filled and recorded
    assert snapshot_load(path.as_uri(), code_version="v1", config=config).restored


def test_sharded_checkpoint_restores_with_its_weight_map(
    write_file: Writer, tmp_path: Path, config: LoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    write_file({"a": torch.ones(3), "b": torch.zeros(2)}, first)
    write_file({"c": torch.arange(4)}, second)
    index = tmp_path / "origin" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": first, "b": first, "c": second}}))
    url = index.parent.as_uri()
    assert not snapshot_load(url, config=config).restored
    for path in index.parent.iterdir():
        path.unlink()
    _no_origin(monkeypatch)
    got = snapshot_load(url, config=config)
    assert got.restored and set(got.tensors) == {"a", "b", "c"}
    assert torch.equal(got.tensors["c"], torch.arange(4))


def _break_json(record: Path, config: LoaderConfig) -> None:
    record.write_text("{not json")


def _truncate_blob(record: Path, config: LoaderConfig) -> None:
    blob = config.node_root() / str(_files(record)[0]["path"])
    os.truncate(blob, blob.stat().st_size // 2)


def _wrong_marker(record: Path, config: LoaderConfig) -> None:
    rel = Path(str(_files(record)[0]["path"]))
    marker = config.node_root() / rel.parts[0] / "markers" / f"{rel.name}.json"
    _edit(marker, lambda doc: doc.update(sha256="0" * 64))


def _escaping_path(record: Path, config: LoaderConfig) -> None:
    _set_first_path(record, "../origin/model.safetensors")


def _symlinked_blob(record: Path, config: LoaderConfig) -> None:
    # A "blob" that is a link to a file outside the root, with a plausible marker beside it.
    entry = _files(record)[0]
    outside = config.node_root().parent / "origin" / "model.safetensors"
    fake = config.node_root() / "files--evil--0" / "blobs" / str(entry["sha256"])
    fake.parent.mkdir(parents=True)
    fake.symlink_to(outside)
    markers = fake.parent.parent / "markers"
    markers.mkdir()
    (markers / f"{entry['sha256']}.json").write_text(json.dumps(entry))
    _set_first_path(record, f"files--evil--0/blobs/{fake.name}")


def _other_url(record: Path, config: LoaderConfig) -> None:
    _edit(record, lambda doc: doc.update(url="file:///elsewhere/model.safetensors"))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_break_json, "unparsable record"),
        (_truncate_blob, "size mismatch"),
        (_wrong_marker, "marker"),
        (_escaping_path, "unsafe path"),
        (_symlinked_blob, "not a regular file"),
        (_other_url, "another URL"),
    ],
)
def test_a_bad_snapshot_falls_back_to_the_streaming_load(
    write_file: Writer,
    config: LoaderConfig,
    sample_tensors: dict[str, torch.Tensor],
    damage: Callable[[Path, LoaderConfig], None],
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = write_file(sample_tensors, "model.safetensors")
    first = snapshot_load(path.as_uri(), config=config)
    damage(_record(config, first), config)
    got = snapshot_load(path.as_uri(), config=config)
    assert not got.restored and got.fallback_reason is not None
    assert reason in got.fallback_reason
    assert "not restored" in caplog.text and "restore" in got.phases
    _same(got.tensors, sample_tensors)
    again = snapshot_load(path.as_uri(), config=config)  # a fresh record was written
    assert again.restored
    _same(again.tensors, sample_tensors)


def test_code_version_is_part_of_the_key(write_file: Writer, config: LoaderConfig) -> None:
    path = write_file({"w": torch.ones(8)}, "model.safetensors")
    url = path.as_uri()
    assert snapshot_key(url, "v1") != snapshot_key(url, "v2") != snapshot_key(url)
    a = snapshot_load(url, code_version="v1", config=config)
    b = snapshot_load(url, code_version="v2", config=config)
    assert a.key != b.key and not b.restored
    assert snapshot_load(url, code_version="v1", config=config).restored


def test_cap_drops_least_recently_used_records(write_file: Writer, config: LoaderConfig) -> None:
    urls = [write_file({"w": torch.ones(256) * i}, f"m{i}.safetensors").as_uri() for i in range(3)]
    size = Path(urls[0].removeprefix("file://")).stat().st_size
    cap = int(2.5 * size)
    a = snapshot_load(urls[0], config=config, max_snapshot_bytes=cap)
    b = snapshot_load(urls[1], config=config, max_snapshot_bytes=cap)
    assert snapshot_load(urls[0], config=config, max_snapshot_bytes=cap).restored  # a is fresh
    c = snapshot_load(urls[2], config=config, max_snapshot_bytes=cap)
    keys = {info.key for info in list_snapshots(config)}
    assert keys == {a.key, c.key} and b.key not in keys
    tiny = snapshot_load(urls[1], config=config, max_snapshot_bytes=1)  # over the cap alone
    assert {info.key for info in list_snapshots(config)} == {tiny.key}


def test_cap_from_the_environment(
    write_file: Writer, config: LoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = [write_file({"w": torch.ones(64) * i}, f"m{i}.safetensors").as_uri() for i in range(2)]
    monkeypatch.setenv("EMBER_SNAPSHOT_MAX_BYTES", "1")
    for url in urls:
        snapshot_load(url, config=config)
    assert [i.url for i in list_snapshots(config)] == [urls[1]]


def test_list_reports_sizes_and_resident_bytes(write_file: Writer, config: LoaderConfig) -> None:
    path = write_file({"w": torch.ones(4096)}, "model.safetensors")
    got = snapshot_load(path.as_uri(), code_version="v7", config=config)
    [info] = list_snapshots(config)
    assert (info.key, info.url, info.code_version) == (got.key, path.as_uri(), "v7")
    assert info.total_bytes == path.stat().st_size and info.files == 1
    assert info.resident_bytes is None or 0 < info.resident_bytes <= info.total_bytes
    assert info.last_used_at >= info.created_at
    warmed = preload_snapshot(path.as_uri(), code_version="v7", config=config)
    assert warmed.key == got.key
    assert warmed.resident_bytes is None or warmed.resident_bytes == warmed.total_bytes
    assert resident_bytes(path.parent / "missing") in (0, None)


def test_drop_by_prefix_and_all(write_file: Writer, config: LoaderConfig) -> None:
    urls = [write_file({"w": torch.ones(8) * i}, f"m{i}.safetensors").as_uri() for i in range(3)]
    keys = [snapshot_load(url, config=config).key for url in urls]
    assert drop_snapshot(keys[0][:10], config=config) == 1
    assert drop_snapshot(keys[0][:10], config=config) == 0
    assert len(list_snapshots(config)) == 2
    assert drop_all(config=config) == 2 and list_snapshots(config) == []
    assert not snapshot_load(urls[1], config=config).restored  # the blobs are still cached
    with pytest.raises(Exception, match="unsafe path"):
        drop_snapshot("../../etc", config=config)


def test_device_is_selected_at_run_time(write_file: Writer, config: LoaderConfig) -> None:
    path = write_file({"w": torch.ones(8)}, "model.safetensors")
    got = snapshot_load(path.as_uri(), device="auto", config=config)
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert got.tensors["w"].device.type == want
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            snapshot_load(path.as_uri(), device="cuda", config=config)


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="ember")
    register(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    code: int = args.func(args)
    return code


def test_cli_ls_and_drop(
    write_file: Writer, config: LoaderConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = str(config.node_root())
    assert _cli("snapshot", "--cache-dir", cache, "ls") == 0
    assert "0 snapshot(s)" in capsys.readouterr().out
    path = write_file({"w": torch.ones(1000)}, "model.safetensors")
    key = snapshot_load(path.as_uri(), code_version="v2", config=config).key
    assert _cli("snapshot", "--cache-dir", cache, "ls") == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["KEY", "URL", "CODE_VERSION", "SIZE", "RESIDENT", "LAST_USED"]
    assert table[1].startswith(key[:12]) and path.as_uri() in table[1] and "v2" in table[1]
    assert table[-1].startswith("1 snapshot(s)") and "cap unlimited" in table[-1]
    assert _cli("snapshot", "--cache-dir", cache, "ls", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["snapshots"][0]["key"] == key and doc["total_bytes"] == path.stat().st_size
    assert _cli("snapshot", "--cache-dir", cache, "drop", "../x") == 2
    assert "unsafe path" in capsys.readouterr().err
    assert _cli("snapshot", "--cache-dir", cache, "drop", "f" * 64) == 1
    assert _cli("snapshot", "--cache-dir", cache, "drop", key[:8]) == 0
    assert "dropped 1 snapshot(s)" in capsys.readouterr().out
    assert _cli("snapshot", "--cache-dir", cache, "drop", "--all") == 1
    snapshot_load(path.as_uri(), config=config)
    assert _cli("snapshot", "--cache-dir", cache, "drop", "--all") == 0


def test_a_preload_leaves_the_snapshot_on_the_node_even_where_loads_write_behind(
        write_file: Writer, config: LoaderConfig) -> None:
    # "behind" is what a remote origin gets by default: a load returns before the node cache
    # holds its bytes. A preload (ember cache warm, a deployment's preload) must not.
    behind = config.model_copy(update={"cache_write": "behind"})
    path = write_file({"w": torch.ones(4096)}, "model.safetensors")
    warmed = preload_snapshot(path.as_uri(), code_version="v1", config=behind)
    [info] = list_snapshots(behind)
    assert info.key == warmed.key and info.total_bytes == path.stat().st_size
