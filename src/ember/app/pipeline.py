"""``ember.pipeline``: stages that are deployments of their own, chained behind one route.

Each stage keeps its own floor, batching and scaling (cheap CPU stages can stay warm while
the model stage scales to zero). The edge passes each stage's ``DeploymentResponse`` to
the next stage's handle, so intermediate results go from replica to replica through Ray's
object store without a round trip through the edge, and it wakes every cold stage at
once when a request arrives, so a cold pipeline costs about its slowest stage's cold start
rather than the sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ember.app.config import NAME_PATTERN, check_route
from ember.app.decorator import DeploymentSpec, RouteSpec, get_spec
from ember.errors import ConfigError


@dataclass(frozen=True)
class PipelineSpec:
    """A named chain of stage deployments served at ``route``."""

    name: str
    route: str
    stages: tuple[DeploymentSpec, ...]
    request_timeout_s: float

    def route_spec(self) -> RouteSpec:
        first, last = self.stages[0].routes[0], self.stages[-1].routes[0]
        return RouteSpec(
            path=self.route,
            http_method="POST",
            deployment=self.stages[0].name,
            attr=first.attr,
            input_model=first.input_model,
            output_model=last.output_model,
            is_async=True,
            kind=first.kind,
            chain=tuple((s.name, s.routes[0].attr) for s in self.stages),
        )


def pipeline(
    stages: Sequence[Any], *, route: str, name: str | None = None, request_timeout_s: float = 60.0
) -> PipelineSpec:
    """Compose decorated classes into a pipeline served at ``POST route``.

    Each stage's ``__call__`` receives the previous stage's return value; the first stage
    receives the request body, the last stage's return value is the response.

    Raises:
        ConfigError: with fewer than two stages, a stage that is not a deployment, or a
            stage without ``__call__``.

    Example:
        >>> pipe = pipeline([Tokenize, Encode, Pool], route="/embed")  # doctest: +SKIP
        >>> app = ember.App([pipe])                                   # doctest: +SKIP
    """
    try:
        check_route(route)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    specs = tuple(get_spec(stage) for stage in stages)
    if len(specs) < 2:
        raise ConfigError("a pipeline needs at least two stages")
    for spec in specs:
        if not spec.routes or spec.routes[0].attr != "__call__":
            raise ConfigError(f"pipeline stage {spec.name} needs __call__(self, value)")
        if spec.routes[0].is_stream:
            raise ConfigError(f"pipeline stage {spec.name} cannot stream")
    if specs[0].routes[0].kind == "tensor":
        raise ConfigError(f"the first stage ({specs[0].name}) must take a JSON body")
    pipe_name = name or "-".join(s.name for s in specs)
    if not NAME_PATTERN.match(pipe_name):
        raise ConfigError(f"pipeline name {pipe_name!r} must look like 'embed-pipeline'")
    return PipelineSpec(pipe_name, route, specs, request_timeout_s)
