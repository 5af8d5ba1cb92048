"""Any ``transformers`` causal LM stored as safetensors, built without a second copy.

``causal_lm_app(url)`` serves the checkpoint at ``url`` (a folder with ``config.json`` and
``model.safetensors`` or a sharded ``model.safetensors.index.json``; ``file://``, ``s3://``
and the other ``ember.loaders`` schemes) at ``POST /lm``: a JSON list of token ids in, one
forward pass, the next token out (greedy), with the replica's load report.

A replica loads in this order:

1. ``config.json`` is read and checked (a bad one is refused before any weight is fetched),
   and the weights' bytes are compared with the node's free memory: a replica that cannot
   fit is refused with :class:`~ember.errors.InsufficientMemory` (503) before any weight
   is read. The check counts the loads already starting on the node, and claims this
   load's bytes until it has them (:mod:`ember.loaders.reservations`);
2. a thread maps the node's snapshot of the weights (or streams them from the regional tier
   or the origin, shard by shard in the order the model uses them, and fills the node cache
   behind the load);
3. meanwhile the main thread builds the model on the ``meta`` device (no parameter memory
   at all), and the weights thread, once the tensors are
   mapped, maps in every page of them in large parallel chunks (``MADV_POPULATE_READ``:
   the kernel reads what is not in the page cache straight into it, with no copy, and the
   first forward takes no page faults);
4. the mapped tensors become the parameters (``load_state_dict(assign=True)``): no copy, so
   a replica's memory is the page cache's pages, shared by every replica of the model on
   the node.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import psutil
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import ember
from ember import loaders

# At import, not in setup(): a warm-runtime worker preloads the deployment's module, so a
# replica finds transformers' model code imported (seconds of CPU on a busy node).
from ember.deployments import _hf_preload  # noqa: F401
from ember.errors import HeaderInvalid
from ember.loaders import LoaderConfig, read_beside, snapshot_blobs, weights_bytes
from ember.loaders.limits import record_load
from ember.loaders.memory import available_bytes
from ember.loaders.pages import populate, prefetch, resident_bytes
from ember.loaders.reservations import claim

#: Part of the snapshot key: a new construction path never restores an old snapshot.
CODE_VERSION = f"causal-lm-1/ember-{ember.__version__}"
CONFIG_NAME = "config.json"


#: Bytes a caller will need beside the weights, and how the refusal names them (`` and ...``),
#: from the model's config.
Reserve = Callable[[PretrainedConfig], tuple[int, str]]


@dataclass
class LoadReport:
    """How one replica's model was loaded: bytes, where they came from, seconds per phase."""

    weights_bytes: int
    read_bytes: int = 0  # bytes not in the page cache before the load (0: all resident)
    restored: bool = False  # mapped from the node's snapshot without touching the origin
    phases_s: dict[str, float] = field(default_factory=dict)
    reserved_bytes: int = 0  # memory counted in the fit check beside the weights (a KV cache)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def free_memory_bytes() -> int:
    """Memory the node can give a new replica now: ``MemAvailable`` (free plus reclaimable),
    or the replica's memory cgroup's headroom where it is less (a pod's limit)."""
    return available_bytes()


def model_config(raw: bytes) -> PretrainedConfig:
    """The ``transformers`` config that ``config.json``'s bytes ``raw`` hold.

    Raises:
        HeaderInvalid: ``raw`` is not JSON, names no causal LM's ``model_type``, or has a
            field ``transformers`` refuses.
    """
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HeaderInvalid(name=CONFIG_NAME, reason=f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or "model_type" not in doc:
        raise HeaderInvalid(name=CONFIG_NAME, reason="no model_type")
    if doc["model_type"] not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HeaderInvalid(name=CONFIG_NAME,
                            reason=f"model_type {str(doc['model_type'])[:64]!r} is no causal LM "
                                   "transformers knows")
    try:
        return AutoConfig.for_model(**doc)
    except Exception as exc:  # transformers' own checks: a ValueError, a dataclass field's
        raise HeaderInvalid(name=CONFIG_NAME, reason=str(exc)[:300]) from None


def build_on_meta(config: PretrainedConfig | dict[str, Any]) -> torch.nn.Module:
    """The model ``config`` (or ``config.json``'s document) describes, built on the ``meta``
    device (no memory)."""
    if isinstance(config, dict):
        config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.bfloat16)
    return model  # type: ignore[no-any-return]


def assign_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Make the mapped tensors the model's parameters (no copy); rebuild derived buffers.

    A checkpoint may leave out weights the model ties to others (GPT-2's ``lm_head`` is its
    token embedding: ``save_pretrained`` writes it once); they are tied here, and any
    parameter still without storage after that is an error.

    Raises:
        HeaderInvalid: names or shapes do not match the model, or a weight is missing.
    """
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    except RuntimeError as exc:
        raise HeaderInvalid(name="state dict", reason=str(exc)[:500]) from None
    if unexpected:
        raise HeaderInvalid(name="state dict",
                            reason=f"weights the model has no place for: {unexpected[:5]}")
    # A missing key that names a buffer is a persistent one: nothing ties it, and rebuilding
    # its module below would put fresh random parameters beside it. Refuse it here.
    buffers = {name for name, _ in model.named_buffers()}
    if lost := [name for name in missing if name in buffers]:
        raise HeaderInvalid(name="state dict", reason=f"weights missing: {lost[:5]}")
    config = getattr(model, "config", None)
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            # Non-persistent buffers (rotary frequencies) are not in the checkpoint: the
            # module computes them again on the CPU.
            device = next(model.parameters()).device
            model.set_submodule(name, type(module)(config=config).to(device))
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # type: ignore[operator]
    if config is not None:
        # The model was built in bf16 on meta, and its parameters are now the checkpoint's
        # (a float32 one stays float32): the config must say what they are, as
        # from_pretrained's does, for whatever sizes buffers or saves the model by it.
        config.dtype = next(model.parameters()).dtype
    missing = [name for name, param in model.named_parameters() if param.is_meta]
    if missing:
        raise HeaderInvalid(name="state dict", reason=f"weights missing: {missing[:5]}")
    _check_one_dtype(model)
    return model.eval().requires_grad_(False)


def _check_one_dtype(model: torch.nn.Module) -> None:
    """Refuse floating-point weights of mixed dtypes (an F16 tensor among BF16 ones), which
    assignment keeps as they are and the first forward would fail on; the modules the
    architecture keeps in float32 (``_keep_in_fp32_modules``) are exempt.

    Raises:
        HeaderInvalid: the weights' dtypes differ, naming one of each.
    """
    kept = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    first: dict[torch.dtype, str] = {}
    for name, param in model.named_parameters():
        if param.is_floating_point() and not any(part in name.split(".") for part in kept):
            first.setdefault(param.dtype, name)
    if len(first) > 1:
        seen = ", ".join(f"{name} is {str(dtype).removeprefix('torch.')}"
                         for dtype, name in first.items())
        raise HeaderInvalid(name="state dict", reason=f"weights of mixed dtypes: {seen}")


def _missing_bytes(paths: list[Path]) -> int:
    missing = 0
    for path in paths:
        # A fresh fill's temp file may be renamed by its seal: its pages were just written.
        with contextlib.suppress(FileNotFoundError):
            missing += path.stat().st_size - resident_bytes(path)
    return missing


def _bring_in(tensors: dict[str, torch.Tensor], paths: list[Path]) -> float:
    """Map in every page of the mapped weights; the seconds it took."""
    start = time.perf_counter()
    spans = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for t in tensors.values() if t.device.type == "cpu"}  # file order: first use
    if not populate(list(spans.items())):
        # A kernel before 5.14: read the pages, the mapping faults them in. A fresh fill's
        # temp file may be renamed by its seal meanwhile; its pages were just written.
        with contextlib.suppress(FileNotFoundError):
            prefetch(paths)
    return time.perf_counter() - start


@dataclass
class _Weights:
    """What the weights thread of :func:`load_causal_lm` hands back."""

    got: loaders.SnapshotLoad
    map_s: float
    read_bytes: int
    read_s: float


def _map_and_prefetch(url: str, cfg: LoaderConfig, device: str) -> _Weights:
    """The snapshot's tensors, then every page of them mapped in."""
    start = time.perf_counter()
    try:  # counted before the mapping, whose header reads bring in a first few pages
        paths = snapshot_blobs(url, CODE_VERSION, cfg)
        before: int | None = _missing_bytes(paths)
    except (OSError, ValueError):  # no snapshot on this node yet
        paths, before = [], None
    got = loaders.snapshot_load(url, code_version=CODE_VERSION, config=cfg, device=device)
    map_s = time.perf_counter() - start
    if not got.restored:  # a fresh load: its record is written once its fills are sealed
        # A fresh load with write-behind holds its tensors in memory (no blobs to bring in).
        paths = list(got.blobs)
        before = _missing_bytes(paths)
    read_s = _bring_in(got.tensors, paths) if paths else 0.0
    return _Weights(got, map_s, before or 0, read_s)


def load_causal_lm(url: str, *, config: Any = None, free_bytes: int | None = None,
                   device: str = "cpu", reserve: Reserve | None = None,
                   config_json: bytes | None = None) -> tuple[torch.nn.Module, LoadReport]:
    """Load the causal LM at ``url`` as described in the module docstring.

    ``config.json`` is read and checked first; then the weights are mapped (or streamed) on a
    thread while this one builds the model on ``meta``: on a miss, the model is ready when
    the last bytes arrive. ``phases_s``: ``check`` (config, size and fit), ``map`` (the
    weights thread's load), ``construct`` (the build, beside ``map``), ``pages_wait``
    (waiting for the weights thread after the build), ``assign``; ``total`` is the wall time.

    Args:
        url: the weights URL (a folder, or its index or safetensors file).
        config: a :class:`~ember.loaders.LoaderConfig` or a mapping of its fields.
        free_bytes: the node's free memory (``None``: measured now).
        device: ``"cpu"`` (views on the page cache) or a CUDA device: each tensor is copied
            once through the loaders' pinned staging buffer, in chunks (unmeasured here).
        reserve: the memory the caller will need beside the weights, from the model's
            ``config.json`` (a generation engine's KV cache at full load): counted in the fit
            check.
        config_json: ``config.json``'s bytes, when the caller has read them already (a
            generation replica needs them for its tokenizer too): not fetched again.

    Returns:
        The model (parameters are views on the node cache's pages) and its load report.

    Raises:
        InsufficientMemory: the weights (and ``reserve``) do not fit in ``free_bytes``.
        WeightsError: the weights cannot be fetched, verified or assigned.
    """
    cfg = config if isinstance(config, LoaderConfig) else LoaderConfig(**dict(config or {}))
    marks = [time.perf_counter()]
    size = weights_bytes(url, CODE_VERSION, cfg)
    # The config before the weights, though it costs the origin one small read: a bad one is
    # refused before anything is fetched, cached or recorded.
    model_cfg = model_config(config_json or read_beside(url, CONFIG_NAME, cfg))
    reserved = reserve(model_cfg) if reserve is not None else (0, "")
    # The check and the claim are one step: a load starting beside this one counts these
    # bytes as taken until this one has them (ember.loaders.reservations).
    with claim(cfg.node_root(), size + reserved[0],
               free_bytes=free_memory_bytes if free_bytes is None else free_bytes,
               what=url, parts=f"its weights ({size}){reserved[1]}"):
        marks.append(time.perf_counter())
        with ThreadPoolExecutor(1, thread_name_prefix="ember-weights") as pool:
            weights: Future[_Weights] = pool.submit(_map_and_prefetch, url, cfg, device)
            model = build_on_meta(model_cfg)
            marks.append(time.perf_counter())
            done = weights.result()
            marks.append(time.perf_counter())
        model = assign_weights(model, done.got.tensors)
        marks.append(time.perf_counter())
    phases = {"check": marks[1] - marks[0], "map": done.map_s, "construct": marks[2] - marks[1],
              "pages_wait": marks[3] - marks[2], "assign": marks[4] - marks[3],
              "total": marks[4] - marks[0], "pages_read": done.read_s}
    phases = {name: round(value, 4) for name, value in phases.items()}
    report = LoadReport(size, done.read_bytes, done.got.restored, phases, reserved[0])
    record_load(cfg.node_root(), {"url": url, "bytes": size, "read_bytes": done.read_bytes,
                                  "restored": done.got.restored, "seconds": phases["total"]})
    return model, report


def next_token(model: torch.nn.Module, token_ids: list[int]) -> int:
    """One forward pass over ``token_ids``; the most likely next token."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids], dtype=torch.long)).logits
    return int(logits[0, -1].argmax())


def memory_bytes() -> dict[str, int]:
    """This process's resident and proportional set sizes (PSS splits shared pages)."""
    info = psutil.Process().memory_full_info()
    return {"rss_bytes": int(info.rss), "pss_bytes": int(getattr(info, "pss", info.rss))}


class CausalLM:
    """One forward pass per request over the model at :attr:`weights_url`."""

    weights_url: ClassVar[str] = ""
    loader_options: ClassVar[dict[str, Any]] = {}

    # No warmup(): a warm-up forward pass would be a second forward on the cold path, as
    # long as the request's own (it reads every weight). The first forward's one-time costs
    # are the process's (thread pool, kernel dispatch, first allocations): a warm-runtime
    # worker pays them when it starts (``control/torch_warm``), and the populated mapping
    # leaves the first forward no page faults. In the size bench, a replica's first forward
    # takes as long as its second (``disk_warm`` rows: ``first_forward_s``, ``forward_s``).

    def setup(self) -> None:
        self.rss_before_bytes = memory_bytes()["rss_bytes"]
        imported = set(sys.modules)
        self.model, self.report = load_causal_lm(self.weights_url, config=self.loader_options)
        #: How many modules the load imported: the architecture's and the URL scheme's
        #: (transformers' model code came with this module, see ``_hf_preload``).
        self.setup_imports = len(set(sys.modules) - imported)
        #: Forward passes this replica ran, each request's own included.
        self.forwards = 0

    def __call__(self, token_ids: list[int]) -> dict[str, Any]:
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        cpu = time.thread_time()
        token = next_token(self.model, token_ids)
        cpu_s = time.thread_time() - cpu
        forward_s, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
        self.forwards += 1
        memory = {**memory_bytes(), "rss_before_load_bytes": self.rss_before_bytes}
        # Page faults during the forward (weights that were not mapped in show here, not in
        # the load report), and the CPU time of the thread that ran it: well under the
        # wall time means the forward waited for a core.
        faults = {"major": after.ru_majflt - before.ru_majflt,
                  "minor": after.ru_minflt - before.ru_minflt}
        return {"next_token": token, "load": self.report.as_dict(), "memory": memory,
                "pid": os.getpid(), "forwards": self.forwards, "forward_s": round(forward_s, 4),
                "forward_faults": faults, "forward_cpu_s": round(cpu_s, 4),
                "setup_imports": self.setup_imports}


def causal_lm_deployment(url: str, *, deployment: str = "CausalLM", route: str = "/lm",
                         loader_options: dict[str, Any] | None = None,
                         **options: Any) -> type:
    """A deployment class serving the causal LM at ``url`` on ``POST route``.

    Args:
        url: the weights URL.
        deployment: the deployment's name.
        route: its route.
        loader_options: :class:`~ember.loaders.LoaderConfig` fields for the replicas.
        **options: ``@ember.deployment`` options (defaults: scale to zero, one CPU).
    """
    members = {"weights_url": url, "loader_options": dict(loader_options or {}),
               "__module__": __name__, "__call__": CausalLM.__call__}
    cls = type(deployment, (CausalLM,), members)
    defaults: dict[str, Any] = {"name": deployment, "route": route, "warm_floor": 0,
                                "max_replicas": 1, "num_cpus": 1, "request_timeout_s": 600}
    decorated: type = ember.deployment(**{**defaults, **options})(cls)
    return decorated


def causal_lm_app(url: str, *, name: str = "causal-lm", **options: Any) -> ember.App:
    """An app serving the causal LM at ``url`` on ``POST /lm`` (options as for
    :func:`causal_lm_deployment`).

    Example:
        >>> app = causal_lm_app("file:///models/llama-1b/")  # doctest: +SKIP
    """
    return ember.App([causal_lm_deployment(url, **options)], name=name, warm_pool=0)

