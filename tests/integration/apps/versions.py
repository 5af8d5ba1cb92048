"""Two versions of one deployment, each kept warm: the split is about routing, not starts."""

from __future__ import annotations

from pydantic import BaseModel

import ember


class Text(BaseModel):
    text: str


def _version(label: str) -> type:
    @ember.deployment(name="Embed", version=label, route="/embed", warm_floor=1,
                      max_replicas=1, num_cpus=0.05, max_ongoing_requests=64)
    class Embed:
        async def __call__(self, body: Text) -> dict[str, str]:
            return {"version": label, "text": body.text}

        @ember.route("/score")
        async def score(self, body: Text) -> list[float]:
            return [float(label), 0.0]  # versions 1 and 2 are exactly 1.0 apart

    return Embed


app = ember.App([_version("1"), _version("2")], name="versions-tests", warm_pool=0)
