"""A prefix cache: keys/values of prompt blocks already computed on this replica.

Prompts are cut into blocks of ``block_tokens`` tokens; a block is named by its tokens and
its parent's name (a hash chain, as vLLM's automatic prefix caching), so a block is only
found after the very same prefix. A prompt's longest chain of cached blocks is not computed
again: the prefill starts from their keys/values. A block is shared by every prompt that
starts with its chain; its reference count is the number of cached blocks that extend it,
and only unreferenced blocks (leaves) are evicted, least recently used first, when more than
``max_blocks`` are held.

Keys and values computed under a LoRA adapter are not the base's, nor another adapter's, so
every block also carries the *space* it was computed in: None for the base, an adapter's
load identity (its name and the load's generation, ``_textgen_lora``) for an adapter. A
lookup only ever finds blocks of its own space; every space shares the one LRU and its
limit. ``drop`` forgets a space at once (an evicted adapter's blocks), and a reloaded
adapter has a new generation, so its lookups could not find the old load's blocks anyway.

Example:
    >>> cache = PrefixCache(block_tokens=2, max_blocks=8)
    >>> cache.match([1, 2, 3, 4, 5])
    []
    >>> cache.match([1, 2, 3, 4, 5], space=("sql", 1))
    []
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ember.control.prefix_routing import BLOCK_TOKENS, block_names

#: Where a block's keys/values were computed: None for the base, else an adapter's load
#: (its name and the generation of that load).
Space = tuple[str, int] | None
#: A block's key: its space and its name in the hash chain.
Key = tuple[Space, int]


@dataclass(eq=False)
class Block:
    """One block's keys and values, ``[H, block_tokens, D]`` per layer."""

    key: Key
    parent: Key | None
    #: The block's own tokens: a hash collision must not pass for a hit.
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    #: Cached blocks whose parent this is; a referenced block is never evicted.
    refs: int = 0


class PrefixCache:
    """Blocks of prompt keys/values by prefix, LRU among the leaves."""

    def __init__(self, *, block_tokens: int = BLOCK_TOKENS, max_blocks: int = 1024) -> None:
        self.block_tokens, self.max_blocks = block_tokens, max_blocks
        self._blocks: OrderedDict[Key, Block] = OrderedDict()
        # ``drop`` comes from the thread that evicts an adapter, while a step may look up.
        self._lock = threading.Lock()
        #: Prompt tokens looked up and found, for the hit rate in ``/metrics``.
        self.queried_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def spaces(self) -> set[Space]:
        """The spaces that hold blocks now (None: the base's)."""
        with self._lock:
            return {space for space, _ in self._blocks}

    def _keys(self, tokens: list[int], blocks: int, space: Space) -> list[Key]:
        # The prefix router names a prompt's blocks with the same function.
        return [(space, name) for name in block_names(tokens, self.block_tokens, blocks)]

    def match(self, tokens: list[int], *, space: Space = None) -> list[Block]:
        """The longest chain of blocks cached in ``space`` that starts ``tokens``, leaving at
        least one token to compute (the prefill must produce the next token's logits)."""
        found: list[Block] = []
        size = self.block_tokens
        with self._lock:
            self.queried_tokens += len(tokens)
            for i, key in enumerate(self._keys(tokens, (len(tokens) - 1) // size, space)):
                block = self._blocks.get(key)
                if block is None or block.tokens != tuple(tokens[i * size:(i + 1) * size]):
                    break
                self._blocks.move_to_end(key)
                found.append(block)
            self.hit_tokens += len(found) * self.block_tokens
        return found

    def insert(self, tokens: list[int], keys: list[torch.Tensor],
               values: list[torch.Tensor], *, space: Space = None) -> None:
        """Remember every full block of ``tokens``, computed in ``space``;
        ``keys``/``values``: ``[1, H, n, D]``."""
        size, parent = self.block_tokens, None
        with self._lock:
            for i, key in enumerate(self._keys(tokens, len(tokens) // size, space)):
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                else:
                    cut = slice(i * size, (i + 1) * size)
                    self._blocks[key] = Block(key, parent, tuple(tokens[cut]),
                                              [k[0, :, cut].clone() for k in keys],
                                              [v[0, :, cut].clone() for v in values])
                    if parent is not None:
                        self._blocks[parent].refs += 1
                parent = key
            self._evict()

    def drop(self, space: Space) -> None:
        """Forget every block of ``space`` (chains never cross spaces: no other count moves)."""
        with self._lock:
            for key in [k for k in self._blocks if k[0] == space]:
                del self._blocks[key]

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
