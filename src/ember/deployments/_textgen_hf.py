"""Any ``transformers`` causal LM behind the generation engine, one forward per decode step.

The model comes from a weights URL through ``ember.loaders``
(:meth:`TransformersBackend.from_url`: the node cache, the regional tier and the node's
snapshot, built on ``meta`` with the mapped tensors as its parameters, as
:mod:`ember.deployments.causal_lm` loads), or from a local directory with
``from_pretrained(local_files_only=True)``. Nothing is ever downloaded from a hub.

Prompts admitted at one step are prefilled together, laid end to end in one forward
(``_textgen_pack``), except those that start from a cached prefix or run with a
LoRA adapter; decode steps run every running sequence in one forward over a
:class:`SlotTable` (``_textgen_slots``). The prefix cache serves the base and every adapter,
each from blocks computed under it alone (``_textgen_prefix``: an adapter's blocks are keyed
by its load, and dropped when it is evicted).
"""

from __future__ import annotations

import inspect
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PretrainedConfig

from ember import loaders
from ember.control.prefix_routing import BLOCK_TOKENS

# transformers' model code at import: the app preloads this module in the warm runtime.
from ember.deployments import _hf_preload  # noqa: F401
from ember.deployments._textgen_backend import Backend, Detokenizer
from ember.deployments._textgen_lora import LoraAdapters
from ember.deployments._textgen_pack import groups, pack
from ember.deployments._textgen_prefix import PrefixCache, Space, joined
from ember.deployments._textgen_slots import SlotTable, slot_cache
from ember.deployments.causal_lm import CONFIG_NAME, LoadReport, load_causal_lm
from ember.errors import HeaderInvalid, WeightsNotFound

#: The files a tokenizer may be saved as (``save_pretrained`` of a fast or a slow one), read
#: from beside the weights when they are there; ``config.json`` names the class for some.
TOKENIZER_FILES = (CONFIG_NAME, "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja")


#: Prompt blocks a backend's prefix cache holds (of ``BLOCK_TOKENS`` tokens each, the prefix
#: router's block).
PREFIX_BLOCKS = 256


def table_columns(max_len: int) -> int:
    """Columns of a slot table for sequences of up to ``max_len`` tokens: every row at full
    length plus slack, so packing the rows (``SlotTable._compact``) is rare."""
    return max_len + max(64, max_len // 4)


def _model_len(config: Any, max_len: int) -> int:
    """The longest sequence served: ``max_len``, or the model's positions if fewer."""
    return min(max_len, int(getattr(config, "max_position_embeddings", None) or max_len))


def cache_bytes(config: Any, *, slots: int, max_len: int,
                prefix_blocks: int = PREFIX_BLOCKS) -> int:
    """The most memory the KV caches of a backend serving ``slots`` sequences of up to
    ``max_len`` tokens can hold, for a model of ``transformers`` ``config``: every slot's row
    at the table's full width, and the prefix cache full, in the config's ``dtype`` (that of
    the checkpoint's tensors, which the model keeps; ``float32`` when the config names
    none, as ``from_pretrained`` would load it). A table growing to its width holds its old
    half beside the new (``SlotTable._grow``), which this covers: the old half is freed
    before the rows fill the rest.

    Example:
        >>> from transformers import LlamaConfig
        >>> config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
        ...                      num_key_value_heads=2, max_position_embeddings=128,
        ...                      dtype="bfloat16")
        >>> cache_bytes(config, slots=1, max_len=1024, prefix_blocks=0)  # 2*2*2*16*192*2
        49152
    """
    text = config.get_text_config()
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    per_token = 2 * int(text.num_hidden_layers) * heads * head_dim * dtype.itemsize
    tokens = slots * table_columns(_model_len(config, max_len))
    return per_token * (tokens + prefix_blocks * BLOCK_TOKENS)


def tokenizer_beside(url: str, config: loaders.LoaderConfig, *,
                     have: Mapping[str, bytes] | None = None) -> Any:
    """The tokenizer saved in the folder of the weights at ``url``, read through the loaders'
    sources (so from S3 or HTTP as from a local folder) into a private directory.

    ``have``: those of its files the caller has read already (``config.json``, read for the
    model), which are not fetched again.

    Raises:
        WeightsNotFound: the folder holds none of the tokenizer's files (404).
        HeaderInvalid: they are there but do not make a tokenizer (503).
    """
    known = dict(have or {})
    files = {**known, **loaders.read_present_beside(
        url, tuple(name for name in TOKENIZER_FILES if name not in known), config)}
    if set(files) <= {CONFIG_NAME}:
        raise WeightsNotFound(f"no tokenizer beside the weights (looked for "
                              f"{', '.join(TOKENIZER_FILES[1:])})", url=url)
    with tempfile.TemporaryDirectory(prefix="ember-tokenizer-") as folder:
        for name, data in files.items():
            (Path(folder) / name).write_bytes(data)
        try:
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as exc:  # tokenizers and transformers raise many classes here
            raise HeaderInvalid(name="tokenizer", reason=f"does not load: {exc}"[:500]
                                ) from None


class _TextDiffDetokenizer(Detokenizer):
    """Decode all tokens so far and emit what was added (handles merges and byte pieces)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer, self._tokens, self._text = tokenizer, list[int](), ""

    def push(self, token: int) -> str:
        self._tokens.append(token)
        text = str(self._tokenizer.decode(self._tokens, skip_special_tokens=True))
        if text.endswith("\ufffd"):  # half a character: wait for the rest
            return ""
        added, self._text = text[len(self._text):], text
        return added


def _dense_input(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The output head's input, laid out densely when it is not.

    ``logits_to_keep=1`` hands the head the last position as a slice of the whole prompt's
    hidden states (strides ``(T*H, H, 1)``). With bf16 weights that need no grad, which is
    how the loaders' models come (``assign_weights``), torch's CPU ``linear`` then takes a
    path far slower than for the same values laid out densely (a profile of the 0.5 GB ladder
    model's prefill found most of it in the head); the copy is one row per sequence.
    """
    hidden = args[0] if args else None
    if not isinstance(hidden, torch.Tensor) or hidden.stride() == _dense_strides(hidden):
        return None
    return (torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device).copy_(hidden),
            *args[1:])


def _dense_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(torch.empty(tensor.shape, device="meta").stride())


class TransformersBackend(Backend):
    """A ``transformers`` causal LM from a weights URL or a local directory, never downloaded.

    Example:
        >>> backend = TransformersBackend.from_url("s3://models/qwen2-0.5b/")  # doctest: +SKIP
        >>> backend = TransformersBackend.from_directory("/models/gpt2")  # doctest: +SKIP
    """

    #: How the weights were loaded (:meth:`from_url` only): bytes, bytes read, phases.
    load_report: LoadReport | None = None

    def __init__(self, model: Any, tokenizer: Any, *, max_len: int = 1024,
                 prefix_blocks: int = PREFIX_BLOCKS, max_pack_tokens: int = 1024) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        head = model.get_output_embeddings()
        if head is not None:
            head.register_forward_pre_hook(_dense_input)
        self.eos_token_id = tokenizer.eos_token_id
        self.max_len = _model_len(model.config, max_len)
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache; accept either release line.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.n_layers = int(model.config.get_text_config().num_hidden_layers)
        self.table: SlotTable | None = None
        #: Tokens of fresh prompts computed together in one packed prefill forward.
        self.max_pack_tokens = max_pack_tokens
        #: Prompt blocks already computed (None: every prompt is computed in full).
        self.prefix = PrefixCache(max_blocks=prefix_blocks) if prefix_blocks else None
        #: LoRA adapters rows may name (``_textgen_lora``); every row is the base without.
        self.lora = LoraAdapters(self.model, base_name=str(model.config.name_or_path),
                                 on_remove=self._forget)

    def _forget(self, space: Space) -> None:
        """Drop an evicted adapter's prefix blocks: nothing will ask for them again."""
        if self.prefix is not None:
            self.prefix.drop(space)

    def _space(self, adapter: str | None) -> Space:
        """Where a row's keys/values are computed: the base, or this load of its adapter."""
        return None if adapter is None else self.lora.identity(adapter)

    def _match(self, tokens: list[int], adapter: str | None) -> list[Any]:
        """The cached blocks ``tokens`` start with, computed under ``adapter`` (None: base)."""
        if self.prefix is None:
            return []
        return self.prefix.match(tokens, space=self._space(adapter))

    @classmethod
    def from_url(cls, url: str, *, config: loaders.LoaderConfig | None = None,
                 max_len: int = 1024, slots: int = 0) -> TransformersBackend:
        """Load the model at ``url`` (any ``ember.loaders`` URL of a folder with
        ``config.json``, safetensors weights and a tokenizer) as the causal-LM deployment
        does: refused with a 503 when it cannot fit in free memory, the weights mapped from
        the node's caches (a second replica on the node shares their pages), the model built
        on ``meta`` meanwhile, no copy of any weight.

        ``slots``: the sequences the engine will run at once; the fit check counts the KV
        caches they and the prefix cache can fill (:func:`cache_bytes`) beside the weights.
        The table is backed only as it is written, so a refusal here is for the load the
        replica accepts, not for its first request: one that fits only while lightly used
        would be killed by the kernel under load instead.

        Raises:
            InsufficientMemory: the weights and caches do not fit in the node's free memory.
            WeightsError: the weights or the tokenizer cannot be fetched or do not fit.
        """
        cfg = config or loaders.LoaderConfig()

        def reserve(model_config: PretrainedConfig) -> tuple[int, str]:
            need = cache_bytes(model_config, slots=slots, max_len=max_len)
            columns = table_columns(_model_len(model_config, max_len))
            return need, (f" and its KV caches at full load ({need}: {slots} sequences of "
                          f"{columns} columns, {PREFIX_BLOCKS} prefix blocks)")

        # Read once: the fit check, the model's build and the tokenizer all use it, and on a
        # regional or origin URL each read is a round trip on the cold path.
        config_json = loaders.read_beside(url, CONFIG_NAME, cfg)
        model, report = load_causal_lm(url, config=cfg, reserve=reserve if slots else None,
                                       config_json=config_json)
        backend = cls(model, tokenizer_beside(url, cfg, have={CONFIG_NAME: config_json}),
                      max_len=max_len)
        backend.load_report = report
        return backend

    @classmethod
    def from_directory(cls, path: str | Path, *, max_len: int = 1024) -> TransformersBackend:
        """Load model and tokenizer from ``path`` with ``local_files_only=True``."""
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        return cls(model, tokenizer, max_len=max_len)

    def allocate(self, slots: int) -> None:
        self.table = SlotTable(self.n_layers, slots, max_columns=table_columns(self.max_len))

    def _table(self) -> SlotTable:
        if self.table is None:
            raise RuntimeError("allocate() the cache before the first step")
        return self.table

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text)["input_ids"]
        bos = self.tokenizer.bos_token_id
        return [bos, *ids] if bos is not None and (not ids or ids[0] != bos) else list(ids)

    def detokenizer(self) -> Detokenizer:
        return _TextDiffDetokenizer(self.tokenizer)

    def _forward(self, adapters: list[str | None], **inputs: Any) -> Any:
        """The model's forward, each row with its adapter (None: the base)."""
        # Held for the step: an adapter being added or evicted changes the modules.
        with self.lora.lock, self.lora.rows(adapters) as model:
            return model(**inputs)

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: list[int], *, adapter: str | None = None
                ) -> torch.Tensor:
        return self._prefill_after(slot, tokens, self._match(tokens, adapter), adapter)

    @torch.inference_mode()
    def prefill_many(self, slots: list[int], prompts: list[list[int]], *,
                     adapters: list[str | None] | None = None
                     ) -> list[tuple[torch.Tensor, int]]:
        """Prompts with a cached prefix start from it and prompts with an adapter run alone,
        one each; the rest share packed forwards of the base."""
        out: list[tuple[torch.Tensor, int] | None] = [None] * len(prompts)
        cold: list[int] = []
        for i, tokens in enumerate(prompts):
            adapter = adapters[i] if adapters else None
            hits = self._match(tokens, adapter)
            if hits or adapter:
                out[i] = (self._prefill_after(slots[i], tokens, hits, adapter),
                          self.cached_tokens)
            else:
                cold.append(i)
        for group in groups([len(prompts[i]) for i in cold], max_tokens=self.max_pack_tokens):
            chosen = [cold[g] for g in group]
            logits = self._prefill_packed([slots[i] for i in chosen], [prompts[i] for i in chosen])
            for i, row in zip(chosen, logits, strict=True):
                out[i] = (row, 0)
        self.cached_tokens = 0
        return [o for o in out if o is not None]

    def _prefill_after(self, slot: int, tokens: list[int], hits: list[Any],
                       adapter: str | None = None) -> torch.Tensor:
        """Prefill one prompt alone, starting from the keys/values of its cached blocks."""
        cache = DynamicCache()
        for layer in range(self.n_layers if hits else 0):  # start from the cached prefix
            cache.update(*joined(hits, layer), layer)
        done = len(hits) * (self.prefix.block_tokens if self.prefix is not None else 0)
        self.cached_tokens = done
        out = self._forward([adapter], input_ids=torch.tensor([tokens[done:]]), use_cache=True,
                            **{self._cache_kw: cache}, **self._last_only)
        self._keep(slot, tokens, cache, slice(None), space=self._space(adapter))
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits

    def _prefill_packed(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Prefill several prompts of the base in one forward; their next-token logits
        [len(prompts), V]."""
        if len(prompts) == 1:
            return self._prefill_after(slots[0], prompts[0], [])[None]
        packed = pack(prompts, self.model.dtype)
        cache = DynamicCache()
        keep = {"logits_to_keep": packed.last} if self._last_only else {}
        out = self._forward([None], input_ids=packed.input_ids,
                            position_ids=packed.position_ids, attention_mask=packed.mask,
                            use_cache=True, **{self._cache_kw: cache}, **keep)
        for slot, tokens, (start, end) in zip(slots, prompts, packed.bounds, strict=True):
            self._keep(slot, tokens, cache, slice(start, end))
        logits: torch.Tensor = out.logits[0] if keep else out.logits[0, packed.last]
        return logits.float()

    def _keep(self, slot: int, tokens: list[int], cache: Any, cut: slice, *,
              space: Space = None) -> None:
        """Copy one prompt's keys/values (columns ``cut`` of ``cache``) into ``slot`` and into
        the prefix cache, under ``space`` (the base's or an adapter load's)."""
        layers: list[Any] = list(cache.layers[:self.n_layers])
        keys = [la.keys[:, :, cut] for la in layers]
        values = [la.values[:, :, cut] for la in layers]
        self._table().place(slot, keys, values)
        if self.prefix is not None:
            self.prefix.insert(tokens, keys, values, space=space)

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int], *,
               adapters: list[str | None] | None = None) -> torch.Tensor:
        table, rows = self._table(), len(slots)
        mask = table.begin_decode(rows)
        out = self._forward(adapters or [None] * rows,
                            input_ids=torch.tensor(tokens).unsqueeze(1),
                            position_ids=table.positions(rows), attention_mask=mask,
                            use_cache=True, **{self._cache_kw: slot_cache(table)})
        table.end_decode(rows)
        logits: torch.Tensor = out.logits[:, -1].float()
        return logits

    @torch.inference_mode()  # the table's tensors were made in inference mode
    def move(self, src: int, dst: int) -> None:
        self._table().move(src, dst)

    @torch.inference_mode()
    def fork(self, src: int, dst: int) -> None:
        self._table().fork(src, dst)

    @torch.inference_mode()
    def free(self, slot: int) -> None:
        self._table().free(slot)
