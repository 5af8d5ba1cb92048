"""The offline job: resolve the target, plan shards, run them on Ray Data, commit."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ember.app.app import App
from ember.app.decorator import DeploymentSpec, RouteSpec, get_spec
from ember.app.targets import import_module_ref
from ember.errors import (
    ConfigError,
    InputError,
    NoBatchHandler,
    OutputExists,
    ResumeMismatch,
)
from ember.offline._config import OfflineOptions
from ember.offline._mapping import InputPlan, plan_inputs
from ember.offline._shards import Manifest, Shard, discover, plan
from ember.offline._sink import (
    OutputStore,
    ShardAssembler,
    done_shards,
    gather_errors,
    write_summary,
)


@dataclass(frozen=True)
class Target:
    """The deployment and handler a job maps."""

    spec: DeploymentSpec
    route: RouteSpec

    @property
    def tensor(self) -> bool:
        return self.route.kind == "tensor"


@dataclass(frozen=True)
class BatchReport:
    """What one ``run_batch`` call did.

    Attributes:
        output: The output location.
        rows_total: Rows in the whole job.
        rows_skipped: Rows of shards finished by earlier runs (resume).
        rows_processed: Rows this run mapped.
        rows_failed: Bad rows of the whole job (in ``errors.jsonl``).
        shards_total: Shards in the job.
        shards_skipped: Shards finished by earlier runs.
        elapsed_s: Wall time of this run.
        startup_s: Wall time until the first mapped rows came back (cluster, workers,
            ``setup()``); 0 when nothing was left to map.
    """

    output: str
    rows_total: int
    rows_skipped: int
    rows_processed: int
    rows_failed: int
    shards_total: int
    shards_skipped: int
    elapsed_s: float
    startup_s: float = 0.0

    @property
    def rows_per_s(self) -> float:
        """Rows this run mapped per second of its wall time."""
        return self.rows_processed / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def steady_rows_per_s(self) -> float:
        """Rows per second once the workers were up (start-up left out)."""
        busy_s = self.elapsed_s - self.startup_s
        return self.rows_processed / busy_s if busy_s > 0 else 0.0


def run_batch(app_or_target: App | type | str, *, input: str | Sequence[str], output: str,
              deployment: str | None = None, attr: str | None = None, resume: bool = False,
              options: OfflineOptions | Mapping[str, Any] | None = None,
              storage_options: Mapping[str, Any] | None = None,
              **settings: Any) -> BatchReport:
    """Map a deployment's batch handler over a dataset, one output file per shard.

    Joins ``RAY_ADDRESS`` or starts a local Ray cluster if Ray is not initialised yet, and
    leaves it running.

    Args:
        app_or_target: An ``ember.App``, a decorated class, or ``"module:app[:Deployment]"``
            (also ``path/to/file.py:app``).
        input: File, directory, glob or fsspec URL, or a list of them.
        output: Output directory, local or fsspec URL.
        deployment: Deployment to map, when the app has several with batch handlers.
        attr: Handler to map, when the deployment has several batch handlers.
        resume: Finish the job already in ``output``, redoing only unfinished shards.
        options: :class:`OfflineOptions` or a dict of them.
        storage_options: fsspec options for inputs and output (credentials, endpoint).
        **settings: Single options, e.g. ``batch_size=64, concurrency=2``; they override
            ``options``.

    Returns:
        A :class:`BatchReport`.

    Raises:
        ConfigError: bad options, or no batch handler to map (:class:`NoBatchHandler`).
        InputError: an input is missing, unreadable or of an unknown format.
        OfflineError: the job cannot finish; committed shards stay, resume goes on from them.

    Example:
        >>> report = run_batch("ember.deployments.embeddings:app",  # doctest: +SKIP
        ...                    input="corpus.jsonl", output="out/", batch_size=128)
        >>> report.rows_processed, report.rows_failed  # doctest: +SKIP
        (10000, 3)
    """
    started = time.monotonic()
    opts = _options(options, settings)
    storage = dict(storage_options or {})
    target = resolve_target(app_or_target, deployment, attr)
    inputs = [input] if isinstance(input, str) else list(input)
    input_plan = plan_inputs(target.route, opts.input_column, opts.id_column)
    store = OutputStore(output, storage)
    manifest = _load_or_plan(store, inputs, opts, _job_key(target, input_plan, opts), resume,
                             storage)
    store.clean_temp()
    done = done_shards(store, manifest, opts.output_format)
    pending = [s for s in manifest.shards if s.index not in done]
    skipped = manifest.total_rows - sum(s.num_rows for s in pending)
    startup_s = 0.0
    if pending:
        startup_s = _run_pending(pending, input_plan, opts, target, store, manifest.total_rows,
                                 skipped, storage) - started
    failed = gather_errors(store, manifest)
    write_summary(store, manifest, failed)
    return BatchReport(output=output, rows_total=manifest.total_rows, rows_skipped=skipped,
                       rows_processed=manifest.total_rows - skipped, rows_failed=failed,
                       shards_total=len(manifest.shards), shards_skipped=len(done),
                       elapsed_s=time.monotonic() - started, startup_s=startup_s)


def _options(options: OfflineOptions | Mapping[str, Any] | None,
             settings: Mapping[str, Any]) -> OfflineOptions:
    base = options.model_dump() if isinstance(options, OfflineOptions) else dict(options or {})
    given = {k: v for k, v in settings.items() if v is not None}
    try:
        return OfflineOptions(**{**base, **given})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "options"
        raise ConfigError(f"batch option {loc}: {err['msg']}") from None


def resolve_target(app_or_target: App | type | str, deployment: str | None = None,
                   attr: str | None = None) -> Target:
    """Find the deployment and the batch handler a job maps.

    Args:
        app_or_target: An App, a decorated class, or ``"module:app[:Deployment]"``.
        deployment: Deployment name; default: the only one with a batch handler.
        attr: Handler name; default: the deployment's only batch handler.

    Returns:
        The :class:`Target`.

    Raises:
        ConfigError: when the target cannot be loaded, or the choice is ambiguous.
        NoBatchHandler: when there is no batch-form or tensor-form handler to map.
    """
    obj = app_or_target
    if isinstance(obj, str):
        obj, named = _load(obj)
        if named is not None and deployment is not None and named != deployment:
            raise ConfigError(f"the target names deployment {named!r}, deployment= says"
                              f" {deployment!r}; give one")
        deployment = deployment or named
    specs = obj.specs if isinstance(obj, App) else (get_spec(obj),)
    spec = _pick_deployment(specs, deployment, attr)
    return Target(spec=spec, route=_pick_route(spec, attr))


def _load(target: str) -> tuple[Any, str | None]:
    """Import ``module:attr[:Deployment]`` (or ``file.py:attr[:Deployment]``)."""
    parts = target.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(f"target must look like 'module:app' or 'module:app:Deployment',"
                          f" got {target!r}")
    module = import_module_ref(parts[0])
    try:
        obj = getattr(module, parts[1])
    except AttributeError:
        raise ConfigError(f"{parts[0]} has no attribute {parts[1]!r}") from None
    return obj, (parts[2] if len(parts) == 3 else None)


def _batch_routes(spec: DeploymentSpec) -> list[RouteSpec]:
    return [r for r in spec.routes if r.kind in ("batch", "tensor")]


def _pick_deployment(specs: Sequence[DeploymentSpec], name: str | None,
                     attr: str | None) -> DeploymentSpec:
    if name is not None:
        for spec in specs:
            if spec.name == name:
                return spec
        raise ConfigError(f"no deployment {name!r}; there are {[s.name for s in specs]}")
    candidates = [s for s in specs if any(attr in (None, r.attr) for r in _batch_routes(s))]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise NoBatchHandler(detail=f"none of {[s.name for s in specs]} has a batch handler;"
                             " add one, e.g. `def embed(self, texts: list[str]) -> list[...]`")
    raise ConfigError(f"several deployments have batch handlers ({[s.name for s in candidates]});"
                      " name one: module:app:Deployment, or deployment=...")


def _pick_route(spec: DeploymentSpec, attr: str | None) -> RouteSpec:
    routes = _batch_routes(spec)
    if attr is not None:
        for route in spec.routes:
            if route.attr == attr:
                if route in routes:
                    return route
                raise NoBatchHandler(detail=f"{spec.name}.{attr} takes a {route.kind} body, not"
                                     " a batch: annotate it `items: list[X]` or `x: torch.Tensor`")
        raise ConfigError(f"{spec.name} has no handler {attr!r}")
    if len(routes) == 1:
        return routes[0]
    if not routes:
        raise NoBatchHandler(detail=f"{spec.name} has no batch handler; add one, e.g."
                             " `def embed(self, texts: list[str]) -> list[...]`")
    raise ConfigError(f"{spec.name} has several batch handlers ({[r.attr for r in routes]});"
                      " pick one with attr=... (--attr)")


def _job_key(target: Target, input_plan: InputPlan, opts: OfflineOptions) -> dict[str, Any]:
    """What makes two runs the same job: resume refuses to mix outputs of different ones."""
    return {"deployment": target.spec.name, "attr": target.route.attr,
            "input_mode": input_plan.mode, "input_column": input_plan.column,
            "id_column": opts.id_column, "input_format": opts.input_format,
            "output_format": opts.output_format, "shard_rows": opts.shard_rows,
            "max_item_bytes": opts.max_item_bytes}


def _load_or_plan(store: OutputStore, inputs: list[str], opts: OfflineOptions,
                  job: dict[str, Any], resume: bool, storage: dict[str, Any]) -> Manifest:
    """The manifest of ``store``: the existing one on resume, else a new plan."""
    existing = store.read_manifest()
    if existing is not None and not resume:
        raise OutputExists(output=store.url)
    # An output inside an input directory must not become input on the next run.
    found = [f for f in discover(inputs, opts.input_format, storage)
             if not f[0].startswith(store.prefix + "/")]
    if not found:
        raise InputError(path=", ".join(inputs), detail="no input files outside the output")
    if existing is None:
        manifest = plan(found, opts.shard_rows, opts.max_item_bytes, storage, job)
        store.write_manifest(manifest)
        return manifest
    for key, now in job.items():
        if existing.job.get(key) != now:
            raise ResumeMismatch(output=store.url, field=key, before=existing.job.get(key),
                                 now=now)
    before = [(f.url, f.size_bytes, f.ukey) for f in existing.files]
    after = [(url, size, ukey) for url, _, size, ukey in found]
    if before != after:
        raise ResumeMismatch(output=store.url, field="inputs", before=_differs(before, after),
                             now=_differs(after, before))
    return existing


def _differs(these: list[tuple[str, int, str | None]],
             those: list[tuple[str, int, str | None]]) -> str:
    extra = [t for t in these if t not in those]
    return f"{extra[0][0]} ({extra[0][1]} bytes)" if extra else "-"


def _run_pending(pending: list[Shard], input_plan: InputPlan, opts: OfflineOptions,
                 target: Target, store: OutputStore, total_rows: int, skipped_rows: int,
                 storage: dict[str, Any]) -> float:
    """Stream the pending shards through Ray Data and commit each as it completes.

    Returns:
        When (``time.monotonic()``) the first mapped rows arrived.
    """
    from ember.cluster import runtime
    from ember.offline._raydata import block_bytes, build_dataset, job_context

    runtime.start_ray()
    assembler = ShardAssembler(pending, store, opts.output_format)
    show = opts.progress if opts.progress is not None else sys.stderr.isatty()
    with job_context(block_bytes(pending, opts.batch_size)), _progress(
            total_rows, skipped_rows, show) as advance:
        dataset = build_dataset(pending, input_plan, opts, target.spec, target.route, storage)
        first_rows_at = 0.0
        for table in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
            first_rows_at = first_rows_at or time.monotonic()
            advance(assembler.add(table))
    assembler.finish()
    return first_rows_at or time.monotonic()


@contextmanager
def _progress(total: int, done: int, show: bool) -> Iterator[Any]:
    """A bar of rows done, rows/s and the time left; yields ``advance(rows)``."""
    from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

    with tqdm(total=total, initial=done, unit="row", smoothing=0.1,
              disable=not show, desc="ember batch", file=sys.stderr) as bar:
        yield bar.update
