"""A deployment that says which Ray node served it, for the two-node test."""

from __future__ import annotations

import asyncio

import ray
from pydantic import BaseModel, Field

import ember


class WhereIn(BaseModel):
    sleep_s: float = Field(default=0.0, ge=0, le=5)


class WhereOut(BaseModel):
    node_id: str


# Half a CPU on nodes of one: each node holds one replica beside its edge, so two replicas
# are on two nodes whatever Serve's placement prefers.
@ember.deployment(route="/where", num_cpus=0.5, warm_floor=0, max_replicas=2,
                  target_queue_depth=1, scaledown_after_s=1.0)
class Where:
    async def __call__(self, body: WhereIn) -> WhereOut:
        await asyncio.sleep(body.sleep_s)
        return WhereOut(node_id=ray.get_runtime_context().get_node_id())


app = ember.App([Where], name="two-nodes", warm_pool=0)
