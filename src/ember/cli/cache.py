"""``ember cache``: warm, list, verify and evict the node cache; measure its limits.

The main ``ember`` command adds these with :func:`register`; every subcommand sets
``func(args) -> int`` (the exit code).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.cli.cache_fill import fill
from ember.errors import EmberError, UnsafePath

if TYPE_CHECKING:
    from ember.loaders import CacheEntry, LoaderConfig, NodeTier

_KEY = re.compile(r"^[0-9a-f]{8,64}$")


def add_cache_dir_option(parser: argparse.ArgumentParser) -> None:
    """``--cache-dir``, shared by every command that reads this node's cache."""
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="node cache directory (default: EMBER_CACHE_DIR or ~/.cache/ember)",
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``cache`` command and its subcommands to ``subparsers``.

    Args:
        subparsers: the main parser's subcommand action.

    Example:
        >>> parser = argparse.ArgumentParser(prog="ember")
        >>> register(parser.add_subparsers())
        >>> args = parser.parse_args(["cache", "ls"])
        >>> args.func.__name__
        'cmd_ls'
    """
    cache = subparsers.add_parser("cache", help="manage the weights cache")
    add_cache_dir_option(cache)
    sub = cache.add_subparsers(dest="cache_command", required=True)
    warm = sub.add_parser("warm", help="prefetch a URL into the regional and node caches")
    warm.add_argument("url")
    warm.add_argument(
        "--regional", default=None, help="regional cache URL (default: EMBER_REGIONAL_CACHE)"
    )
    warm.add_argument(
        "--snapshot",
        metavar="CODE_VERSION",
        default=None,
        help="also record this node's snapshot for a deployment's code version (e.g. the "
        "flagship's ember.deployments.embeddings.CODE_VERSION), so replicas map it at once",
    )
    warm.add_argument(
        "--all-nodes",
        action="store_true",
        help="fill every alive node of the Ray cluster (RAY_ADDRESS), one task per node; "
        "exits 1 naming the nodes that failed",
    )
    warm.set_defaults(func=cmd_warm)
    sub.add_parser("ls", help="list cached blobs").set_defaults(func=cmd_ls)
    verify = sub.add_parser("verify", help="re-hash every blob; remove corrupted ones")
    verify.set_defaults(func=cmd_verify)
    evict = sub.add_parser("evict", help="remove one blob (by sha256 prefix) or all")
    which = evict.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="remove every blob")
    which.add_argument("key", nargs="?", help="sha256 (or a unique prefix of >= 8 chars)")
    evict.set_defaults(func=cmd_evict)
    bench = sub.add_parser(
        "bench", help="measure this node's load limits; show recent loads' GB/s beside them")
    bench.add_argument("--size-mb", type=int, default=512,
                       help="scratch file size for the disk and page-cache reads (MB)")
    bench.add_argument("--loads", type=int, default=10, help="recent loads to show")
    bench.set_defaults(func=cmd_bench)


# ember.loaders brings torch (a second of CPU): imported by the commands that load, so that
# `ember --help` and the HTTP-only commands answer at once (tests/unit/test_cli.py).
def _node(args: argparse.Namespace) -> NodeTier:
    from ember.loaders import NodeTier

    return NodeTier(_config(args))


def _config(args: argparse.Namespace, **extra: Any) -> LoaderConfig:
    from ember.loaders import LoaderConfig

    return LoaderConfig(cache_dir=args.cache_dir, **extra)


def _guard(args: argparse.Namespace, run: Any) -> int:
    try:
        code: int = run(args)
    except EmberError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return code


def cmd_warm(args: argparse.Namespace) -> int:
    """Fill the regional and node tiers for ``args.url`` with a progress bar."""
    return _guard(args, _warm)


def _warm(args: argparse.Namespace) -> int:
    if args.all_nodes:
        from ember.cli.cache_nodes import warm_all_nodes

        return warm_all_nodes(args.url, cache_dir=args.cache_dir, regional=args.regional,
                              snapshot=args.snapshot)
    from tqdm import tqdm  # no stubs; ships with huggingface-hub

    with tqdm(unit="B", unit_scale=True, desc="warm", file=sys.stderr) as bar:
        state = {"done": 0}

        def progress(done: int, total: int) -> None:
            if done < state["done"]:  # the next file started
                state["done"] = 0
                bar.total = (bar.total or 0) + total
            elif bar.total is None:
                bar.total = total
            bar.update(done - state["done"])
            state["done"] = done

        filled = fill(args.url, cache_dir=args.cache_dir, regional=args.regional,
                      snapshot=args.snapshot, progress=progress)
    for path in filled.paths:
        print(path)
    if filled.snapshot_key is not None:
        print(f"snapshot {filled.snapshot_key[:12]} ({filled.total_bytes} bytes) ready on "
              "this node")
    return 0


def _row(entry: CacheEntry) -> str:
    used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used_s))
    names = ",".join(entry.names) or "-"
    return f"{entry.sha256[:12]}  {entry.size:>14}  {used}  {entry.namespace}  {names}"


def cmd_ls(args: argparse.Namespace) -> int:
    """Print one line per cached blob: key, bytes, last use, namespace, names."""

    def run(a: argparse.Namespace) -> int:
        entries = sorted(_node(a).entries(), key=lambda e: -e.last_used_s)
        for entry in entries:
            print(_row(entry))
        print(f"{len(entries)} blobs, {sum(e.size for e in entries)} bytes")
        return 0

    return _guard(args, run)


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hash every blob; remove the ones that do not match (exit 1 if any)."""

    def run(a: argparse.Namespace) -> int:
        node = _node(a)
        bad = 0
        for entry in node.entries():
            blob = node.root / entry.namespace / "blobs" / entry.sha256
            digest = hashlib.sha256()
            with open(blob, "rb") as f:
                while chunk := f.read(8 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != entry.sha256:
                node.remove(entry.namespace, entry.sha256)
                print(f"corrupted, removed: {entry.sha256[:12]} ({entry.namespace})")
                bad += 1
        print(f"{bad} corrupted blob(s) removed" if bad else "all blobs verified")
        return 1 if bad else 0

    return _guard(args, run)


def cmd_evict(args: argparse.Namespace) -> int:
    """Remove every blob (``--all``) or the one whose sha256 starts with ``KEY``."""

    def run(a: argparse.Namespace) -> int:
        node = _node(a)
        entries = node.entries()
        if not a.all:
            if not _KEY.match(a.key or ""):
                raise UnsafePath(name=a.key, reason="expected a sha256 prefix of 8-64 hex chars")
            entries = [e for e in entries if e.sha256.startswith(a.key)]
            if len(entries) != 1:
                print(f"{len(entries)} blobs match {a.key!r}; nothing removed", file=sys.stderr)
                return 1
        for entry in entries:
            node.remove(entry.namespace, entry.sha256)
        print(f"removed {len(entries)} blob(s)")
        return 0

    return _guard(args, run)


def _huge_pages(config: LoaderConfig) -> str:
    """Whether blobs are mapped in 2 MiB pages here, and why: it decides what every start
    on a warm page cache pays to map the weights (``LoaderConfig.huge_pages``)."""
    state = "on" if config.maps_huge() else "off"
    if config.huge_pages != "auto":
        return f"{state} (set)"
    if state == "off":  # auto turns it off for one reason only
        return "off (auto: this machine's balloon reports free pages; cold reads come first)"
    return "on (auto)"


def cmd_bench(args: argparse.Namespace) -> int:
    """``ember cache bench``: the node's limits, then each recent load against its limit."""

    def run(a: argparse.Namespace) -> int:
        from ember.loaders.limits import local_limits, path_of, recent_loads, regional_limit

        config = _config(a)
        root = config.node_root()
        limits = local_limits(root, a.size_mb << 20)
        regional = regional_limit(config)
        if regional is not None:
            limits["regional_gbps"] = regional
        for name, value in limits.items():
            print(f"{name:<18} {value:8.2f} GB/s")
        print(f"{'huge_pages':<18} {_huge_pages(config)}")
        against = {"page_cache": "page_cache_gbps", "disk": "disk_cold_gbps",
                   "fill": "regional_gbps"}
        loads = recent_loads(root, a.loads)
        if loads:
            print(f"\n{'load':<44} {'GB':>6} {'s':>7} {'GB/s':>6} {'path':<10} share of limit")
        for entry in loads:
            gbps = entry["bytes"] / max(entry["seconds"], 1e-9) / 1e9
            path = path_of(entry)
            limit = limits.get(against[path])
            share = f"{gbps / limit:.2f}" if limit else "-"
            print(f"{str(entry['url'])[-44:]:<44} {entry['bytes'] / 1e9:6.2f} "
                  f"{entry['seconds']:7.2f} {gbps:6.2f} {path:<10} {share}")
        return 0

    return _guard(args, run)
