"""Offline batch jobs: map a deployment's batch handler over a dataset with Ray Data.

The same decorated class that serves online traffic embeds a corpus offline::

    ember batch ember.deployments.embeddings:app --input corpus.jsonl --output out/

or from Python, ``run_batch("ember.deployments.embeddings:app", input="corpus.jsonl",
output="out/")``. Inputs are JSONL, CSV or Parquet files (a file, a directory, a glob; local
or any fsspec URL). The job runs on Ray Data: a datasource with one read task per shard,
then ``map_batches`` with a callable class and ``concurrency`` workers; each worker builds
the user's class once, runs its ``setup()`` once, and calls the batch handler per batch of
up to ``batch_size`` items (smaller when ``max_batch_bytes`` or a memory error says so).

Mapping rule, for a batch-form handler ``list[X] -> list[Y]``:

* ``X`` a pydantic model: validated from the whole row. ``X`` a ``dict`` (or a bare
  ``list``): the row as a dict. Any other ``X`` (``str``, ``int``, ``list[float]``): one
  column, ``text`` unless ``input_column`` names another, validated as ``X``. A tensor-form
  handler gets column ``input`` (numbers per row) stacked into a float32 tensor.
* ``Y`` a pydantic model: one column per field (``model_dump``). A dict: one column per key.
  A vector (list, numpy array, 1-D tensor, a tensor-form handler's rows): the list column
  ``embedding``. Anything else: the column ``output``.
* Every output row has ``id`` (the row's ``id`` field, as a string, or else its row index)
  and ``row_index`` (its position among all input rows), so results join back to inputs.

Shards and resume: the inputs are cut up front into shards of ``shard_rows`` records (byte
ranges of JSONL and CSV files, row ranges of Parquet files) and the plan is written to
``_manifest.json``. Each shard's output file is committed atomically once all its rows are
in, so a run killed at any point (driver or worker) and started again with ``resume=True``
redoes only shards without an output file, and the output holds every row exactly once.

Bad rows (unparseable, over ``max_item_bytes``, the wrong type, or failing alone in the
handler) go to ``errors.jsonl`` with their id, row index, reason and message; they never
stop the job. Layout of an output: see :mod:`ember.offline._sink`.

Sharing a fleet: with ``share=ShareOptions(url=...)`` (``--share-with-online URL``) batches
go through the running online deployment's handle, at low priority: see
:mod:`ember.offline._policy` and :mod:`ember.offline._share`.

Errors (see :mod:`ember.errors`)::

    ConfigError ── NoBatchHandler          the target has no batch handler to map
    BadRequest ─── InputError              an input is missing or unreadable
    OfflineError ─ OutputExists, ResumeMismatch, HandlerContract, ShardIncomplete
"""

from __future__ import annotations

from ember.offline._config import OfflineOptions, ShareOptions
from ember.offline._job import BatchReport, Target, resolve_target, run_batch
from ember.offline._policy import Throttle, offline_batch_size, should_yield

__all__ = [
    "BatchReport",
    "OfflineOptions",
    "ShareOptions",
    "Target",
    "Throttle",
    "offline_batch_size",
    "resolve_target",
    "run_batch",
    "should_yield",
]
