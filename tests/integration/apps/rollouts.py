"""Three versions of one deployment for rollouts: stable, a healthy candidate, a bad one.

Stable is kept warm; the candidates start at zero, so a rollout must wake them before it
moves traffic. Version 3 fails 3 requests in every 10 (a 500 from user code).
"""

from __future__ import annotations

from pydantic import BaseModel

import ember


class Text(BaseModel):
    text: str


def _version(label: str, floor: int, fail_in_10: int = 0) -> type:
    @ember.deployment(name="Embed", version=label, route="/embed", warm_floor=floor,
                      max_replicas=1, num_cpus=0.05, max_ongoing_requests=64,
                      scaledown_after_s=600)
    class Embed:
        def __init__(self) -> None:
            self.served = 0

        async def __call__(self, body: Text) -> dict[str, str]:
            self.served += 1
            if self.served % 10 < fail_in_10:
                raise RuntimeError(f"version {label} fails on purpose")
            return {"version": label, "text": body.text}

    return Embed


app = ember.App([_version("1", 1), _version("2", 0), _version("3", 0, fail_in_10=3)],
                name="rollout-tests", warm_pool=0)
