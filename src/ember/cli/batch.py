"""``ember batch``: map a deployment's batch handler over a dataset (see ``offline.py``).

``register(subparsers)`` adds the subcommand to Ember's CLI; ``python -m
ember.cli.batch batch ...`` runs it alone. Exit status: 0 when the job is
complete (bad rows included, they are in ``errors.jsonl``), 1 when the job failed (finished
shards stay; ``--resume`` goes on from them), 2 for a usage, option or input error (an output
that already holds a job without ``--resume`` included).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ember import settings
from ember.errors import ConfigError, EmberError, RequestError

_EPILOG = """\
examples:
  ember batch ember.deployments.embeddings:app --input corpus.jsonl --output out/
  ember batch app.py:app:Embedder -i s3://bucket/docs/ -o s3://bucket/vectors/ --concurrency 4
  ember batch app.py:app --input data.csv --output out/ --resume
  ember batch app.py:app -i q.parquet -o out/ --share-with-online http://127.0.0.1:8000

Output: one Parquet file per shard (id, row_index, result columns), bad rows in
errors.jsonl, _SUCCESS.json when every shard is done. Exit status: 0 done, 1 job failed
(run again with --resume), 2 usage or input error.
"""


def register(subparsers: Any) -> None:
    """Add the ``batch`` subcommand to an argparse ``subparsers`` object.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers()`` returned.
    """
    parser = subparsers.add_parser(
        "batch", help="map a deployment's batch handler over a dataset (Ray Data)",
        description="Map a deployment's batch handler over JSONL, CSV or Parquet inputs,"
        " writing one output file per shard; resumable.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="module:app[:Deployment] or path/to/file.py:app")
    parser.add_argument("-i", "--input", action="append", required=True,
                        help="file, directory, glob or fsspec URL; repeat for more")
    parser.add_argument("-o", "--output", required=True, help="output directory or fsspec URL")
    parser.add_argument("--attr", help="handler to map, when the deployment has several")
    parser.add_argument("--resume", action="store_true",
                        help="finish the job in --output, redoing only unfinished shards")
    _add_job_options(parser)
    _add_share_options(parser)
    parser.set_defaults(func=cmd_batch)


def _add_job_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, help="most items per handler call (256)")
    parser.add_argument("--concurrency", type=int, help="workers, one replica each (1)")
    parser.add_argument("--shard-rows", type=int, help="rows per shard and output file (5000)")
    parser.add_argument("--column", dest="input_column",
                        help="input column of the item (default: text)")
    parser.add_argument("--id-column", help="column copied to the output id (default: id)")
    parser.add_argument("--input-format", choices=["jsonl", "csv", "parquet"],
                        help="default: from each file's extension")
    parser.add_argument("--output-format", choices=["parquet", "jsonl"], help="(parquet)")
    parser.add_argument("--max-item-bytes", type=int, help="larger rows are bad rows (1 MiB)")
    parser.add_argument("--max-batch-bytes", type=int, help="input bytes per call (64 MiB)")
    parser.add_argument("--num-cpus", type=float, help="CPUs per worker (the deployment's)")
    parser.add_argument("--num-gpus", type=float, help="GPUs per worker (the deployment's)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar (default: when stderr is a terminal)")


def _add_share_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sharing replicas with online traffic")
    group.add_argument("--share-with-online", metavar="URL",
                       help="send batches through the deployment served at URL, online first"
                       " (needs RAY_ADDRESS of that cluster; its API key from $EMBER_API_KEY)")
    group.add_argument("--latency-budget-s", type=float,
                       help="longest an online request may wait behind a batch (0.5)")
    group.add_argument("--max-online-depth", type=int,
                       help="online requests in flight above which batch work waits (0)")
    group.add_argument("--poll-interval-s", type=float, help="status poll interval (0.2)")


def _share(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.share_with_online:
        return None
    # The key comes from the environment: a command line is visible to every local user.
    share = {"url": args.share_with_online, "latency_budget_s": args.latency_budget_s,
             "max_online_depth": args.max_online_depth, "poll_interval_s": args.poll_interval_s,
             "api_key": _share_key()}
    return {k: v for k, v in share.items() if v is not None}


def cmd_batch(args: argparse.Namespace) -> int:
    """Run ``ember batch``; returns the exit status."""
    try:
        from ember.errors import OutputExists, ResumeMismatch
        from ember.offline import run_batch
    except ModuleNotFoundError as exc:  # pyarrow / pandas: Ray Data's own dependencies
        print(f"error: ember batch needs Ray Data ({exc}); install it with"
              " pip install 'ray[data]'", file=sys.stderr)
        return 2
    names = ("batch_size", "concurrency", "shard_rows", "input_column", "id_column",
             "input_format", "output_format", "max_item_bytes", "max_batch_bytes", "num_cpus",
             "num_gpus", "progress")
    settings = {name: getattr(args, name) for name in names}
    try:
        report = run_batch(args.target, input=args.input, output=args.output, attr=args.attr,
                           resume=args.resume, share=_share(args), **settings)
    except (ConfigError, RequestError, OutputExists, ResumeMismatch) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EmberError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{report.rows_total} rows in {report.shards_total} shard(s) -> {report.output}:"
          f" {report.rows_processed} mapped now ({report.rows_per_s:.1f} rows/s;"
          f" {report.steady_rows_per_s:.1f} after {report.startup_s:.0f} s of start-up),"
          f" {report.rows_skipped} done before, {report.rows_failed} bad rows"
          + (" (see errors.jsonl)" if report.rows_failed else ""))
    return 0


def _share_key() -> str | None:
    """The key ``--share-with-online`` sends: ``EMBER_API_KEY``."""
    key = settings.load().api_key
    return key.get_secret_value() if key is not None else None


def main(argv: list[str] | None = None) -> int:
    """Run the ``batch`` subcommand alone: ``python -m ember.cli.batch batch ...``."""
    parser = argparse.ArgumentParser(prog="ember")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
