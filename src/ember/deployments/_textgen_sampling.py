"""Per-sequence token choice and stop-string handling for the generation engine.

Each sequence samples with its own ``torch.Generator``: with a ``seed`` its tokens are the
same whatever else shares its batch. ``temperature == 0`` is greedy (argmax).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """How one request's tokens are chosen and when it stops."""

    model_config = ConfigDict(frozen=True)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    #: Decode to ``max_tokens`` past the end-of-sequence token (vLLM's ``ignore_eos``).
    ignore_eos: bool = False
    #: Report each token's log-probability and this many alternatives (None: none).
    logprobs: int | None = Field(None, ge=0, le=20)
    #: An llguidance grammar every output must match (``_textgen_grammar``); None: free text.
    grammar: str | None = None


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> int:
    """One token from ``logits`` [V]: argmax at temperature 0, else nucleus sampling.

    Example:
        >>> sample(torch.tensor([0.0, 3.0, 1.0]), SamplingParams(temperature=0), None)
        1
    """
    if params.temperature == 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(distribution(logits, params), 1, generator=generator))


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities [V] a token is drawn from at ``temperature > 0``: the softmax at
    that temperature, cut to the nucleus when ``top_p < 1``."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    return _nucleus(probs, params.top_p) if params.top_p < 1.0 else probs


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose probability reaches ``top_p``."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs[before >= top_p] = 0.0  # the top token always stays (before == 0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()


def generator_for(seed: int | None) -> torch.Generator:
    """A sequence's own generator: seeded when asked, else from the global RNG."""
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ())))
    return gen


@dataclass
class StopText:
    """Accumulates a sequence's text, cuts it at the first stop string, holds back a tail.

    Text that might be the start of a stop string is not released until the next token
    shows it is not, so a stop string never reaches the caller, even in pieces.
    """

    stops: tuple[str, ...]
    text: str = ""
    released: int = 0
    stopped: bool = False

    def add(self, piece: str) -> None:
        """Append a token's text; sets ``stopped`` when a stop string appears."""
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stops if s) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True

    def release(self, *, final: bool) -> str:
        """The text safe to send now (all of it once ``final`` or stopped)."""
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._partial_tail()
        out, self.released = self.text[self.released:end], max(self.released, end)
        return out

    def _partial_tail(self) -> int:
        """Length of the longest suffix of the text that begins some stop string.

        Linear in the stop strings' length per token (a KMP scan of the text's last
        ``len(stop) - 1`` characters), where trying every prefix with ``endswith`` was
        quadratic, on the replica's event loop.
        """
        return max((_overlap(self.text, stop) for stop in self.stops if stop), default=0)


def _overlap(text: str, stop: str) -> int:
    """Length of the longest proper prefix of ``stop`` that ``text`` ends with."""
    fail = _failure(stop)
    matched = 0
    for ch in text[max(0, len(text) - len(stop) + 1):] if len(stop) > 1 else "":
        while matched and stop[matched] != ch:
            matched = fail[matched - 1]
        if stop[matched] == ch:
            matched += 1
    return matched


@functools.lru_cache(maxsize=256)
def _failure(stop: str) -> tuple[int, ...]:
    """KMP's failure function: per prefix, its longest proper prefix that is also a suffix."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return tuple(fail)
