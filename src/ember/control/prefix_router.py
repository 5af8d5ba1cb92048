"""The Ray Serve request router of ``@ember.deployment(router="prefix")``.

Ray Serve runs one instance in every process that holds a handle to the deployment (each
Ember edge); :mod:`ember.control.prefix_routing` decides, this class only adapts it to Ray's
public request-router API (``ray.serve.request_router``). It reads the prompt from the
request's arguments, the replicas' loads from what it sent them, their warm state from their
routing stats (``record_routing_stats``), and records in its table where each prompt was
routed. Each edge balances what it sends; the edges agree on where a new prefix goes (its
rendezvous home), so their tables agree too until load moves a prefix.

A request for a LoRA adapter carries Ray Serve's multiplexed model id; the adapters a replica
holds are those it reports to Serve (``RunningReplica.multiplexed_model_ids``, what
``@serve.multiplexed`` records) and those of the requests this router has in flight there
(the report lags a load by a push interval). Such a request is routed by its adapter, not
its prompt, and leaves no blocks in the table: the engine keeps no prefix blocks of
adapter rows. Ray's ``MultiplexMixin`` ranks by the same reports but knows nothing of
warm state or of this router's own counts, so it is not used.

It is not a ``FIFOMixin`` router on purpose: with FIFO, the replica chosen for one request
is handed to the oldest waiting request, whose prompt may share nothing with it.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from ember.control.prefix_routing import (
    BLOCK_TOKENS,
    InFlight,
    PrefixTable,
    ReplicaLoad,
    choose,
    text_blocks,
)

logger = logging.getLogger("ember.prefix_router")


def prompt_text(args: list[Any] | tuple[Any, ...], kwargs: dict[Any, Any]) -> str | None:
    """The prompt of a request whose body has a ``prompt`` (str) or ``messages`` field.

    Chat messages become one ``role: content`` line per turn, the byte model's template;
    any fixed rendering serves, since only equal prefixes must give equal text.
    """
    for value in [*args, *kwargs.values()]:
        fields = value if isinstance(value, dict) else getattr(value, "__dict__", None)
        if not isinstance(fields, dict):
            continue
        prompt, messages = fields.get("prompt"), fields.get("messages")
        if isinstance(prompt, str):
            return prompt
        if isinstance(messages, list):
            return "\n".join(f"{_get(m, 'role')}: {_content(_get(m, 'content'))}"
                             for m in messages)
    return None


def model_id(request: PendingRequest | None) -> str | None:
    """The request's multiplexed model id (a LoRA adapter's name); None when it has none."""
    value = None if request is None else request.metadata.multiplexed_model_id
    return value or None


def _get(message: Any, key: str) -> Any:
    return message.get(key) if isinstance(message, dict) else getattr(message, key, None)


def _content(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts: their text, in order
        return "".join(str(_get(part, "text") or "") for part in content)
    return "" if content is None else str(content)


class PrefixRouter(RequestRouter):
    """Routes a prompt to the replica holding its longest prefix, unless cold or overloaded."""

    def initialize_state(self, max_queue_gap: int = 8, block_tokens: int = BLOCK_TOKENS,
                         max_blocks: int = 8192, **_: Any) -> None:
        """Called by Serve with ``request_router_kwargs``."""
        self._ember_gap, self._ember_block_tokens = max_queue_gap, block_tokens
        self._ember_table = PrefixTable(max_blocks=max_blocks)
        self._ember_inflight = InFlight()
        self._ember_known: set[str] = set()

    def _ember_blocks(self, request: PendingRequest | None) -> list[int]:
        text = None if request is None else prompt_text(request.args, request.kwargs)
        return [] if text is None else text_blocks(text, self._ember_block_tokens)

    def _ember_loads(self, replicas: list[RunningReplica]) -> list[ReplicaLoad]:
        # What this router sent, not Serve's queue-length cache: that cache is set from the
        # replica's count at acceptance, which for a fast request arrives after its
        # completion was counted, and leaves the replica a request or more too long for
        # seconds (measured). Serve still skips a replica that is full.
        sent, held = self._ember_inflight.counts(), self._ember_inflight.adapters()
        loads = []
        for replica in replicas:
            name = replica.replica_id.unique_id
            warm = bool((replica.routing_stats or {}).get("warm", True))
            adapters = frozenset(replica.multiplexed_model_ids) | held.get(name, frozenset())
            loads.append(ReplicaLoad(name, sent.get(name, 0), warm, adapters))
        return loads

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        """One rank with the policy's choice, then the others from least loaded."""
        if pending_request is not None:
            # No locality stage precedes this one: when no rank can take the request, Serve
            # must back off before asking again instead of spinning.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        replicas = list(candidate_replicas)
        random.shuffle(replicas)  # ties between equally loaded replicas: spread them
        self._ember_forget_gone(replicas)
        loads, adapter = self._ember_loads(replicas), model_id(pending_request)
        blocks = [] if adapter is not None else self._ember_blocks(pending_request)
        choice = choose(blocks, self._ember_table, loads, max_queue_gap=self._ember_gap,
                        adapter=adapter)
        if choice is None:
            return []
        if pending_request is not None:
            self._ember_inflight.chosen(pending_request.metadata.internal_request_id,
                                        choice.replica, adapter)
        # If the choice is full, Serve tries the rest in order: holders of the adapter
        # first, then by queue.
        rank = {load.replica: (adapter not in load.adapters, load.queue_len) for load in loads}
        chosen = [r for r in replicas if r.replica_id.unique_id == choice.replica]
        rest = sorted((r for r in replicas if r.replica_id.unique_id != choice.replica),
                      key=lambda r: rank[r.replica_id.unique_id])
        logger.debug("prefix router: %s (%s, %d blocks, adapter %s)", choice.replica,
                     choice.reason, choice.matched_blocks, adapter)
        return [chosen, rest] if rest else [chosen]

    def _ember_forget_gone(self, replicas: list[RunningReplica]) -> None:
        current = {r.replica_id.unique_id for r in replicas}
        gone = self._ember_known - current
        if gone:  # scaled down or died: a replica that comes back is a new one, cache empty
            self._ember_table.forget(gone)
        self._ember_known = current

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        """The replica took the request: it will hold the prompt's blocks (or its adapter)."""
        name, request_id = replica_id.unique_id, pending_request.metadata.internal_request_id
        adapter = model_id(pending_request)
        if adapter is None:  # an adapter's rows leave nothing in the prefix cache
            self._ember_table.record(self._ember_blocks(pending_request), name)
        self._ember_inflight.routed(request_id, name, adapter)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request finished (or was refused): it no longer counts in the load."""
        self._ember_inflight.finished(internal_request_id)
