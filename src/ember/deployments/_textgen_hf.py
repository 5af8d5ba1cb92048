"""Any ``transformers`` causal LM behind the generation engine, one forward per decode step.

The model is loaded from a local directory with ``local_files_only=True`` (nothing is ever
downloaded). Prompts are prefilled one at a time with the model's own cache; decode steps
run every running sequence in one forward over a :class:`SlotTable` (``_textgen_slots``).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from ember.deployments._textgen_backend import Backend, Detokenizer
from ember.deployments._textgen_lora import LoraAdapters
from ember.deployments._textgen_prefix import PrefixCache, joined
from ember.deployments._textgen_slots import SlotTable, slot_cache


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


class TransformersBackend(Backend):
    """A ``transformers`` causal LM from a local directory, never downloaded.

    Example:
        >>> backend = TransformersBackend.from_directory("/models/gpt2")  # doctest: +SKIP
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_len: int = 1024,
                 prefix_blocks: int = 256) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.max_len = min(max_len, int(getattr(model.config, "max_position_embeddings",
                                                max_len)))
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache; accept either release line.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.n_layers = int(model.config.get_text_config().num_hidden_layers)
        self.table: SlotTable | None = None
        #: Prompt blocks already computed (None: every prompt is computed in full).
        self.prefix = PrefixCache(max_blocks=prefix_blocks) if prefix_blocks else None
        #: LoRA adapters rows may name (``_textgen_lora``); every row is the base without.
        self.lora = LoraAdapters(self.model, base_name=str(model.config.name_or_path))

    @classmethod
    def from_directory(cls, path: str | Path, *, max_len: int = 1024) -> TransformersBackend:
        """Load model and tokenizer from ``path`` with ``local_files_only=True``."""
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        return cls(model, tokenizer, max_len=max_len)

    def allocate(self, slots: int) -> None:
        # Room for every row at full length plus slack, so packing the rows is rare.
        slack = max(64, self.max_len // 4)
        self.table = SlotTable(self.n_layers, slots, max_columns=self.max_len + slack)

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
        cache = DynamicCache()
        # The prefix cache holds the base's keys/values: an adapter's differ.
        prefix = self.prefix if adapter is None else None
        hits = prefix.match(tokens) if prefix is not None else []
        for layer in range(self.n_layers if hits else 0):  # start from the cached prefix
            cache.update(*joined(hits, layer), layer)
        done = len(hits) * (prefix.block_tokens if prefix is not None else 0)
        self.cached_tokens = done
        out = self._forward([adapter], input_ids=torch.tensor([tokens[done:]]), use_cache=True,
                            **{self._cache_kw: cache}, **self._last_only)
        layers: list[Any] = list(cache.layers[:self.n_layers])
        keys, values = [la.keys for la in layers], [la.values for la in layers]
        self._table().place(slot, keys, values)
        if prefix is not None:
            prefix.insert(tokens, keys, values)
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits

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
    def free(self, slot: int) -> None:
        self._table().free(slot)
