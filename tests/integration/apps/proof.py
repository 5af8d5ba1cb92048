"""Deployments for the live proofs of batching's bisection, per-stage pipeline scaling and
the cold-start metrics (``tests/integration/test_live_claims.py``)."""

from __future__ import annotations

import asyncio
import gc

from pydantic import BaseModel

import ember


class Item(BaseModel):
    value: int
    poison: bool = False


@ember.deployment(route="/bisect", warm_floor=1, max_replicas=1, num_cpus=0.1,
                  max_ongoing_requests=128, target_queue_depth=128,
                  # A batch goes when 64 items wait: the long wait only covers stragglers.
                  batch=ember.Batch(max_size=64, max_wait_ms=10_000))
class Bisect:
    """Sums items; a batch holding a poisoned item raises. Counts its forward calls."""

    def setup(self) -> None:
        self.forwards: list[int] = []

    def __call__(self, items: list[Item]) -> list[int]:
        self.forwards.append(len(items))
        if any(item.poison for item in items):
            raise ValueError("a poisoned item")
        return [item.value * 2 for item in items]

    @ember.route("/bisect/forwards", method="GET")
    def counted(self) -> dict[str, list[int]]:
        return {"forwards": self.forwards}

    @ember.route("/bisect/reset", method="POST")
    def reset(self) -> dict[str, int]:
        self.forwards.clear()
        return {"forwards": 0}


class Value(BaseModel):
    n: int


# The three stages may each grow to 3 replicas by the same rule; only the slow one has the
# queue that asks for more.
stage = ember.deployment(warm_floor=1, max_replicas=3, num_cpus=0.05, target_queue_depth=3,
                         max_ongoing_requests=4, scaledown_after_s=2.0)


@stage
class Front:
    def __call__(self, body: Value) -> int:
        return body.n


@stage
class SlowMiddle:
    async def __call__(self, n: int) -> int:
        await asyncio.sleep(1.0)
        return n + 1


@stage
class Back:
    def __call__(self, n: int) -> dict[str, int]:
        return {"n": n}


chain = ember.pipeline([Front, SlowMiddle, Back], route="/chain", name="chain")


@ember.deployment(route="/cold-one", warm_floor=0, max_replicas=1, num_cpus=0.05,
                  scaledown_after_s=1.0)
class ColdOne:
    async def setup(self) -> None:
        # Objects out of the collector's reach when setup (the load) began.
        self.frozen_at_setup = gc.get_freeze_count()
        await asyncio.sleep(0.5)  # a model load worth timing

    def __call__(self, body: Value) -> dict[str, int]:
        return {"n": body.n, "frozen_at_setup": self.frozen_at_setup}


app = ember.App([Bisect, chain, ColdOne], name="live-claims", warm_pool=0)
