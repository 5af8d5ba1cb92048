"""The fit check's memory: the host's, or a memory cgroup's headroom where it is nearer.

The cgroup trees here are folders laid out as the kernel's are (v1 and v2); the last test
reads this machine's own.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from ember.deployments import causal_lm
from ember.errors import InsufficientMemory
from ember.loaders import memory
from ember.loaders.memory import available_bytes, cgroup_headroom_bytes
from ember.loaders.reservations import check_fits

GIB = 1 << 30


def _v2(root: Path, path: str, *, limit: str, current: int, file_bytes: int = 0) -> Path:
    (root / "cgroup.controllers").parent.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    folder = root / path.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.max").write_text(f"{limit}\n")
    (folder / "memory.current").write_text(f"{current}\n")
    (folder / "memory.stat").write_text(
        f"anon 1\nactive_file {file_bytes // 2}\ninactive_file {file_bytes - file_bytes // 2}\n")
    return folder


def _proc(tmp_path: Path, text: str) -> Path:
    proc = tmp_path / "cgroup"
    proc.write_text(text)
    return proc


def test_a_pods_limit_under_the_hosts_free_memory_is_what_a_replica_can_have(
        tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _v2(root, "/kubepods/pod1/c1", limit=str(16 * GIB), current=10 * GIB, file_bytes=2 * GIB)
    proc = _proc(tmp_path, "0::/kubepods/pod1/c1\n")
    # 16 GiB limit, 10 GiB used of which 2 GiB is page cache the kernel reclaims first.
    assert cgroup_headroom_bytes(proc_cgroup=proc, root=root) == 8 * GIB
    assert available_bytes(proc_cgroup=proc, root=root, host_bytes=200 * GIB) == 8 * GIB
    assert available_bytes(proc_cgroup=proc, root=root, host_bytes=3 * GIB) == 3 * GIB


def test_the_tightest_ancestor_wins_and_max_is_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _v2(root, "/kubepods/pod1", limit=str(4 * GIB), current=1 * GIB)
    _v2(root, "/kubepods/pod1/c1", limit="max", current=1 * GIB)
    proc = _proc(tmp_path, "0::/kubepods/pod1/c1\n")
    assert cgroup_headroom_bytes(proc_cgroup=proc, root=root) == 3 * GIB
    _v2(root, "/kubepods/pod1", limit="max", current=1 * GIB)
    assert cgroup_headroom_bytes(proc_cgroup=proc, root=root) is None


def test_cgroup_v1_reads_its_own_files_and_its_unlimited_value(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    folder = root / "memory" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (folder / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (folder / "memory.stat").write_text(f"cache 5\ntotal_active_file {GIB // 4}\n"
                                        f"total_inactive_file {GIB // 4}\n")
    proc = _proc(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_headroom_bytes(proc_cgroup=proc, root=root) == GIB + GIB // 2
    (folder / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_headroom_bytes(proc_cgroup=proc, root=root) is None


def test_the_load_is_refused_by_the_pods_limit_though_the_host_has_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "fs"
    _v2(root, "/pod", limit=str(GIB), current=GIB - 1000)
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    monkeypatch.setattr(memory, "PROC_CGROUP", _proc(tmp_path, "0::/pod\n"))
    with pytest.raises(InsufficientMemory) as caught:
        check_fits(1 << 20, causal_lm.free_memory_bytes(), what="llama")
    assert caught.value.fields["free_bytes"] == 1000


def test_this_machine_is_read_without_error() -> None:
    headroom = cgroup_headroom_bytes()
    assert headroom is None or headroom >= 0
    assert 0 < available_bytes() <= psutil.virtual_memory().total
