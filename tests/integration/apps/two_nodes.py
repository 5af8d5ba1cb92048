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


class NearOut(BaseModel):
    node_id: str
    restored: bool


class _Near:
    """Maps its snapshot in ``setup``, as a model deployment does, and says where it runs."""

    weights = ""
    version = ""

    def setup(self) -> None:
        from ember.loaders import snapshot_load

        self.restored = snapshot_load(self.weights, code_version=self.version).restored

    async def __call__(self, body: WhereIn) -> NearOut:
        return NearOut(node_id=ray.get_runtime_context().get_node_id(), restored=self.restored)


def near_app(weights: str, versions: dict[str, str]) -> ember.App:
    """One deployment per ``route -> snapshot version`` of ``weights``, each from zero."""
    deployments = []
    for route, version in versions.items():
        name = "Near" + route.replace("-", "").title()
        # The decorator reads the handlers from the class itself, not its bases.
        cls = type(name, (_Near,), {"weights": weights, "version": version,
                                    "setup": _Near.setup, "__call__": _Near.__call__})
        deployments.append(ember.deployment(
            route=f"/{route}", num_cpus=0.25, warm_floor=0, max_replicas=1,
            scaledown_after_s=1.0, snapshot_url=weights, snapshot_version=version)(cls))
    return ember.App(deployments, name="near", warm_pool=0)


# Two replicas kept up (a floor of two), a quarter CPU each: both fit on one node when the
# other is lost.
survivor_app = ember.App(
    [ember.deployment(route="/where", num_cpus=0.25, warm_floor=2, max_replicas=2,
                      target_queue_depth=4)(type("Where", (), {"__call__": Where.__call__}))],
    name="survivor", warm_pool=0)
