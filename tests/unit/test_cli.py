"""The ``ember`` command line, without a server: parsing, targets, rendering, cache warm."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ember.app.targets import load_app
from ember.cli import build_parser, main
from ember.cli.cache_fill import Filled
from ember.cli.cache_nodes import describe_fill
from ember.cli.serve import parse_traffic, render_status
from ember.errors import ConfigError
from ember.loaders import LoaderConfig, list_snapshots, load, resolve


def test_every_subcommand_is_registered() -> None:
    parser = build_parser()
    for argv in (["run", "x:app"], ["status"], ["warm", "M", "--for", "10m"], ["plan"],
                 ["cache", "ls"], ["snapshot", "ls"]):
        assert parser.parse_args(argv).func is not None


@pytest.mark.parametrize(("target", "message"), [
    ("no-colon", "must look like 'module:app'"),
    ("examples/missing.py:app", "no such file"),
    ("examples/mlp_app.py:nothing", "has no attribute 'nothing'"),
    ("examples/mlp_app.py:SeedMLP", "not an ember.App"),
    ("surely_not_a_module_xyz:app", "cannot import"),
])
def test_bad_targets_say_what_is_wrong(target: str, message: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    with pytest.raises(ConfigError, match=message):
        load_app(target)


def test_status_table_shows_cold_start_phases() -> None:
    text = render_status({"app": "a", "ready": True, "deployments": [{
        "deployment": "MiniLM", "replicas_running": 0, "replicas_starting": 1, "ongoing": 0,
        "queued": 2, "floor": 0, "last_cold_start": {
            "total_s": 0.41, "path": "pool", "phases": {"weights": 0.118, "warmup": 0.021}}}]})
    assert "MiniLM" in text and "410 ms via pool (weights=118 warmup=21)" in text


def test_status_says_what_a_replica_waits_for_and_which_preload_failed() -> None:
    row = {"deployment": "Big", "replicas_running": 0, "replicas_starting": 1, "ongoing": 0,
           "queued": 0, "floor": 0, "last_cold_start": None,
           "waiting_for_resources": "waiting for resources: needs CPU 1.0, 0.8 free"}
    broken = {**row, "deployment": "Broken", "waiting_for_resources": None,
              "pool_failure": "warm pool preload failed: OSError: weights not found"}
    text = render_status({"app": "a", "ready": True, "deployments": [row, broken]})
    assert text.splitlines()[-2:] == [
        "Big: waiting for resources: needs CPU 1.0, 0.8 free",
        "Broken: warm pool preload failed: OSError: weights not found"]


def test_cache_warm_records_a_snapshot(tmp_path: Path) -> None:
    weights = tmp_path / "origin" / "model.safetensors"
    weights.parent.mkdir()
    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(weights))
    cache = tmp_path / "cache"
    code = main(["cache", "--cache-dir", str(cache), "warm", weights.as_uri(),
                 "--snapshot", "v1"])
    assert code == 0
    [snapshot] = list_snapshots(LoaderConfig(cache_dir=cache))
    assert snapshot.code_version == "v1" and snapshot.url == weights.as_uri()
    assert torch.equal(load(weights.as_uri(), config=LoaderConfig(cache_dir=cache))["w"],
                       torch.arange(6, dtype=torch.float32))


def test_cache_warm_reports_where_each_file_came_from(tmp_path: Path) -> None:
    weights = tmp_path / "origin" / "model.safetensors"
    weights.parent.mkdir()
    save_file({"w": torch.zeros(4)}, str(weights))
    args = ["cache", "--cache-dir", str(tmp_path / "cache"), "warm", weights.as_uri()]
    assert build_parser().parse_args([*args, "--all-nodes"]).all_nodes
    assert main(args) == 0
    hit = resolve(weights.as_uri(), config=LoaderConfig(cache_dir=tmp_path / "cache"))
    assert hit.sources == ("node",)
    filled = Filled((Path("a"), Path("b")), ("origin", "regional"), 2048, 0.5, "ab" * 32)
    assert describe_fill(filled) == (
        "2 file(s), 2048 bytes (1 from origin, 1 from regional) in 0.50 s; "
        "snapshot abababababab ready")


def test_traffic_pairs_become_weights_and_a_malformed_pair_is_refused() -> None:
    assert parse_traffic(["1=90", "2=10"]) == {"1": 90, "2": 10}
    assert parse_traffic([]) == {}
    for bad in ("1:90", "=10", "2=", "2=ten"):
        with pytest.raises(ValueError, match="VERSION=PERCENT"):
            parse_traffic([bad])


def test_status_names_each_version_with_its_share_of_the_traffic() -> None:
    row = {"replicas_running": 1, "replicas_starting": 0, "ongoing": 0, "queued": 0,
           "floor": 1, "last_cold_start": None}
    text = render_status({"app": "a", "ready": True, "deployments": [
        {**row, "deployment": "Embed@2", "group": "Embed", "version": "2", "weight": 10},
        {**row, "deployment": "Other", "group": "Other", "version": "1", "weight": 100}]})
    assert "Embed@2 (v2, 10%)" in text and "Other (" not in text


def _last_line_of_fresh(script: str, **env: str) -> str:
    """``script``'s last printed line, run in a fresh interpreter: this test process has
    imported torch and Ray Serve already."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys\nfrom ember.cli import main\n"
                           + script], capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, **env})
    return done.stdout.split("\n")[-2] if "\n" in done.stdout else done.stdout + done.stderr


def test_http_only_commands_load_neither_torch_nor_ray_serve() -> None:
    # `ember status` against a closed port runs the whole command (parse, call, error)
    # without a server.
    from support import free_port

    last = _last_line_of_fresh(
        f"code = main(['status', '--url', 'http://127.0.0.1:{free_port()}'])\n"
        "heavy = [m for m in ('torch', 'ray.serve', 'transformers') if m in sys.modules]\n"
        "print(code, heavy)\n")
    assert last == "2 []"


def test_cache_commands_and_the_run_driver_do_not_load_torch(tmp_path: Path) -> None:
    # The cache's listings and fills read and write files; `ember run`'s driver deploys apps
    # that may never touch torch. Torch costs them a second of CPU and about 180 MB.
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4)}, str(weights))
    last = _last_line_of_fresh(
        f"codes = [main(['cache', 'warm', {weights.as_uri()!r}]), main(['cache', 'ls']),\n"
        "         main(['snapshot', 'ls'])]\n"
        "import ember.cluster.runtime\n"
        "print(codes, 'torch' in sys.modules)\n", EMBER_CACHE_DIR=str(tmp_path / "cache"))
    assert last == "[0, 0, 0] False"
