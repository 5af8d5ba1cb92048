"""A small byte-level decoder-only transformer in plain torch, with an explicit KV cache.

Ember ships it so that text generation runs anywhere without a download: a few layers,
trained for minutes on one CPU core on text that comes with Python (``bench/train_textgen.py``).
It writes plausible-looking English and Python-doc fragments, nothing more; what it makes real
is every serving mechanism around it (KV cache, batched decode steps, streaming).

The cache is a fixed pool of ``slots`` (one per running sequence) preallocated up front, so
decoding never allocates and never runs out of memory: the engine admits a sequence only
when a slot and its token budget are free. Sequences in a batched step occupy slots
``0..B-1`` (the engine keeps them compact), so attention reads a view of the cache, not a copy.

Example:
    >>> config = TinyLMConfig(dim=32, n_layers=1, n_heads=2)
    >>> model = TinyLM(config).eval()
    >>> cache = KVCache(config, slots=2, max_len=16)
    >>> logits = model.prefill(cache, 0, [BOS, 104, 105])
    >>> tuple(model.decode(cache, [0], [33]).shape)
    (1, 258)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator
from torch import nn

from ember.errors import StateDictMismatch

#: Byte values are tokens 0..255; two specials follow.
BOS = 256
EOS = 257
VOCAB_SIZE = 258


class TinyLMConfig(BaseModel):
    """Hyper-parameters of :class:`TinyLM` (``config.json`` beside the weights)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    vocab_size: PositiveInt = VOCAB_SIZE
    dim: PositiveInt = 128
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    #: The longest sequence (prompt + output) a request may reach; rotary positions make
    #: any length computable, quality beyond the training context is not promised.
    max_len: PositiveInt = 512
    train_context: PositiveInt = 256

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyLMConfig:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim={self.dim} must split into n_heads={self.n_heads} even heads")
        return self

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_file(cls, path: str | Path) -> TinyLMConfig:
        """Read a ``config.json``."""
        return cls.model_validate(json.loads(Path(path).read_text()))


class KVCache:
    """Keys and values of every layer for ``slots`` sequences of up to ``max_len`` tokens."""

    def __init__(self, config: TinyLMConfig, *, slots: int, max_len: int,
                 dtype: torch.dtype = torch.float32) -> None:
        shape = (config.n_layers, slots, config.n_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        #: Tokens held per slot; the next token of slot i is written at lengths[i].
        self.lengths = [0] * slots
        self.max_len = max_len

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into ``dst`` (the engine compacts the running batch)."""
        self.fork(src, dst)
        self.lengths[src] = 0

    def fork(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into ``dst``, keeping ``src`` (a request's other choices)."""
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0


Rotary = tuple[torch.Tensor, torch.Tensor]


def rotary(positions: torch.Tensor, head_dim: int) -> Rotary:
    """Cosines and sines of rotary embedding at ``positions`` [B, T]: [B, 1, T, head_dim/2].

    Computed once per forward pass and shared by every layer.
    """
    half = head_dim // 2
    freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions.to(torch.float32).unsqueeze(1).unsqueeze(-1) * freqs
    return angles.cos(), angles.sin()


def _rope(x: torch.Tensor, rot: Rotary) -> torch.Tensor:
    """Rotate ``x`` [B, H, T, head_dim] by ``rot``."""
    cos, sin = rot
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    rotated: torch.Tensor = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return rotated


class Block(nn.Module):
    """Pre-norm attention + MLP."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = config.n_heads, config.head_dim
        self.norm1 = nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.proj = nn.Linear(config.dim, config.dim, bias=False)
        self.norm2 = nn.LayerNorm(config.dim)
        self.up = nn.Linear(config.dim, 4 * config.dim, bias=False)
        self.down = nn.Linear(4 * config.dim, config.dim, bias=False)

    def _split(self, x: torch.Tensor, rot: Rotary) -> tuple[torch.Tensor, ...]:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, self.head_dim).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [B, H, T, hd]
        return _rope(q, rot), _rope(k, rot), v

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attended.shape
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, -1))
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm2(x))))
        return out

    def forward(self, x: torch.Tensor, rot: Rotary) -> torch.Tensor:
        """Causal self-attention over the whole of ``x`` (training)."""
        q, k, v = self._split(x, rot)
        return self._finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def cached(self, x: torch.Tensor, positions: torch.Tensor, rot: Rotary, keys: torch.Tensor,
               values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One layer of a decode or prefill step; writes this step's K/V into the cache views.

        ``keys``/``values`` are [B, H, L, hd] views of the cache (L at least every position
        written), ``positions`` [B, T] where this step's tokens go, ``mask`` [B, 1, T, L].
        """
        q, k, v = self._split(x, rot)
        rows = torch.arange(x.shape[0]).unsqueeze(1)
        keys.transpose(1, 2)[rows, positions] = k.transpose(1, 2)
        values.transpose(1, 2)[rows, positions] = v.transpose(1, 2)
        if x.shape[1] > 1 or mask is None:
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        else:
            # One query per sequence: two small batched matmuls beat the CPU flash kernel,
            # which is built for long queries (measured 4x faster for the decode step).
            scores = (q @ keys.transpose(-1, -2)) * self.head_dim ** -0.5
            attended = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ values
        return self._finish(x, attended)


class TinyLM(nn.Module):
    """The decoder: token embedding (tied with the output), blocks, final norm."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        layers = [Block(config) for _ in range(config.n_layers)]
        self.blocks = nn.ModuleList(layers)
        self._layers = layers  # a typed view of the same modules
        self.norm = nn.LayerNorm(config.dim)
        for module in self.modules():  # small init: tied logits start near uniform
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] for every position of ``tokens`` [B, T] (training)."""
        rot = rotary(torch.arange(tokens.shape[1]).expand_as(tokens), self.config.head_dim)
        x = self.embed(tokens)
        for block in self._layers:
            x = block(x, rot)
        return self._logits(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.embed.weight)

    @torch.inference_mode()
    def prefill(self, cache: KVCache, slot: int, tokens: list[int]) -> torch.Tensor:
        """Run a prompt into ``slot`` (which must be empty); logits [V] of its last token."""
        n = len(tokens)
        positions = torch.arange(n).unsqueeze(0)
        rot = rotary(positions, self.config.head_dim)
        causal = torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n)
        x = self.embed(torch.tensor([tokens]))
        for i, block in enumerate(self._layers):
            x = block.cached(x, positions, rot, cache.k[i, slot:slot + 1, :, :n],
                             cache.v[i, slot:slot + 1, :, :n], causal)
        cache.lengths[slot] = n
        return self._logits(x[0, -1])

    @torch.inference_mode()
    def decode(self, cache: KVCache, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """One token for each of ``slots`` (which must be ``0..B-1``); logits [B, V].

        Each sequence attends to its own cached positions only: shorter sequences' padding
        is masked, so a sequence's logits do not depend on what else is in the batch.
        """
        batch = len(slots)
        if slots != list(range(batch)):
            raise ValueError("decode slots must be 0..B-1 (the engine keeps them compact)")
        lengths = torch.tensor([cache.lengths[s] for s in slots])
        span = int(lengths.max()) + 1
        positions = lengths.unsqueeze(1)
        rot = rotary(positions, self.config.head_dim)
        mask = (torch.arange(span).unsqueeze(0) <= positions).view(batch, 1, 1, span)
        x = self.embed(torch.tensor(tokens).unsqueeze(1))
        for i, block in enumerate(self._layers):
            x = block.cached(x, positions, rot, cache.k[i, :batch, :, :span],
                             cache.v[i, :batch, :, :span], mask)
        for s in slots:
            cache.lengths[s] += 1
        return self._logits(x[:, 0])


def build(state: dict[str, torch.Tensor], config: TinyLMConfig) -> TinyLM:
    """A :class:`TinyLM` around ``state`` (mapped tensors are used in place, not copied).

    Raises:
        StateDictMismatch: names or shapes that do not fit ``config``.
    """
    with torch.device("meta"):
        model = TinyLM(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if expected != got:
        wrong = sorted(set(expected.items()) ^ set(got.items()))[:3]
        raise StateDictMismatch(f"TinyLM weights do not fit the config: {wrong}")
    model.load_state_dict(state, assign=True)
    return model.eval()


def encode(text: str, *, bos: bool = True) -> list[int]:
    """Bytes of ``text`` as tokens, after a BOS."""
    return ([BOS] if bos else []) + list(text.encode("utf-8"))
