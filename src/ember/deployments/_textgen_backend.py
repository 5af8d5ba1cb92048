"""What the generation engine needs from a model: prefill a slot, decode a batch of slots.

One small interface, two implementations (a file each would be two dozen lines; they share
this one):

* :class:`TinyLMBackend`: Ember's byte-level model (``_tinylm.py``); one batched forward per
  decode step over every running sequence, each with its own KV cache slot.
* :class:`TransformersBackend`: any ``transformers`` causal LM in a local directory (or an
  ``hf://`` entry already in the cache), loaded with ``local_files_only=True``. It keeps one
  ``past_key_values`` per slot and decodes the slots one after another: correct for every
  model ``transformers`` supports, batched by the engine's schedule but not in one kernel.
"""

from __future__ import annotations

import codecs
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from ember.deployments._tinylm import EOS, KVCache, TinyLM, encode


class Detokenizer(ABC):
    """Turns one sequence's tokens into text, as they come."""

    @abstractmethod
    def push(self, token: int) -> str:
        """The text that ``token`` completes (may be empty: half a UTF-8 character)."""


class Backend(ABC):
    """A model behind the engine: slots ``0..slots-1``, each holding one sequence's cache."""

    #: Tokens after which a sequence stops; None when the model has none.
    eos_token_id: int | None
    #: The longest prompt + output a slot holds.
    max_len: int

    @abstractmethod
    def allocate(self, slots: int) -> None:
        """Reserve the cache for ``slots`` sequences (called once, before any step)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Prompt text to token ids (with whatever start token the model expects)."""

    @abstractmethod
    def detokenizer(self) -> Detokenizer:
        """A fresh incremental decoder for one sequence's output."""

    @abstractmethod
    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        """Fill empty ``slot`` with a prompt; the logits [V] of the token after it."""

    @abstractmethod
    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """Append one token to each of ``slots`` (always ``0..B-1``); logits [B, V]."""

    @abstractmethod
    def move(self, src: int, dst: int) -> None:
        """Move a sequence's cache from slot ``src`` to the free slot ``dst``."""

    @abstractmethod
    def free(self, slot: int) -> None:
        """Forget ``slot``'s sequence."""


class _ByteDetokenizer(Detokenizer):
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(bytes([token])) if token < 256 else ""


class TinyLMBackend(Backend):
    """Ember's byte-level model with a preallocated :class:`KVCache`."""

    def __init__(self, model: TinyLM, *, max_len: int | None = None) -> None:
        self.model = model
        self.eos_token_id = EOS
        self.max_len = max_len or model.config.max_len
        self.cache: KVCache | None = None

    def allocate(self, slots: int) -> None:
        self.cache = KVCache(self.model.config, slots=slots, max_len=self.max_len)

    def _cache(self) -> KVCache:
        if self.cache is None:
            raise RuntimeError("allocate() the cache before the first step")
        return self.cache

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def detokenizer(self) -> Detokenizer:
        return _ByteDetokenizer()

    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        return self.model.prefill(self._cache(), slot, tokens)

    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        return self.model.decode(self._cache(), slots, tokens)

    def move(self, src: int, dst: int) -> None:
        self._cache().move(src, dst)

    def free(self, slot: int) -> None:
        self._cache().free(slot)


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

    def __init__(self, model: Any, tokenizer: Any, *, max_len: int = 1024) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.max_len = min(max_len, int(getattr(model.config, "max_position_embeddings",
                                                max_len)))
        self._past: dict[int, Any] = {}

    @classmethod
    def from_directory(cls, path: str | Path, *, max_len: int = 1024) -> TransformersBackend:
        """Load model and tokenizer from ``path`` with ``local_files_only=True``."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        return cls(model, tokenizer, max_len=max_len)

    def allocate(self, slots: int) -> None:
        self._past.clear()

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text)["input_ids"]
        bos = self.tokenizer.bos_token_id
        return [bos, *ids] if bos is not None and (not ids or ids[0] != bos) else list(ids)

    def detokenizer(self) -> Detokenizer:
        return _TextDiffDetokenizer(self.tokenizer)

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([tokens]), use_cache=True)
        self._past[slot] = out.past_key_values
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        rows = []
        for slot, token in zip(slots, tokens, strict=True):
            out = self.model(input_ids=torch.tensor([[token]]), past_key_values=self._past[slot],
                             use_cache=True)
            self._past[slot] = out.past_key_values
            rows.append(out.logits[0, -1].float())
        return torch.stack(rows)

    def move(self, src: int, dst: int) -> None:
        self._past[dst] = self._past.pop(src)

    def free(self, slot: int) -> None:
        self._past.pop(slot, None)
