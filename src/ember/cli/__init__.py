"""The ``ember`` command line: one parser, each subcommand family in a module of its own.

``serve`` (run, status, warm, traffic, shadow, plan), ``rollout`` (rollout, rollback),
``cache`` (warm, ls, verify, evict), ``snapshot`` (ls, drop), ``batch`` (the offline shift)
and ``deploy`` (a Kubernetes manifest). Each module exposes ``register(subparsers)``; every
subcommand sets ``func(args) -> int``, the exit code.
"""

from __future__ import annotations

import sys

from ember.cli._signals import STOP

if sys.argv[1:2] == ["run"]:
    # Before the imports below (seconds: Ray, torch): a SIGTERM during them must drain.
    STOP.install()

import argparse

from ember.cli import batch, cache, deploy, rollout, serve, snapshot
from ember.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    """The ``ember`` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="ember", description="Serverless model serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    for family in (serve, rollout, cache, snapshot, batch, deploy):
        family.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ember`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "main"]
