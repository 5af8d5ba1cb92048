"""LoRA adapters over one base model: fetched through ``ember.loaders``, kept in an LRU.

An adapter is a peft directory (``adapter_config.json`` beside ``adapter_model.safetensors``)
named by any ``ember.loaders`` URL (``file://``, ``s3://``, ...), so it comes through the
node and regional caches as weights do. :class:`AdapterStore` keeps at most
``max_adapters`` of them per replica, least recently used first out, and never evicts one
that a request still holds: a store whose adapters are all held goes over its limit until
one is released, rather than fail or stall a request.

:class:`LoraAdapters` puts them into the base model with peft and runs a batch whose rows
name different adapters (or none) in one forward: peft's mixed-batch inference
(``adapter_names``), which adds each group's ``B @ A`` delta to its own rows only. Before
anything is loaded or evicted, an adapter is checked against the base: every LoRA matrix
must fit the module it targets, else the request is a 400 and the store is untouched.
Each load of an adapter gets a new generation (``identity``): what was computed under one
load (prefix-cache blocks) is keyed by it, so a name loaded again with other weights never
meets it, and ``on_remove`` hears of each removal to drop it at once.

Example:
    >>> store = AdapterStore(2, load=lambda name: name.upper(), unload=lambda n, v: None)
    >>> with store.hold("a") as value:
    ...     value
    'A'
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from ember import loaders
from ember.errors import BadRequest

T = TypeVar("T")

#: The name peft's mixed-batch forward gives rows that use no adapter.
BASE = "__base__"
_UNKNOWN = "\0unknown"  # never an adapter's name
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


@dataclass
class _Entry(Generic[T]):
    value: T
    holds: int = 0


class AdapterStore(Generic[T]):
    """At most ``max_adapters`` loaded values by name, LRU among those no request holds.

    Thread-safe: loads run in worker threads while the engine steps in another.
    """

    def __init__(self, max_adapters: int, *, load: Callable[[str], T],
                 unload: Callable[[str, T], None]) -> None:
        self.max_adapters = max_adapters
        self._load, self._unload = load, unload
        self._entries: OrderedDict[str, _Entry[T]] = OrderedDict()
        self._lock = threading.Lock()
        self._loading = threading.Lock()
        #: Seconds the last cold load of each adapter took (for the cold-start phases).
        self.load_s: dict[str, float] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        """Loaded adapters, least recently used first."""
        return list(self._entries)

    def acquire(self, name: str) -> tuple[T, float | None]:
        """Hold ``name`` (loading it if needed); its value and the load's seconds if cold.

        Raises:
            whatever ``load`` raises: nothing was evicted then.
        """
        held = self._hold_loaded(name)
        if held is not None:
            return held, None
        with self._loading:  # one load at a time; holds and releases never wait for it
            held = self._hold_loaded(name)  # loaded while this request waited
            if held is not None:
                return held, None
            started = time.monotonic()
            value = self._load(name)
            cold = self.load_s[name] = time.monotonic() - started
            with self._lock:
                self._entries[name] = _Entry(value, holds=1)
                self._evict()
            return value, cold

    def _hold_loaded(self, name: str) -> T | None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return None
            self._entries.move_to_end(name)
            entry.holds += 1
            return entry.value

    def release(self, name: str) -> None:
        """Let go of one hold on ``name``; an over-full store evicts now."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None and entry.holds > 0:
                entry.holds -= 1
            self._evict()

    @contextlib.contextmanager
    def hold(self, name: str) -> Iterator[T]:
        """``acquire`` for the block's duration."""
        value, _ = self.acquire(name)
        try:
            yield value
        finally:
            self.release(name)

    def _evict(self) -> None:
        while len(self._entries) > self.max_adapters:
            victim = next((n for n, e in self._entries.items() if e.holds == 0), None)
            if victim is None:
                return  # every adapter is held: over the limit until one is released
            self._unload(victim, self._entries.pop(victim).value)


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter as fetched: its peft config and its tensors."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def fetch(url: str) -> AdapterFiles:
    """Read a peft adapter at ``url`` (its folder, or its safetensors file) via the caches."""
    weights = url if url.endswith(".safetensors") else url.rstrip("/") + "/" + WEIGHTS_FILE
    config = json.loads(loaders.read_beside(weights, CONFIG_FILE, loaders.LoaderConfig()))
    return AdapterFiles(config, loaders.load(weights))


def _module_dims(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a module LoRA can target: ``nn.Linear`` or GPT-2's Conv1D."""
    module = getattr(module, "base_layer", module)
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D":  # weight is [in, out]
        shape = getattr(module, "weight").shape  # noqa: B009 (Conv1D is not typed here)
        return int(shape[0]), int(shape[1])
    return None


def mismatches(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Why ``tensors`` (a peft LoRA state dict) cannot sit on ``model``; empty if they fit."""
    problems = []
    for key, tensor in tensors.items():
        path, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            continue
        try:
            dims = _module_dims(model.get_submodule(path))
        except AttributeError:
            problems.append(f"{path} is not a module of the base")
            continue
        if dims is None:
            problems.append(f"{path} is not a linear layer")
        elif kind == "A.weight" and tensor.shape[1] != dims[0]:
            problems.append(f"{path} takes {dims[0]} features, lora_A {tensor.shape[1]}")
        elif kind == "B.weight" and tensor.shape[0] != dims[1]:
            problems.append(f"{path} gives {dims[1]} features, lora_B {tensor.shape[0]}")
    return problems


class LoraAdapters:
    """Adapters put into one ``transformers`` model by peft; rows pick theirs per forward."""

    def __init__(self, model: torch.nn.Module, *, base_name: str = "base",
                 on_remove: Callable[[tuple[str, int]], None] | None = None) -> None:
        self.base, self.base_name = model, base_name
        #: Told each removed adapter's identity, after it left the model.
        self.on_remove = on_remove
        self._generations = itertools.count(1)
        #: The generation of each adapter's current load (see ``identity``).
        self._loaded: dict[str, int] = {}
        self.peft: Any = None  # a PeftModel once the first adapter is in
        #: What the LoRA layers are set for now (see ``rows``); unknown after a change.
        self._layers: str | None = _UNKNOWN
        #: A mixed step's adapter name per row, while it runs (see ``rows``).
        self._names: list[str] | None = None
        #: Held while the model runs or changes: adding an adapter changes its modules.
        self.lock = threading.Lock()

    def check(self, name: str, files: AdapterFiles) -> None:
        """Raise 400 if ``files`` do not fit the base (nothing is loaded or evicted)."""
        if str(files.config.get("peft_type", "LORA")).upper() != "LORA":
            raise BadRequest(f"adapter '{name}' is not a LoRA adapter", param="model")
        if files.config.get("modules_to_save"):
            raise BadRequest(f"adapter '{name}' replaces whole modules (modules_to_save): "
                             "only LoRA matrices are served", param="model")
        problems = mismatches(self.base, files.tensors)
        if problems:
            raise BadRequest(f"adapter '{name}' does not fit the base model "
                             f"'{self.base_name}': {'; '.join(problems[:3])}", param="model")

    @torch.no_grad()
    def add(self, name: str, files: AdapterFiles) -> None:
        """Put a checked adapter into the model under ``name``."""
        from peft import LoraConfig, PeftModel, set_peft_model_state_dict

        known = LoraConfig.__dataclass_fields__
        config = LoraConfig(**{k: v for k, v in files.config.items() if k in known})
        config.inference_mode = True
        with self.lock:
            self._layers = _UNKNOWN
            if self.peft is None:
                self.peft = PeftModel(self.base, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
            try:
                result: Any = set_peft_model_state_dict(self.peft, files.tensors,
                                                        adapter_name=name)
                missing = [k for k in result.missing_keys if f".{name}." in k]
                if missing:
                    raise BadRequest(f"adapter '{name}' lacks weights: {missing[:3]}",
                                     param="model")
            except Exception:
                self._delete(name)  # a half-added adapter must not stay in the model
                raise
            self.peft.eval()
            self._hook_layers()
            self._loaded[name] = next(self._generations)

    def identity(self, name: str) -> tuple[str, int]:
        """``name`` and the generation of its current load: a load's own key for what was
        computed under it (a reload, even from other weights, gets a new one).

        Raises:
            KeyError: ``name`` is not loaded.
        """
        return name, self._loaded[name]

    def remove(self, name: str) -> None:
        with self.lock:
            self._delete(name)
            gone = self._loaded.pop(name, None)
        if gone is not None and self.on_remove is not None:
            self.on_remove((name, gone))

    def _delete(self, name: str) -> None:
        if self.peft is not None and name in self.peft.peft_config:
            self.peft.delete_adapter(name)
            self._layers = _UNKNOWN

    @contextlib.contextmanager
    def rows(self, adapters: list[str | None]) -> Iterator[Any]:
        """The model to call (for the block) for rows naming ``adapters`` (None: the base).

        A step whose rows are all the base runs with the adapters' layers switched off
        (peft's layers would otherwise add the active adapter); one whose rows all name one
        adapter runs peft's plain path with it active; only a step that mixes hands every
        LoRA layer one adapter name per row (peft's mixed-batch forward, which costs more
        per layer). The layers' state changes only when the kind of step does (switching
        walks every module), and the names reach the layers through hooks registered once
        (peft's own ``adapter_names`` argument registers and removes a hook on every layer
        at every call).
        """
        kinds = set(adapters)
        if self.peft is not None:
            self._state(None if kinds == {None} else adapters[0] if len(kinds) == 1 else BASE)
        if len(kinds) > 1:
            self._names = [a or BASE for a in adapters]
        try:
            yield self.base
        finally:
            self._names = None

    def _hook_layers(self) -> None:
        """Give every LoRA layer not yet seen the hook that passes a mixed step's names."""
        from peft.tuners.lora import LoraLayer

        for module in self.base.modules():
            if isinstance(module, LoraLayer) and not getattr(module, "_ember_rows", False):
                module.register_forward_pre_hook(self._pass_names, with_kwargs=True)
                module._ember_rows = True  # type: ignore[assignment]  # plain attribute

    def _pass_names(self, module: torch.nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self._names is not None:
            kwargs["adapter_names"] = self._names
        return args, kwargs

    def _state(self, want: str | None) -> None:
        """Layers off (None), on with adapter ``want`` active, or on for a mixed step (BASE)."""
        if want == self._layers:
            return
        if want is None:
            self.peft.base_model.disable_adapter_layers()
        else:
            if self._layers is None or self._layers == _UNKNOWN:
                self.peft.base_model.enable_adapter_layers()
            if want != BASE and self.peft.active_adapter != want:
                self.peft.set_adapter(want)
        self._layers = want
