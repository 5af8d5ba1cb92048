"""Per-token log-probabilities for the generation engine, as OpenAI reports them.

The numbers are of the distribution the token was actually drawn from: after the grammar
mask (a token the grammar forbids has probability 0), at the request's temperature and cut
to its ``top_p`` nucleus; at ``temperature == 0`` (greedy) they are the masked softmax at
temperature 1. A probability of 0 is reported as -9999.0, as OpenAI does, since JSON has no
-Infinity.

Example:
    >>> from ember.deployments._textgen_sampling import SamplingParams
    >>> entry = logprob_of(torch.tensor([0.0, 0.0, float("-inf")]), 1,
    ...                    SamplingParams(temperature=0), top=2)
    >>> round(entry.logprob, 4), [t for t, _ in entry.top]
    (-0.6931, [0, 1])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ember.deployments._textgen_sampling import SamplingParams, distribution

#: OpenAI's stand-in for log(0).
FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the ``top`` most likely tokens with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities [V] of the distribution a token is drawn from under ``params``."""
    if params.temperature == 0:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log(distribution(logits, params))


def logprob_of(logits: torch.Tensor, token: int, params: SamplingParams,
               top: int) -> TokenLogprob:
    """The entry for ``token`` chosen from ``logits`` [V], with its ``top`` alternatives
    (fewer when fewer tokens had any probability)."""
    lp = logprobs(logits, params)
    best = torch.topk(lp, min(top, lp.shape[-1])) if top else None
    alternatives = () if best is None else tuple(
        (int(i), float(v)) for v, i in zip(best.values, best.indices, strict=True)
        if v > float("-inf"))
    return TokenLogprob(token, max(float(lp[token]), FLOOR), alternatives)


def describe(entries: list[TokenLogprob], token_bytes: Callable[[int], bytes]
             ) -> list[dict[str, Any]]:
    """``entries`` in the shape of OpenAI chat's ``logprobs.content``: ``token`` (its text;
    bytes that are not whole UTF-8 characters as ``\\x..`` escapes), ``logprob``, ``bytes``
    (the token's UTF-8 bytes as integers) and ``top_logprobs`` (the same three fields)."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(token)
        return {"token": raw.decode("utf-8", errors="backslashreplace"),
                "logprob": logprob, "bytes": list(raw)}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
            for e in entries]
