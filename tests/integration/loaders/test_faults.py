"""Process-level faults: kill -9 mid-fill, many processes on one blob, a write that fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ember.loaders import LoaderConfig, load

from loaders.origins import SRC_DIR, HttpOrigin, make_weights, subprocess_env

# The children exercise only the loader. The ``ember`` package's __init__ imports the
# serving stack (ray); eight processes importing it at once on two cores take a minute, so
# the children register a bare ``ember`` package and import ``ember.loaders`` alone.
CHILD = f"""
import json, sys, threading, types
pkg = types.ModuleType("ember")
pkg.__path__ = [{str(Path(SRC_DIR) / "ember")!r}]
sys.modules["ember"] = pkg
from ember.loaders import LoaderConfig, load, resolve
cfg = LoaderConfig.model_validate_json(sys.argv[2])
"""


def _child(code: str, url: str, config: LoaderConfig, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD + code, url, config.model_dump_json(), *extra],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _published(config: LoaderConfig) -> list[Path]:
    return list(Path(str(config.cache_dir)).glob("*/blobs/[0-9a-f]*"))


def test_kill_9_mid_fill_leaves_a_miss_and_the_next_load_succeeds(
    http_origin: HttpOrigin, tmp_path: Path, config: LoaderConfig
) -> None:
    path = tmp_path / "w" / "model.safetensors"
    tensors = make_weights(path, n=32)
    url = http_origin.put("model.safetensors", path.read_bytes())
    http_origin.delay_s = 0.1  # a slow origin: 32 ranges take seconds
    proc = _child("load(sys.argv[1], config=cfg)\nprint('finished')", url, config)
    deadline = time.monotonic() + 60
    while len(http_origin.ranged_gets("model.safetensors")) < 6:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    temps = list(Path(str(config.cache_dir)).glob("*/blobs/.tmp-*"))
    assert temps, "the fill should be writing its temp file"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert _published(config) == []  # no truncated blob, no marker, no link
    assert list(Path(str(config.cache_dir)).glob("*/snapshots/*/*")) == []
    http_origin.delay_s = 0.0
    start = time.monotonic()
    got = load(url, config=config)  # the dead holder's lease is taken over at once
    assert time.monotonic() - start < config.lease_timeout_s
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert not any(t.exists() for t in temps)
    assert len(_published(config)) == 1


WORKER = """
import os, time
ready, go = sys.argv[3], sys.argv[4]
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.005)
out = []
def run():
    # resolve() fills the node cache exactly as load() does, without importing torch.
    out.append(str(resolve(sys.argv[1], config=cfg).paths[0].resolve()))
threads = [threading.Thread(target=run) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_8_processes_x_4_threads_make_one_origin_fetch(
    http_origin: HttpOrigin, tmp_path: Path, config: LoaderConfig
) -> None:
    path = tmp_path / "w" / "model.safetensors"
    tensors = make_weights(path, n=16)
    url = http_origin.put("model.safetensors", path.read_bytes())
    http_origin.delay_s = 0.05  # long enough that every process arrives during the fill
    go = tmp_path / "go"
    procs = [_child(WORKER, url, config, str(tmp_path / f"ready{i}"), str(go)) for i in range(8)]
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"ready{i}").exists() for i in range(8)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.02)
    go.touch()
    outputs = [p.communicate(timeout=90) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    blobs = {b for out, _ in outputs for b in json.loads(out)}
    assert len(blobs) == 1 and Path(blobs.pop()).read_bytes() == path.read_bytes()
    got = load(url, config=config)  # and the blob they share maps to the right tensors
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    gets = http_origin.ranged_gets("model.safetensors")
    assert gets.count("bytes=0-7") == 1  # one fill read the header...
    assert len(gets) == len(set(gets))  # ...and no byte range was fetched twice
    assert len(_published(config)) == 1


FSIZE = """
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    load(sys.argv[1], config=cfg)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_a_failing_cache_write_leaves_no_leftovers(tmp_path: Path, config: LoaderConfig) -> None:
    path = tmp_path / "w" / "model.safetensors"
    make_weights(path, n=8)
    # The kernel refuses writes past RLIMIT_FSIZE the way a full disk refuses them.
    proc = _child(FSIZE, path.as_uri(), config, str(path.stat().st_size // 2))
    out, err = proc.communicate(timeout=60)
    assert out.startswith("CacheFull"), (out, err)
    assert list(Path(str(config.cache_dir)).glob("*/blobs/*")) == []
    assert list(Path(str(config.cache_dir)).glob(".locks/*.lease")) == []
    assert list(Path(str(config.cache_dir)).glob("*/markers/*")) == []
