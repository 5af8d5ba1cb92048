"""The node's memory ledger: loads starting at once count each other's bytes as taken.

Each claim here is held by a real process of its own (the way two replicas on one node
hold theirs), started with ``python -c`` and stopped by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from ember.deployments.causal_lm import load_causal_lm
from ember.errors import InsufficientMemory
from ember.loaders import LoaderConfig, reservations, wait_for_cache_writes, weights_bytes
from ember.loaders.reservations import FOLDER, claim, claimed_bytes

from support import bench_module, wait_for

# Says "ready" and waits for the file ``go`` (when given one), claims BYTES of FREE, says
# "ok" or "refused", and holds an accepted claim until its stdin closes.
HOLDER = """
import pathlib, sys, time
from ember.errors import InsufficientMemory
from ember.loaders.reservations import claim
root, size, free, go = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if go:
    print("ready", flush=True)
while go and not pathlib.Path(go).exists():
    time.sleep(0.001)
try:
    with claim(root, size, free_bytes=free, what="holder"):
        print("ok", flush=True)
        sys.stdin.readline()
except InsufficientMemory as exc:
    print("refused", exc, flush=True)
"""


class Holders:
    def __init__(self, root: Path) -> None:
        self.root, self.procs = root, list[subprocess.Popen[str]]()

    def start(self, size: int, free: int, go: Path | None = None) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(self.root), str(size),
                                 str(free), str(go or "")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def hold(self, size: int, free: int) -> subprocess.Popen[str]:
        proc = self.start(size, free)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ok"
        return proc

    @staticmethod
    def release(proc: subprocess.Popen[str]) -> None:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[Holders]:
    found = Holders(tmp_path / "node")
    try:
        yield found
    finally:
        found.stop_all()


def test_a_load_beside_a_live_claim_is_refused_and_fits_once_it_is_released(
        holders: Holders) -> None:
    first = holders.hold(600, free=1000)
    assert claimed_bytes(holders.root) == 600
    with pytest.raises(InsufficientMemory) as caught, \
            claim(holders.root, 600, free_bytes=1000, what="second"):
        pass
    assert caught.value.status_code == 503
    assert "beside 600 bytes that 1 other load starting on this node has claimed" \
        in str(caught.value)
    with claim(holders.root, 400, free_bytes=1000, what="small"):  # what is left fits
        assert claimed_bytes(holders.root) == 1000
    holders.release(first)
    assert claimed_bytes(holders.root) == 0
    with claim(holders.root, 600, free_bytes=1000, what="second"):
        pass


def test_of_loads_starting_at_the_same_moment_only_those_that_fit_start(
        holders: Holders, tmp_path: Path) -> None:
    go = tmp_path / "go"
    started = [holders.start(600, 1000, go) for _ in range(4)]
    # Every one waits at the line before it claims, then all go at once.
    assert all(p.stdout is not None and p.stdout.readline().strip() == "ready" for p in started)
    go.touch()
    answers = [p.stdout.readline().split()[0] for p in started if p.stdout is not None]
    assert sorted(answers) == ["ok", "refused", "refused", "refused"], answers


def test_a_claim_of_a_killed_process_is_not_counted_and_is_removed(holders: Holders) -> None:
    killed = holders.hold(600, free=1000)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    with claim(holders.root, 600, free_bytes=1000, what="after the kill"):
        assert claimed_bytes(holders.root) == 600  # its own claim only
    assert not list((holders.root / FOLDER).glob("*/*.json"))


def test_a_claim_of_a_zombie_or_of_a_pid_given_again_is_not_counted(
        holders: Holders) -> None:
    zombie = holders.hold(300, free=1000)
    os.kill(zombie.pid, signal.SIGKILL)  # not waited for: a zombie, its memory freed
    wait_for(lambda: Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
             == "Z", 20, what="the zombie")
    live = holders.hold(200, free=1000)
    folder = next((holders.root / FOLDER).iterdir())
    doc = json.loads(next(folder.glob(f"{live.pid}-*.json")).read_text())
    # This very PID, as if the kernel had given it to a new process: another start.
    (folder / f"{live.pid}-again.json").write_text(json.dumps(
        {**doc, "start_ticks": doc["start_ticks"] - 1, "bytes": 400}))
    assert claimed_bytes(holders.root) == 200  # the live holder's only
    zombie.wait(timeout=30)


def test_without_proc_the_plain_check_stands(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a system with no /proc/<pid>/stat: a load is still checked, never failed.
    monkeypatch.setattr(reservations, "_start_ticks", lambda pid: None)
    with claim(tmp_path, 600, free_bytes=1000, what="no proc"):
        pass
    with pytest.raises(InsufficientMemory), claim(tmp_path, 1200, free_bytes=1000, what="big"):
        pass


def test_a_causal_lm_load_counts_the_claims_of_loads_under_way(
        holders: Holders, tmp_path: Path) -> None:
    ladder: ModuleType = bench_module("model_ladder")
    tiny = ladder.write_checkpoint(ladder.LADDER["tiny"], tmp_path / "tiny")
    config = LoaderConfig(cache_dir=holders.root)
    size = weights_bytes(tiny.as_uri(), "", config)
    other = holders.hold(1000, free=10**12)  # another replica's load, under way
    with pytest.raises(InsufficientMemory) as caught:
        load_causal_lm(tiny.as_uri(), config=config, free_bytes=size + 999)
    assert "1000 bytes that 1 other load" in str(caught.value)
    assert not list(holders.root.glob("*/blobs/*")), "weights were fetched before the refusal"
    holders.release(other)
    _, report = load_causal_lm(tiny.as_uri(), config=config, free_bytes=size + 999)
    assert report.weights_bytes == size
    assert wait_for_cache_writes(timeout_s=60)  # its fill sealed: no write left to later tests
    wait_for(lambda: claimed_bytes(holders.root) == 0, 10, what="the load's claim released")
