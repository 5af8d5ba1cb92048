"""Constrained decoding for the generation engine: a grammar per sequence, through llguidance.

A request's grammar (an llguidance grammar string, e.g. from a JSON schema) becomes a
:class:`Constraint` when the request is submitted; a grammar that does not compile for the
model's tokenizer is a 400 naming ``response_format`` before the request is admitted. At each
step the engine masks the rows of the batch whose sequences carry one (:func:`constrain`:
one bitmask for the whole batch, filled by llguidance's thread pool, applied in one
``torch.where``), picks its tokens as usual, and advances each constraint with the chosen
token. A sequence whose grammar cannot take another token is finished.

The tokenizer llguidance needs is built once per backend (:func:`tokenizer_for`): the TinyLM's
256 byte tokens and its two special tokens, or a ``transformers`` tokenizer through
``llguidance.hf``, with a per-token fallback for tokenizers ``llguidance.hf`` cannot read.

Example:
    >>> import llguidance
    >>> grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "boolean"})
    >>> c = Constraint(byte_tokenizer(), grammar)
    >>> [c.advance(t) for t in b"true"]
    [False, False, False, True]
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import llguidance
import llguidance.numpy
import torch

from ember.deployments._textgen_backend import Backend, TinyLMBackend
from ember.deployments._tinylm import BOS, EOS
from ember.errors import BadRequest

#: Built per backend and kept as long as it lives (a transformers vocabulary takes ~1 s).
_TOKENIZERS: weakref.WeakKeyDictionary[Backend, llguidance.LLTokenizer] = (
    weakref.WeakKeyDictionary())
#: Held while a tokenizer is built: the replica's background build and a request never both do.
_BUILDING = threading.Lock()


class _ByteVocabulary:
    """The TinyLM's tokens as llguidance's ``TokenizerWrapper`` reads them."""

    eos_token_id = EOS
    bos_token_id = BOS
    tokens = [bytes([i]) for i in range(256)] + [b"<bos>", b"<eos>"]
    special_token_ids = [BOS, EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


@functools.cache
def byte_tokenizer() -> llguidance.LLTokenizer:
    """The llguidance tokenizer of the byte model: bytes 0-255, BOS and EOS."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


class _PerTokenVocabulary:
    """A ``transformers`` tokenizer read one token at a time: each token's own decoding.

    For tokenizers whose decoder ``llguidance.hf`` does not know (a character-level
    WordLevel tokenizer, say); byte-level BPE and SentencePiece go through ``llguidance.hf``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)
        # Ids may have gaps (a vocabulary from 32 up): the vocabulary runs to the largest.
        size = max(tokenizer.get_vocab().values()) + 1
        pieces = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False)
        self.tokens = [str(p).encode("utf-8") for p in pieces]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])


def _hf_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer)
    except ValueError:  # a decoder llguidance.hf cannot read
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_PerTokenVocabulary(tokenizer)))


def tokenizer_for(backend: Backend) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of ``backend``'s model, built once (by the first of the
    threads that ask; the others wait for it) and kept."""
    found = _TOKENIZERS.get(backend)
    if found is not None:
        return found
    with _BUILDING:
        found = _TOKENIZERS.get(backend)
        if found is None:
            if isinstance(backend, TinyLMBackend):
                found = byte_tokenizer()
            else:
                found = _hf_tokenizer(getattr(backend, "tokenizer"))  # noqa: B009
            _TOKENIZERS[backend] = found
        return found


def token_bytes(tokenizer: llguidance.LLTokenizer, token: int) -> bytes:
    """One token's bytes (empty for an id past the tokenizer, as padded vocabularies have)."""
    return tokenizer.decode_bytes([token]) if 0 <= token < tokenizer.vocab_size else b""


class Constraint:
    """One sequence's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.tokenizer = tokenizer
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise BadRequest(f"response_format: {self.matcher.get_error()}",
                             param="response_format")

    def advance(self, token: int) -> bool:
        """Take the chosen token; True once the grammar is complete (or cannot go on)."""
        if not self.matcher.consume_token(token):
            return True  # only a token the mask let through reaches here; never leave it open
        return bool(self.matcher.is_stopped())


def constraint_for(backend: Backend, grammar: str | None) -> Constraint | None:
    """A fresh :class:`Constraint` for ``grammar`` on ``backend``'s tokenizer, or None.

    Raises:
        BadRequest: the grammar does not compile (``param="response_format"``).
    """
    return None if grammar is None else Constraint(tokenizer_for(backend), grammar)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def _unpack(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """llguidance's int32 bitmask [B, W] as booleans [B, width] (bit j of word i: 32i+j).

    ``llguidance.torch.apply_token_bitmask_inplace`` does this under ``torch.compile``, which
    on a CPU replica compiles C++ on its first call; these three tensor ops need nothing.
    """
    bits = torch.arange(32, dtype=torch.int32)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1
    flat = allowed.reshape(bitmask.shape[0], -1).bool()
    if flat.shape[1] < width:  # logits wider than the tokenizer: the extra ids are never valid
        flat = torch.nn.functional.pad(flat, (0, width - flat.shape[1]), value=False)
    return flat[:, :width]


def constrain(logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
    """``logits`` [B, V] with every token a row's grammar forbids at -inf (a new tensor when
    any row is constrained; ``logits`` itself when none is)."""
    rows = [(c.matcher, i) for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    tokenizer = next(c for c in constraints if c is not None).tokenizer
    # llguidance's numpy form, not its torch one: importing ``llguidance.torch`` runs a
    # ``torch.compile`` decorator, which imports dynamo and inductor (about 2 s of every
    # replica's import); the mask is the same buffer, seen by torch without a copy.
    mask = llguidance.numpy.allocate_token_bitmask(len(constraints), tokenizer.vocab_size)
    if len(rows) == 1:
        llguidance.numpy.fill_next_token_bitmask(rows[0][0], mask, rows[0][1])
    else:
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), rows, mask)
    bitmask = torch.from_numpy(mask)
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    index = torch.tensor([i for _, i in rows])
    allowed[index] = _unpack(bitmask[index], logits.shape[-1])
    return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype))
