"""``ember snapshot``: list and drop this node's weight snapshots.

Every subcommand sets ``func(args) -> int`` (the exit code: 0 done, 1 nothing matched,
2 an error); the functions behind them are :mod:`ember.loaders`' snapshot API.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ember.cli.cache import add_cache_dir_option
from ember.errors import EmberError

if TYPE_CHECKING:
    from ember.loaders import LoaderConfig, SnapshotInfo

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``snapshot`` command (``ls``, ``drop``) to ``subparsers``.

    Args:
        subparsers: the main parser's subcommand action.

    Example:
        >>> parser = argparse.ArgumentParser(prog="ember")
        >>> register(parser.add_subparsers())
        >>> parser.parse_args(["snapshot", "drop", "--all"]).func.__name__
        'cmd_drop'
    """
    snap = subparsers.add_parser("snapshot", help="manage weight snapshots on this node")
    add_cache_dir_option(snap)
    sub = snap.add_subparsers(dest="snapshot_command", required=True)
    ls = sub.add_parser("ls", help="list snapshots: size, bytes in the page cache, last use")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=cmd_ls)
    drop = sub.add_parser("drop", help="forget snapshots (their blobs stay in the cache)")
    which = drop.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="forget every snapshot")
    which.add_argument("key_prefix", nargs="?", help="a snapshot key or a prefix of it")
    drop.set_defaults(func=cmd_drop)


def _config(args: argparse.Namespace) -> LoaderConfig:
    from ember.loaders import LoaderConfig  # torch: see cache.py

    return LoaderConfig(cache_dir=args.cache_dir)


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{n} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def _row(info: SnapshotInfo) -> tuple[str, ...]:
    used = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.last_used_at))
    sizes = _size(info.total_bytes), _size(info.resident_bytes)
    return (info.key[:12], info.url, info.code_version or "-", *sizes, used)


def _table(infos: list[SnapshotInfo], cap: int | None) -> list[str]:
    head: tuple[str, ...] = ("KEY", "URL", "CODE_VERSION", "SIZE", "RESIDENT", "LAST_USED")
    rows = [head, *(_row(info) for info in infos)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    resident = _total(i.resident_bytes for i in infos)
    limit = "unlimited" if cap is None else _size(cap)
    total = _size(sum(i.total_bytes for i in infos))
    lines.append(f"{len(infos)} snapshot(s), {total}, {_size(resident)} resident, cap {limit}")
    return lines


def _total(values: Iterable[int | None]) -> int | None:
    total: int | None = 0
    for value in values:
        total = None if value is None or total is None else total + value
    return total


def cmd_ls(args: argparse.Namespace) -> int:
    """Print every snapshot (a table with a total line, or ``--json``); exit 0."""
    from ember.loaders import list_snapshots, max_snapshot_bytes_from_env  # torch: see cache.py

    try:
        cap = max_snapshot_bytes_from_env()
        infos = list_snapshots(_config(args))
    except EmberError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = {
            "snapshots": [dataclasses.asdict(i) for i in infos],
            "total_bytes": sum(i.total_bytes for i in infos),
            "resident_bytes": _total(i.resident_bytes for i in infos),
            "max_snapshot_bytes": cap,
        }
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(_table(infos, cap)))
    return 0


def cmd_drop(args: argparse.Namespace) -> int:
    """Forget the snapshots matching ``KEY_PREFIX`` (or ``--all``); exit 1 if none matched."""
    from ember.loaders import drop_all, drop_snapshot  # torch: see cache.py

    try:
        if args.all:
            count = drop_all(config=_config(args))
        else:
            count = drop_snapshot(args.key_prefix, config=_config(args))
    except EmberError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if count == 0:
        which = args.key_prefix or "--all"
        print(f"no snapshot matches {which!r}; nothing dropped", file=sys.stderr)
        return 1
    print(f"dropped {count} snapshot(s)")
    return 0
