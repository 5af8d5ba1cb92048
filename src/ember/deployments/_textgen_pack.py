"""Packed prefill: several prompts in one forward, each attending only to itself.

On a CPU (and on a GPU at small batch) a prefill of a short prompt costs about one read of
all the weights, whatever its length. Prompts admitted at the same step are therefore laid
end to end in one sequence of ``sum(len)`` tokens: position ids restart at every prompt, and
a block-diagonal causal mask keeps each prompt's tokens from seeing the others'. The weights
are read once for the whole group instead of once per prompt, with no padding computed (the
left-padded batch Hugging Face builds would compute ``len(group) * max(len)`` tokens).

Example:
    >>> groups([5, 3, 7], max_tokens=10)
    [[0, 1], [2]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def groups(lengths: list[int], *, max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` cut, in order, into groups of at most ``max_tokens`` tokens.

    A prompt longer than ``max_tokens`` is a group of its own: the bound keeps the mask
    (``tokens**2`` entries) and the activations small, it never refuses a prompt.
    """
    out: list[list[int]] = []
    size = 0
    for i, n in enumerate(lengths):
        if out and size + n <= max_tokens:
            out[-1].append(i)
            size += n
        else:
            out.append([i])
            size = n
    return out


@dataclass(frozen=True)
class Packed:
    """One forward's inputs for several prompts laid end to end."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    #: Additive mask [1, 1, T, T]: 0 where a token may attend, the dtype's minimum elsewhere.
    mask: torch.Tensor
    #: Where each prompt starts and ends in the packed sequence.
    bounds: list[tuple[int, int]]

    @property
    def last(self) -> torch.Tensor:
        """The index of each prompt's last token, whose logits predict its next token."""
        return torch.tensor([end - 1 for _, end in self.bounds])


def pack(prompts: list[list[int]], dtype: torch.dtype) -> Packed:
    """Lay ``prompts`` end to end with restarting positions and a block-diagonal causal mask."""
    lengths = [len(p) for p in prompts]
    segment = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(lengths))
    position = torch.cat([torch.arange(n) for n in lengths])
    index = torch.arange(len(segment))
    allowed = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    bounds, start = [], 0
    for n in lengths:
        bounds.append((start, start + n))
        start += n
    ids = torch.tensor([t for p in prompts for t in p])
    return Packed(ids[None], position[None], mask[None, None], bounds)
