"""A prefix cache: keys/values of prompt blocks already computed on this replica.

Prompts are cut into blocks of ``block_tokens`` tokens; a block is named by its tokens and
its parent's name (a hash chain, as vLLM's automatic prefix caching), so a block is only
found after the very same prefix. A prompt's longest chain of cached blocks is not computed
again: the prefill starts from their keys/values. A block is shared by every prompt that
starts with its chain; its reference count is the number of cached blocks that extend it,
and only unreferenced blocks (leaves) are evicted, least recently used first, when more than
``max_blocks`` are held.

Example:
    >>> cache = PrefixCache(block_tokens=2, max_blocks=8)
    >>> cache.match([1, 2, 3, 4, 5])
    []
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ember.control.prefix_routing import block_names


@dataclass(eq=False)
class Block:
    """One block's keys and values, ``[H, block_tokens, D]`` per layer."""

    key: int
    parent: int | None
    #: The block's own tokens: a hash collision must not pass for a hit.
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    #: Cached blocks whose parent this is; a referenced block is never evicted.
    refs: int = 0


class PrefixCache:
    """Blocks of prompt keys/values by prefix, LRU among the leaves."""

    def __init__(self, *, block_tokens: int = 16, max_blocks: int = 1024) -> None:
        self.block_tokens, self.max_blocks = block_tokens, max_blocks
        self._blocks: OrderedDict[int, Block] = OrderedDict()
        #: Prompt tokens looked up and found, for the hit rate in ``/metrics``.
        self.queried_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def _names(self, tokens: list[int], blocks: int) -> list[int]:
        # The prefix router names a prompt's blocks with the same function.
        return block_names(tokens, self.block_tokens, blocks)

    def match(self, tokens: list[int]) -> list[Block]:
        """The longest chain of cached blocks that starts ``tokens``, leaving at least one
        token to compute (the prefill must produce the next token's logits)."""
        self.queried_tokens += len(tokens)
        found: list[Block] = []
        size = self.block_tokens
        for i, name in enumerate(self._names(tokens, (len(tokens) - 1) // size)):
            block = self._blocks.get(name)
            if block is None or block.tokens != tuple(tokens[i * size:(i + 1) * size]):
                break
            self._blocks.move_to_end(name)
            found.append(block)
        self.hit_tokens += len(found) * self.block_tokens
        return found

    def insert(self, tokens: list[int], keys: list[torch.Tensor],
               values: list[torch.Tensor]) -> None:
        """Remember every full block of ``tokens``; ``keys``/``values``: ``[1, H, n, D]``."""
        size, parent = self.block_tokens, None
        for i, name in enumerate(self._names(tokens, len(tokens) // size)):
            if name in self._blocks:
                self._blocks.move_to_end(name)
            else:
                cut = slice(i * size, (i + 1) * size)
                self._blocks[name] = Block(name, parent, tuple(tokens[cut]),
                                           [k[0, :, cut].clone() for k in keys],
                                           [v[0, :, cut].clone() for v in values])
                if parent is not None:
                    self._blocks[parent].refs += 1
            parent = name
        self._evict()

    def _evict(self) -> None:
        while len(self._blocks) > self.max_blocks:
            leaf = next((b for b in self._blocks.values() if b.refs == 0), None)
            if leaf is None:
                return
            del self._blocks[leaf.key]
            if leaf.parent is not None and leaf.parent in self._blocks:
                self._blocks[leaf.parent].refs -= 1


def joined(blocks: list[Block], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of ``blocks`` for ``layer`` as ``[1, H, n, D]``."""
    keys = torch.cat([b.keys[layer] for b in blocks], dim=1).unsqueeze(0)
    values = torch.cat([b.values[layer] for b in blocks], dim=1).unsqueeze(0)
    return keys, values
