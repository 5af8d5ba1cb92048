"""A plain Serve deployment that reports what Ray's private switches did inside its replica, and an
Ember app whose handles go quiet."""

from __future__ import annotations

import gc
import os
from typing import Any

from pydantic import BaseModel
from ray import serve

import ember
from ember import ray_internals


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Probe:
    def __init__(self) -> None:
        from ember.control.listeners import bind_replica_grpc_to_node_ip

        bind_replica_grpc_to_node_ip()  # as Ember's replica classes do

    async def __call__(self) -> dict[str, Any]:
        from ray.serve._private import constants, replica

        switches = ray_internals.SERVE_ENV_SWITCHES
        return {
            "pid": os.getpid(),
            "gc_frozen": gc.get_freeze_count(),
            "env": {name: os.environ.get(name) for name in switches},
            # What Serve parsed from each switch, in this replica.
            "parsed": {name: getattr(constants, name.removeprefix("RAY_SERVE_"), None)
                       if not hasattr(constants, name) else getattr(constants, name)
                       for name in switches},
            "bind_wrapped": getattr(getattr(replica, "add_port_to_grpc_server"),  # noqa: B009
                                    "__ember_wrapped__", False),
        }


class QuietIn(BaseModel):
    text: str


@ember.deployment(route="/quiet", warm_floor=1, num_cpus=0.05)
class Quiet:
    """An Ember deployment nobody calls after its first request: its handles go quiet."""

    async def __call__(self, body: QuietIn) -> QuietIn:
        return body


quiet_app = ember.App([Quiet], name="quiet-pushes", warm_pool=0)


class Spinner:
    """A plain actor class (``ray.remote`` it): a cold start that keeps its core busy."""

    def pid(self) -> int:
        return os.getpid()

    def spin(self, seconds: float) -> int:
        import time

        end, turns = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            turns += 1
        return turns
