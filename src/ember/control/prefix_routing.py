"""Prefix-aware routing that knows about scale to zero: the pure policy.

A request whose prompt starts like an earlier one should go to the replica that served the
earlier one: its prefix cache holds those blocks, so the prefill skips them (Ray Serve LLM's
prefix-affinity router and SGLang's router do this). But affinity must not beat capacity: a
replica that is cold (it says so in its routing stats) or whose queue is more than
``max_queue_gap`` requests longer than the least-loaded replica's is not chosen for affinity
alone, or one popular prefix would pile its whole load on one replica while the others, with
nothing to do, are scaled to zero by the autoscaler.

Prompts are cut into blocks and named by :func:`block_names`, the same hash chain the text
generation engine's prefix cache keys its blocks with (a block is named by its tokens and its
parent's name). A :class:`PrefixTable` remembers, LRU-bounded, which replicas recently served
which blocks. A prefix no replica holds yet gets a "home" by rendezvous hashing, so several
edges, each with its own table, agree on where a new prefix goes without sharing state.

A request for a LoRA adapter (Ray Serve's multiplexed model id) is routed by the adapter
alone: to the least loaded qualifying replica that holds it, else to the qualifying replica
holding the fewest adapters (ties: the adapter's rendezvous home), so adapters spread over
the replicas and each is loaded once. Its prompt plays no part: a replica keys its prefix
cache by adapter, so an adapter's blocks are where the adapter is, and landing away from its
adapter costs a fetch, a load and the memory of a second copy. The same capacity rule
holds: a cold or overloaded holder is passed over, and the replica that takes the request
then loads the adapter too.

Example:
    >>> table = PrefixTable()
    >>> blocks = block_names(list(b"You are a helpful assistant. Answer briefly."), 16)
    >>> table.record(blocks, "r1")
    >>> choose(blocks, table, [ReplicaLoad("r1", 0), ReplicaLoad("r2", 0)],
    ...        max_queue_gap=8).replica
    'r1'
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

#: Tokens per block; the engine's prefix cache uses the same default.
BLOCK_TOKENS = 16


def block_names(tokens: Sequence[int], block_tokens: int = BLOCK_TOKENS,
                blocks: int | None = None) -> list[int]:
    """Names of the first ``blocks`` full blocks of ``tokens`` (default: every full block).

    Each name hashes the block's tokens with its parent's name, so a block is only found
    after the very same prefix. Ints and tuples of ints hash alike in every process, so two
    processes name a prompt's blocks alike.

    Example:
        >>> len(block_names([1, 2, 3, 4, 5], block_tokens=2))
        2
    """
    count = len(tokens) // block_tokens if blocks is None else blocks
    names, parent = [], 0
    for i in range(count):
        parent = hash((parent, tuple(tokens[i * block_tokens:(i + 1) * block_tokens])))
        names.append(parent)
    return names


def text_blocks(text: str, block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """Block names of ``text``'s UTF-8 bytes: what a router without the tokenizer can name.

    For the byte-level model these are its tokens; for any other tokenizer, equal byte
    prefixes still mean equal token prefixes, which is all that affinity needs.
    """
    return block_names(list(text.encode("utf-8")), block_tokens)


@dataclass(frozen=True)
class ReplicaLoad:
    """One candidate replica as the router sees it now."""

    replica: str
    #: Requests sent to it and not yet finished.
    queue_len: int
    #: False while the replica reports it is not warm (its caches are empty or reloading).
    warm: bool = True
    #: LoRA adapters it holds: those it reported, and those of requests sent to it and not
    #: yet finished (a replica never evicts an adapter a request still holds).
    adapters: frozenset[str] = frozenset()


Reason = Literal["prefix", "home", "adapter", "adapter_home", "least_loaded"]


@dataclass(frozen=True)
class Choice:
    """Where a request goes, and why."""

    replica: str
    reason: Reason
    #: Leading blocks of the prompt the chosen replica was seen to serve.
    matched_blocks: int = 0


class PrefixTable:
    """Which replicas recently served which blocks, LRU-bounded.

    At most ``max_blocks`` blocks are remembered (least recently served first out) and at
    most ``holders_per_block`` replicas per block (the latest ones).
    """

    def __init__(self, *, max_blocks: int = 8192, holders_per_block: int = 4) -> None:
        self.max_blocks, self.holders_per_block = max_blocks, holders_per_block
        self._holders: OrderedDict[int, OrderedDict[str, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, blocks: Sequence[int], replica: str) -> None:
        """``replica`` served a prompt made of ``blocks``: it now holds every one of them."""
        for name in blocks:
            holders = self._holders.pop(name, None) or OrderedDict()
            holders.pop(replica, None)
            holders[replica] = None
            while len(holders) > self.holders_per_block:
                holders.popitem(last=False)
            self._holders[name] = holders
        while len(self._holders) > self.max_blocks:
            self._holders.popitem(last=False)

    def matched(self, blocks: Sequence[int]) -> dict[str, int]:
        """Replica -> how many leading blocks of ``blocks`` it holds (only those with one)."""
        depth: dict[str, int] = {}
        alive: set[str] | None = None
        for i, name in enumerate(blocks):
            holders = self._holders.get(name)
            alive = set(holders or ()) if alive is None else alive & set(holders or ())
            if not alive:
                break
            depth.update(dict.fromkeys(alive, i + 1))
        return depth

    def forget(self, replicas: set[str]) -> None:
        """Drop replicas that are gone (scaled down, died): a new one starts with no blocks."""
        for name in list(self._holders):
            holders = self._holders[name]
            for replica in replicas & holders.keys():
                del holders[replica]
            if not holders:
                del self._holders[name]


class InFlight:
    """The requests a router has given each replica and not seen finish.

    A request counts from the moment it is chosen for a replica, not only once the replica
    has accepted it: a burst is routed before the first acceptance comes back, and without
    its own choices in the count the router would send the whole burst to one replica. A
    choice never confirmed stops counting after ``choice_ttl_s``. Finishing may be reported
    before acceptance (Serve does so for fast requests); such ids are remembered (the last
    ``kept``) so the late acceptance does not count a finished request for ever. A request
    for an adapter also says the replica holds that adapter while it runs.
    """

    def __init__(self, *, choice_ttl_s: float = 5.0, kept: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.choice_ttl_s, self.kept, self.clock = choice_ttl_s, kept, clock
        self._requests: dict[str, _Sent] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()

    def chosen(self, request_id: str, replica: str, adapter: str | None = None) -> None:
        """``replica`` was chosen for the request; it may still go elsewhere."""
        self._requests[request_id] = _Sent(replica, self.clock() + self.choice_ttl_s, adapter)

    def routed(self, request_id: str, replica: str, adapter: str | None = None) -> None:
        """``replica`` accepted the request: it counts until it finishes."""
        if request_id in self._finished:  # it finished before its acceptance was reported
            del self._finished[request_id]
            return
        self._requests[request_id] = _Sent(replica, math.inf, adapter)

    def finished(self, request_id: str) -> None:
        """The request finished, failed or was refused."""
        self._requests.pop(request_id, None)
        self._finished[request_id] = None
        while len(self._finished) > self.kept:
            self._finished.popitem(last=False)

    def _live(self) -> list[_Sent]:
        now = self.clock()
        for request_id, sent in list(self._requests.items()):
            if sent.until < now:
                del self._requests[request_id]
        return list(self._requests.values())

    def counts(self) -> dict[str, int]:
        """Replica -> requests it has; expired choices are dropped."""
        out = dict[str, int]()
        for sent in self._live():
            out[sent.replica] = out.get(sent.replica, 0) + 1
        return out

    def adapters(self) -> dict[str, frozenset[str]]:
        """Replica -> adapters its requests in flight hold."""
        out = dict[str, set[str]]()
        for sent in self._live():
            if sent.adapter is not None:
                out.setdefault(sent.replica, set()).add(sent.adapter)
        return {replica: frozenset(names) for replica, names in out.items()}


@dataclass(frozen=True)
class _Sent:
    replica: str
    until: float  # counts until then (inf once accepted)
    adapter: str | None


def rendezvous(key: int | str, replicas: Sequence[str]) -> list[str]:
    """``replicas`` ordered by highest-random-weight for ``key``: the first is its home.

    Every process computes the same order from the same replica names, and removing a
    replica only moves the keys whose home it was.
    """
    def score(replica: str) -> bytes:
        return hashlib.blake2b(f"{key}:{replica}".encode(), digest_size=8).digest()

    return sorted(replicas, key=score, reverse=True)


def choose(blocks: Sequence[int], table: PrefixTable, replicas: Sequence[ReplicaLoad], *,
           max_queue_gap: int, adapter: str | None = None) -> Choice | None:
    """Pick the replica for a prompt made of ``blocks``; None when there is none.

    A replica qualifies when it is warm and its queue is at most ``max_queue_gap`` longer
    than the least-loaded replica's. With ``adapter`` (a LoRA adapter's name) the prompt is
    not looked at: the least loaded qualifying holder of the adapter wins, else the
    qualifying replica with the fewest adapters (ties: the adapter's rendezvous order).
    Without, the qualifying replica holding the longest matched prefix wins (by matched
    length, then queue); a prefix no replica holds goes to its rendezvous home among the
    qualifying replicas. Otherwise, or for a prompt shorter than a block, the least loaded
    of the warm replicas within the gap (a cold one only when no warm one is; ties: the
    first in ``replicas``).
    """
    if not replicas:
        return None
    lowest = min(r.queue_len for r in replicas)

    def within_gap(r: ReplicaLoad) -> bool:
        return r.queue_len - lowest <= max_queue_gap

    # For load alone a warm replica within the gap goes before a cold one: queue lengths are
    # a request or two stale, and a cold replica must not win on that.
    least = min((r for r in replicas if within_gap(r)), key=lambda r: (not r.warm, r.queue_len))
    qualified = [r for r in replicas if r.warm and within_gap(r)]
    if adapter is not None:
        chosen = _by_adapter(adapter, replicas, qualified)
    else:
        chosen = _by_prefix(blocks, table, replicas, qualified)
    return chosen or Choice(least.replica, "least_loaded")


def _by_adapter(adapter: str, replicas: Sequence[ReplicaLoad],
                qualified: list[ReplicaLoad]) -> Choice | None:
    """The least loaded qualified holder of ``adapter``, else the adapter's new home."""
    rank = {name: i for i, name in enumerate(rendezvous(adapter, [r.replica for r in replicas]))}
    holders = [r for r in qualified if adapter in r.adapters]
    if holders:
        return Choice(min(holders, key=lambda r: (r.queue_len, rank[r.replica])).replica,
                      "adapter")
    if qualified:  # fewest adapters first: adapters spread, and each is loaded once
        return Choice(min(qualified, key=lambda r: (len(r.adapters), rank[r.replica])).replica,
                      "adapter_home")
    return None


def _by_prefix(blocks: Sequence[int], table: PrefixTable, replicas: Sequence[ReplicaLoad],
               qualified: list[ReplicaLoad]) -> Choice | None:
    """The qualified replica with the longest match, else the prefix's qualified home."""
    by_name = {r.replica: r for r in replicas}
    ok = {r.replica for r in qualified}
    depth = {name: d for name, d in table.matched(blocks).items() if name in by_name}
    if depth:
        order = rendezvous(blocks[0], list(depth))
        ranked = sorted(order, key=lambda n: (-depth[n], by_name[n].queue_len))
        name = next((n for n in ranked if n in ok), None)
        return None if name is None else Choice(name, "prefix", depth[name])
    if blocks:
        name = next((n for n in rendezvous(blocks[0], list(by_name)) if n in ok), None)
        return None if name is None else Choice(name, "home")
    return None
