"""What the generation engine needs from a model: prefill a slot, decode a batch of slots.

One small interface, two implementations:

* :class:`TinyLMBackend`: Ember's byte-level model (``_tinylm.py``); one batched forward per
  decode step over every running sequence, each with its own KV cache slot.
* :class:`TransformersBackend` (``_textgen_hf.py``, imported only when used: transformers
  takes seconds to import): any ``transformers`` causal LM in a local directory, with every
  running sequence in one forward per decode step over a slotted KV cache.
"""

from __future__ import annotations

import codecs
from abc import ABC, abstractmethod

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
    #: Prompt tokens the last ``prefill`` took from a prefix cache instead of computing.
    cached_tokens: int = 0

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
        """Fill empty ``slot`` with a prompt; the logits [V] of the token after it.

        A backend that serves LoRA adapters also takes ``adapter=`` (a name, None: the base).
        """

    def prefill_many(self, slots: list[int], prompts: list[list[int]], *,
                     adapters: list[str | None] | None = None
                     ) -> list[tuple[torch.Tensor, int]]:
        """Prefill several empty slots; each prompt's next-token logits [V] and cached tokens.

        One at a time here; a backend that can compute several prompts in one forward (the
        weights read once for all of them) overrides it. ``adapters`` (given only when a
        prompt has one) name each prompt's LoRA adapter, for a backend that serves them.
        """
        out = []
        for i, (slot, tokens) in enumerate(zip(slots, prompts, strict=True)):
            adapter = adapters[i] if adapters else None
            logits = self.prefill(slot, tokens, **({"adapter": adapter} if adapter else {}))
            out.append((logits, self.cached_tokens))
        return out

    @abstractmethod
    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """Append one token to each of ``slots`` (always ``0..B-1``); logits [B, V].

        A backend that serves LoRA adapters also takes ``adapters=``: one name (or None)
        per row; the engine passes it only when a row has one.
        """

    @abstractmethod
    def move(self, src: int, dst: int) -> None:
        """Move a sequence's cache from slot ``src`` to the free slot ``dst``."""

    @abstractmethod
    def fork(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s cache into the free slot ``dst``; ``src`` keeps its own."""

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

    def fork(self, src: int, dst: int) -> None:
        self._cache().fork(src, dst)

    def free(self, slot: int) -> None:
        self._cache().free(slot)
