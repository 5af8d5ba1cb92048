"""The Ray Data pipeline of a batch job: read shards, ``map_batches`` with a worker class.

Ray Data does the scheduling: read tasks per shard, an actor pool of ``concurrency``
workers (restarted by Ray if one dies, its batch retried), backpressure between the
stages, and streaming of results to the driver, which commits shards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ember.app.decorator import DeploymentSpec, RouteSpec
from ember.cluster.runtime import SYNC_HANDLE_ENV
from ember.errors import OfflineError
from ember.offline._config import OfflineOptions
from ember.offline._mapping import InputPlan, LocalMapper
from ember.offline._reader import ShardSource
from ember.offline._shards import Shard
from ember.offline._share import OnlineMapper, online_app

#: CPUs of a worker that only forwards batches to online replicas.
_SHARE_WORKER_CPUS = 0.1
#: A row's bytes beyond its text in a block: row index, id, pickling.
_ROW_OVERHEAD_BYTES = 64
#: Blocks smaller than this cost more in bookkeeping than they gain in spread.
_MIN_BLOCK_BYTES = 16 << 10
#: Batches per block, i.e. per task of a worker (see block_bytes).
_BATCHES_PER_BLOCK = 4


def build_dataset(pending: list[Shard], plan: InputPlan, opts: OfflineOptions,
                  spec: DeploymentSpec, route: RouteSpec, storage: dict[str, Any]) -> Any:
    """The job's ``ray.data.Dataset``: mapped rows of ``pending`` shards, in ROW_SCHEMA order.

    Raises:
        OfflineError: in share mode, when the online app cannot be reached from here.
    """
    import ray.data

    source = ShardSource(pending, plan, opts.max_item_bytes, storage)
    dataset = ray.data.read_datasource(source, num_cpus=opts.read_num_cpus,
                                       concurrency=min(opts.read_concurrency, len(pending)),
                                       override_num_blocks=len(pending))
    mapper, kwargs, cpus, gpus = _worker(opts, spec, route)
    kwargs["item_type"] = plan.item_type
    # Share-mode workers call the online deployment's handle from sync code, which needs the
    # handle's router in a loop of its own whatever the cluster's default.
    extra = {"runtime_env": {"env_vars": SYNC_HANDLE_ENV}} if opts.share is not None else {}
    return dataset.map_batches(mapper, fn_constructor_kwargs=kwargs, batch_size=opts.batch_size,
                               batch_format="pyarrow",
                               compute=ray.data.ActorPoolStrategy(size=opts.concurrency),
                               num_cpus=cpus, num_gpus=gpus or None, zero_copy_batch=True,
                               **extra)


def _worker(opts: OfflineOptions, spec: DeploymentSpec,
            route: RouteSpec) -> tuple[type, dict[str, Any], float, float]:
    """The worker class, its constructor arguments, and its CPUs and GPUs."""
    tensor = route.kind == "tensor"
    if opts.share is None:
        kwargs: dict[str, Any] = {"cls": spec.cls, "attr": route.attr, "tensor": tensor,
                                  "max_batch_bytes": opts.max_batch_bytes,
                                  "deployment": spec.name}
        cpus = spec.options.num_cpus if opts.num_cpus is None else opts.num_cpus
        gpus = spec.options.num_gpus if opts.num_gpus is None else opts.num_gpus
        return LocalMapper, kwargs, cpus, gpus
    app_name = online_app(opts.share, spec.name)
    _check_same_cluster(app_name, opts.share.url)
    batch = spec.options.batch
    kwargs = {"app_name": app_name, "deployment": spec.name, "attr": route.attr,
              "tensor": tensor, "share": opts.share, "max_batch_bytes": opts.max_batch_bytes,
              "max_batch": batch.max_size if batch is not None else opts.batch_size}
    cpus = _SHARE_WORKER_CPUS if opts.num_cpus is None else opts.num_cpus
    return OnlineMapper, kwargs, cpus, 0.0


def _check_same_cluster(app_name: str, url: str) -> None:
    from ray import serve

    try:
        running = app_name in serve.status().applications
    except Exception:  # no Serve controller in this cluster
        running = False
    if not running:
        raise OfflineError(detail=f"app {app_name!r} served at {url} does not run in this Ray"
                           " cluster; set RAY_ADDRESS to the cluster that serves it")


def block_bytes(pending: list[Shard], batch_size: int) -> int:
    """About ``_BATCHES_PER_BLOCK`` batches of input rows, in bytes: Ray Data's block size.

    Ray Data merges a read task's output into blocks of ``target_max_block_size`` (128 MiB
    by default) and hands each block to one worker as one task, so a shard would go to one
    worker. Blocks of a few batches spread even a single shard over every worker, yet each
    task still runs several batches back to back: between tasks a worker waits for the next
    block to be handed over (about a second on a 2-core machine), which blocks of a single
    batch made half of its time. A repartition step could cut blocks too, but it needs a
    CPU of its own, which a job whose workers hold every CPU never gets.
    """
    rows = sum(s.num_rows for s in pending) or 1
    text_bytes = sum(max(0, s.end_byte - s.start_byte) for s in pending)
    row_bytes = text_bytes / rows + _ROW_OVERHEAD_BYTES
    return max(_MIN_BLOCK_BYTES, int(_BATCHES_PER_BLOCK * batch_size * row_bytes))


@contextmanager
def job_context(target_block_bytes: int) -> Iterator[None]:
    """Ray Data settings of one job, restored after it.

    Ember's progress bar replaces Ray Data's bars and start-up banner, and blocks are cut
    to about a batch (see :func:`block_bytes`).
    """
    from ray.data import DataContext

    ctx = DataContext.get_current()
    saved = (ctx.enable_progress_bars, ctx.print_on_execution_start, ctx.target_max_block_size)
    ctx.enable_progress_bars, ctx.print_on_execution_start = False, False
    ctx.target_max_block_size = target_block_bytes
    # Ray Data's INFO lines are per-run chatter; its note that bars are off is ours to know.
    quieter = {"ray.data": logging.WARNING, "ray.data._internal.progress": logging.ERROR}
    levels = {name: logging.getLogger(name).level for name in quieter}
    for name, level in quieter.items():
        logging.getLogger(name).setLevel(level)
    try:
        yield
    finally:
        ctx.enable_progress_bars, ctx.print_on_execution_start = saved[:2]
        ctx.target_max_block_size = saved[2]
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
