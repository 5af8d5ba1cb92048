"""The operator's settings store on disk: durable, atomic, never half-read, shared safely.

Each test that is about a crash makes a real one: a writer process is SIGKILLed, not mocked.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ember.control.store import FILE_NAME, SqliteStore, default_state_dir
from ember.errors import ConfigError

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _python(code: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, text=True)


def test_values_keys_and_deletes_round_trip(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / FILE_NAME)
    store.put("traffic:app:Embed", b'{"1": 80, "2": 20}')
    store.put("traffic:app:Other", b"{}")
    store.put("traffic:apps:Embed", b"x")  # another app whose name extends this one's
    store.put("traffic:a%p_p:X", b"y")  # LIKE's wildcards are plain characters in a prefix
    assert store.get("traffic:app:Embed") == b'{"1": 80, "2": 20}'
    assert store.keys("traffic:app:") == ["traffic:app:Embed", "traffic:app:Other"]
    assert store.keys("traffic:a%p_p:") == ["traffic:a%p_p:X"]
    store.delete("traffic:app:Other")
    assert store.get("traffic:app:Other") is None
    assert store.keys("traffic:app:") == ["traffic:app:Embed"]


def test_every_write_moves_the_stamp(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / FILE_NAME)
    seen = {store.stamp()}
    for i in range(3):
        store.put("k", str(i).encode())
        seen.add(store.stamp())
    store.delete("k")
    seen.add(store.stamp())
    assert len(seen) == 5


def test_a_write_is_on_disk_when_put_returns_even_if_the_writer_is_killed(
        tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    writer = _python(f"""
        import sys, time
        from pathlib import Path
        from ember.control.store import SqliteStore
        SqliteStore(Path({str(path)!r})).put("traffic:app:Embed", b"80/20")
        print("written", flush=True)
        time.sleep(60)
    """)
    assert writer.stdout is not None and writer.stdout.readline().strip() == "written"
    writer.send_signal(signal.SIGKILL)  # no close, no checkpoint: only what put() committed
    writer.wait(timeout=30)
    assert SqliteStore(path).get("traffic:app:Embed") == b"80/20"


def test_a_writer_killed_inside_its_transaction_leaves_the_old_value(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    SqliteStore(path).put("traffic:app:Embed", b"old")
    writer = _python(f"""
        import time
        from pathlib import Path
        from ember.control.store import SqliteStore
        store = SqliteStore(Path({str(path)!r}))
        with store._write() as db:
            db.execute("UPDATE kv SET value = ? WHERE key = ?", (b"new", "traffic:app:Embed"))
            print("mid-write", flush=True)
            time.sleep(60)
    """)
    assert writer.stdout is not None and writer.stdout.readline().strip() == "mid-write"
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    store = SqliteStore(path)  # the dead writer's lock is gone: writes go on
    assert store.get("traffic:app:Embed") == b"old"
    store.put("traffic:app:Embed", b"next")
    assert store.get("traffic:app:Embed") == b"next"


def test_a_commit_cut_short_on_disk_is_never_read(tmp_path: Path) -> None:
    """A torn last commit (the log's tail half-written, as a power cut leaves it) is
    ignored: the reader sees the commit before it, whole."""
    path = tmp_path / FILE_NAME
    writer = _python(f"""
        import time
        from pathlib import Path
        from ember.control.store import SqliteStore
        store = SqliteStore(Path({str(path)!r}))
        store.put("rollout:app:Embed", b"step 1" * 100)
        print("first", flush=True)
        store.put("rollout:app:Embed", b"step 2" * 100)
        print("second", flush=True)
        time.sleep(60)
    """)
    assert writer.stdout is not None
    assert [writer.stdout.readline().strip() for _ in range(2)] == ["first", "second"]
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    wal = path.with_name(path.name + "-wal")
    size = wal.stat().st_size
    with wal.open("r+b") as log:  # cut into the last frame: the second commit's
        log.truncate(size - 100)
    assert SqliteStore(path).get("rollout:app:Embed") == b"step 1" * 100


def test_a_damaged_file_is_refused_not_started_over(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    store = SqliteStore(path)
    store.put("traffic:app:Embed", b"80/20")
    store.close()
    data = bytearray(path.read_bytes())
    data[:16] = b"not a database!!"
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"cannot be read.*move it away"):
        SqliteStore(path)
    assert path.read_bytes()[:16] == b"not a database!!"  # left for the operator to look at


def _hammer(path: str, writer: int, count: int) -> None:
    store = SqliteStore(Path(path))
    for i in range(count):
        store.put(f"lease:app:w{writer}-{i}", b"x")
        store.put("traffic:app:Embed", f"{writer}-{i}".encode())


def test_concurrent_writers_in_many_processes_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    store = SqliteStore(path)
    start = int(store.stamp())
    writers, count = 4, 50
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_hammer, args=(str(path), w, count)) for w in range(writers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    assert len(store.keys("lease:app:")) == writers * count
    assert int(store.stamp()) - start == 2 * writers * count
    last = (store.get("traffic:app:Embed") or b"").decode()
    assert last.endswith(f"-{count - 1}")


def test_the_default_state_dir_follows_xdg(tmp_path: Path) -> None:
    assert default_state_dir("app", {"XDG_DATA_HOME": str(tmp_path)}) == tmp_path / "ember" / "app"
    assert default_state_dir("app", {}) == Path.home() / ".local" / "share" / "ember" / "app"
