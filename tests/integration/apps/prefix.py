"""Two replicas behind the prefix router that say who answered and what they already held."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel
from ray import serve

import ember
from ember.control.prefix_routing import text_blocks


class Prompt(BaseModel):
    prompt: str
    #: Seconds the replica keeps the request in flight (to load a replica on purpose).
    hold_s: float = 0.0


class Served(BaseModel):
    replica: str
    #: Whether this replica had served the prompt's first block before (a prefix cache hit).
    had_prefix: bool
    held_blocks: int


@ember.deployment(name="Prefixed", route="/prefixed", warm_floor=2, max_replicas=2,
                  num_cpus=0.1, max_ongoing_requests=32, scaledown_after_s=600,
                  router="prefix", prefix_max_queue_gap=2)
class Prefixed:
    def setup(self) -> None:
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.seen: set[int] = set()
        self.cold = False

    async def __call__(self, body: Prompt) -> Served:
        blocks = text_blocks(body.prompt)
        held = next((i for i, b in enumerate(blocks) if b not in self.seen), len(blocks))
        self.seen.update(blocks)
        await asyncio.sleep(body.hold_s)
        return Served(replica=self.replica, had_prefix=held > 0, held_blocks=held)

    @ember.route("/prefixed/cold")
    def go_cold(self, body: Prompt) -> Served:
        """Routed like any prompt, so it reaches the replica that holds ``body.prompt``."""
        self.cold = True
        return Served(replica=self.replica, had_prefix=True, held_blocks=0)

    def routing_stats(self) -> dict[str, bool]:
        return {"warm": not self.cold}


app = ember.App([Prefixed], name="prefixed", warm_pool=0)
