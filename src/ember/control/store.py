"""Where the operator's settings live: one key-value store, two places to keep it.

Traffic weights, shadows, rollouts and warm leases are set at run time through the admin
routes. They must outlive the process that serves them, so they are written to a
:class:`Store` before the admin call answers:

* :class:`SqliteStore`, for ``ember run`` on its own embedded cluster: one SQLite file in
  the state directory (``ember run --state-dir``), in WAL mode, each write one transaction
  committed with a full sync. A SIGKILL between two writes loses neither, and a write cut
  short is rolled back by SQLite, never read half-done. Every process of the embedded
  cluster (the edges, the rollout driver, the autoscaling policy in Serve's controller) is
  on this machine and opens the same file, so the file is the only copy: nothing is loaded
  into the cluster at start, and nothing there can drift from it.
* :class:`GcsStore`, when Ember joins a cluster: Ray's internal key-value store in the head's
  GCS, which survives a head restart when the GCS is fault tolerant (backed by Redis; see
  ``k8s.py`` and docs/operator-state.md).

Which one a process uses is written by ``ember run`` into the cluster itself
(:func:`announce`) before anything of the app starts, and read once per process by
:func:`open_store`, so Ray workers need no environment of their own for it.

Both keep a *stamp* that changes on every write: an edge polls it (a read of one small
value) to learn quickly that something changed, and only then re-reads the settings.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from ember import ray_internals
from ember.errors import ConfigError

#: Ray's internal key-value namespace of everything Ember keeps in the GCS.
NAMESPACE = "ember"
#: The file in a state directory.
FILE_NAME = "state.sqlite3"
_STAMP_KEY = "stamp"


class Store(Protocol):
    """A durable key-value store of the operator's settings (keys are plain text)."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None:
        """Store ``value``; durable once this returns."""

    def delete(self, key: str) -> None: ...

    def keys(self, prefix: str) -> list[str]: ...

    def stamp(self) -> str:
        """A value that changes whenever anything is written."""


class SqliteStore:
    """The store in one SQLite file (see the module doc); safe across processes."""

    def __init__(self, path: Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = path
        self._timeout_s = busy_timeout_s
        self._local = threading.local()
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self._write(stamp=False) as db:
                db.execute("CREATE TABLE IF NOT EXISTS kv "
                           "(key TEXT PRIMARY KEY, value BLOB NOT NULL)")
                db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, n INTEGER)")
                db.execute("INSERT OR IGNORE INTO meta VALUES (?, 0)", (_STAMP_KEY,))
            self._db().execute("PRAGMA quick_check").fetchone()
        except sqlite3.OperationalError:  # locked, read-only, no such directory: as it is
            raise
        except sqlite3.DatabaseError as exc:
            # Refuse to serve rather than start over silently: the operator's traffic
            # split or rollout would be lost without a word.
            raise ConfigError(f"the state file {path} cannot be read ({exc}); move it away "
                              f"to start with no saved settings") from None

    def _db(self) -> sqlite3.Connection:
        # One connection per thread: admin calls run in worker threads.
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None or getattr(self._local, "pid", None) != os.getpid():
            db = sqlite3.connect(self.path, timeout=self._timeout_s, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            # FULL: the commit is on disk before the admin call answers, not only in the WAL
            # the OS may still hold.
            db.execute("PRAGMA synchronous=FULL")
            self._local.db, self._local.pid = db, os.getpid()
        return db

    @contextlib.contextmanager
    def _write(self, *, stamp: bool = True) -> Iterator[sqlite3.Connection]:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")  # takes the write lock now: writers queue, never clash
        try:
            yield db
            if stamp:
                db.execute("UPDATE meta SET n = n + 1 WHERE name = ?", (_STAMP_KEY,))
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        """Close this thread's connection (the last one out folds the log into the file)."""
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    def get(self, key: str) -> bytes | None:
        row = self._db().execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return bytes(row[0]) if row else None

    def put(self, key: str, value: bytes) -> None:
        with self._write() as db:
            db.execute("INSERT INTO kv VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET "
                       "value = excluded.value", (key, value))

    def delete(self, key: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM kv WHERE key = ?", (key,))

    def keys(self, prefix: str) -> list[str]:
        escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        rows = self._db().execute("SELECT key FROM kv WHERE key LIKE ? ESCAPE '\\' ORDER BY key",
                                  (escaped + "%",)).fetchall()
        return [str(r[0]) for r in rows]

    def stamp(self) -> str:
        row = self._db().execute("SELECT n FROM meta WHERE name = ?", (_STAMP_KEY,)).fetchone()
        return str(row[0]) if row else "0"


class GcsStore:
    """The store in Ray's internal key-value store (the head's GCS)."""

    def get(self, key: str) -> bytes | None:
        raw = ray_internals.kv_get(key, namespace=NAMESPACE)
        return bytes(raw) if raw is not None else None

    def put(self, key: str, value: bytes) -> None:
        ray_internals.kv_put(key, value, namespace=NAMESPACE)
        self._touch()

    def delete(self, key: str) -> None:
        ray_internals.kv_delete(key, namespace=NAMESPACE)
        self._touch()

    def keys(self, prefix: str) -> list[str]:
        found = ray_internals.kv_list(prefix, namespace=NAMESPACE)
        return sorted(k.decode() if isinstance(k, bytes) else str(k) for k in found)

    def stamp(self) -> str:
        raw = self.get(f"state-{_STAMP_KEY}")
        return raw.decode() if raw else "0"

    def _touch(self) -> None:
        # Unique enough without a read-modify-write: only "changed" matters.
        value = f"{time.time_ns()}-{os.getpid()}-{threading.get_ident()}".encode()
        ray_internals.kv_put(f"state-{_STAMP_KEY}", value, namespace=NAMESPACE)


def _pointer_key(app: str) -> str:
    return f"state-dir:{app}"


def default_state_dir(app: str, environ: dict[str, str] | None = None) -> Path:
    """``$XDG_DATA_HOME/ember/<app>``, else ``~/.local/share/ember/<app>``."""
    env = os.environ if environ is None else environ
    base = Path(env["XDG_DATA_HOME"]) if env.get("XDG_DATA_HOME") else (
        Path.home() / ".local" / "share")
    return base / "ember" / app


def announce(app: str, state_dir: Path | None) -> None:
    """Tell every process of the cluster where ``app``'s settings live (None: the GCS).

    Opens the store once here, so a directory that cannot hold it fails ``ember run`` at
    start rather than the first admin call.
    """
    if state_dir is None:
        ray_internals.kv_delete(_pointer_key(app), namespace=NAMESPACE)
    else:
        SqliteStore(state_dir / FILE_NAME)
        ray_internals.kv_put(_pointer_key(app), str(state_dir.resolve()).encode(),
                             namespace=NAMESPACE)
    _opened.pop(app, None)


_opened: dict[str, Store] = {}
_lock = threading.Lock()


def open_store(app: str) -> Store:
    """``app``'s store in this process, as ``ember run`` announced it (see the module doc)."""
    with _lock:
        store = _opened.get(app)
        if store is None:
            raw = ray_internals.kv_get(_pointer_key(app), namespace=NAMESPACE)
            store = SqliteStore(Path(raw.decode()) / FILE_NAME) if raw else GcsStore()
            _opened[app] = store
        return store
