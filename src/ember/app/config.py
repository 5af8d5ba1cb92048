"""Deployment options: one Pydantic model, units in the field names.

``DeploymentOptions`` is what ``@ember.deployment(...)`` validates; ``to_ray_options``
turns it into the keyword arguments of ``ray.serve.deployment`` so that Ray Serve keeps
doing what it does (replicas, placement, queues) while Ember decides how many replicas.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypedDict

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from ember import settings
from ember.app.batching import Batch

#: Deployment and route names reach URLs, metrics labels and cache keys: keep them plain.
NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,31}$"
#: A Serve deployment Ember made: a name, and for a versioned class ``@version``.
SERVE_NAME_PATTERN = re.compile(NAME_PATTERN.pattern[:-1] + "(@" + VERSION_PATTERN[1:-1] + ")?$")
ROUTE_PATTERN = re.compile(r"^/[A-Za-z0-9_\-./{}]*$")

#: Import path Ray Serve's controller resolves for Ember-managed deployments.
POLICY_IMPORT_PATH = "ember.control.ray_policy:EmberAutoscalingPolicy"
#: ``router=`` values: Ray Serve's own power-of-two-choices router, or Ember's prefix router.
ROUTERS = ("default", "prefix")
#: Import path of the request router ``router="prefix"`` gives a deployment's handles.
PREFIX_ROUTER_IMPORT_PATH = "ember.control.prefix_router:PrefixRouter"
#: How often a prefix-routed replica reports whether it is warm (Ray's default is 10 s).
PREFIX_ROUTING_STATS_PERIOD_S = 2.0
#: How often a stopping Serve replica counts its requests in flight; it sleeps this long
#: before the first count, so each stop of the server (and each replica taken down) waits it
#: even when nothing is in flight. Counting is cheap; Serve's default is 2 s.
SHUTDOWN_WAIT_LOOP_S = 0.1


class DeploymentKwargs(TypedDict, total=False):
    """The keyword options of ``@ember.deployment(...)``: :class:`DeploymentOptions`' fields.

    Spelled out so a type checker sees every documented option (a test keeps the keys equal
    to ``DeploymentOptions.model_fields``); the constraints are the model's, checked when
    the decorator is applied.
    """

    name: str | None
    version: str | None
    route: str | None
    warm_floor: int
    max_replicas: int
    target_queue_depth: float
    max_queue: int
    max_ongoing_requests: int | None
    batch: Batch | None
    scaledown_after_s: float
    request_timeout_s: float
    max_request_bytes: int
    num_cpus: float
    num_gpus: float
    graceful_shutdown_s: float
    cold_start_budget_s: float | None
    preload: bool
    warm_pool: bool
    warm_schedule: list[str]
    warm_schedule_tz: str
    retry_on_replica_loss: bool
    snapshot_url: str | None
    snapshot_version: str
    max_start_attempts: int
    health_check_period_s: float
    health_check_timeout_s: float
    router: str
    prefix_max_queue_gap: int


class DeploymentOptions(BaseModel):
    """Options of one deployment, validated when the decorator is applied.

    Example:
        >>> DeploymentOptions(route="/mlp", warm_floor=1).max_replicas
        4
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(default=None, description="Deployment name; default: class name.")
    version: str | None = Field(
        default=None, pattern=VERSION_PATTERN,
        description="Version label; classes with one name are versions of one deployment.",
    )
    route: str | None = Field(default=None, description="HTTP path of the handler, e.g. '/embed'.")
    warm_floor: NonNegativeInt = Field(default=0, description="Replicas kept warm; 0 = to zero.")
    max_replicas: PositiveInt = 4
    target_queue_depth: PositiveFloat = Field(
        default=2.0, description="Ongoing + queued requests per replica the autoscaler aims for."
    )
    max_queue: PositiveInt = Field(
        default=64, description="Requests waiting for a replica beyond which callers get 503."
    )
    max_ongoing_requests: PositiveInt | None = Field(
        default=None, description="Concurrent requests per replica; derived when unset."
    )
    batch: Batch | None = Field(default=None, description="Dynamic batching; None = off.")
    scaledown_after_s: NonNegativeFloat = Field(
        default=60.0, description="Idle seconds before replicas drop towards the floor."
    )
    request_timeout_s: PositiveFloat = Field(default=60.0, description="Then 504; work cancelled.")
    max_request_bytes: PositiveInt = Field(default=1 << 20, description="Then 413.")
    num_cpus: NonNegativeFloat = 1.0
    num_gpus: NonNegativeFloat = 0.0
    graceful_shutdown_s: PositiveFloat = Field(
        default=20.0, description="A replica being removed gets this long to finish in-flight work."
    )
    cold_start_budget_s: PositiveFloat | None = Field(
        default=None, description="Declared budget for a request that meets zero replicas."
    )
    preload: bool = Field(
        default=False, description="Construct in the warm pool before any request arrives."
    )
    warm_pool: bool = Field(
        default=True, description="Let the app's warm pool serve requests at zero replicas."
    )
    warm_schedule: list[str] = Field(
        default_factory=list,
        description="Windows with a floor of max(1, warm_floor), e.g. ['Mon-Fri 08:00-20:00'].",
    )
    warm_schedule_tz: str = Field(default="UTC", description="Time zone of warm_schedule.")
    retry_on_replica_loss: bool = Field(
        default=True,
        description="Retry a request once on another replica if its replica died mid-call "
        "(inference is idempotent; turn off for handlers with side effects).",
    )
    snapshot_url: str | None = Field(
        default=None,
        description="Weights URL whose node snapshot the replicas map: a new replica prefers "
        "a node that holds it (`ember cache warm URL --snapshot VERSION --all-nodes`).",
    )
    snapshot_version: str = Field(
        default="", description="Code version of that snapshot, as given to --snapshot."
    )
    max_start_attempts: PositiveInt = Field(
        default=3, description="Failed replica starts in a row before callers get 503."
    )
    health_check_period_s: PositiveFloat = 2.0
    health_check_timeout_s: PositiveFloat = 10.0
    router: str = Field(
        default="default",
        description="How a request picks a replica: 'default' (Ray Serve's power of two "
        "choices) or 'prefix' (the replica that served the prompt's prefix, unless it is cold "
        "or overloaded; see docs/prefix-routing.md).",
    )
    prefix_max_queue_gap: NonNegativeInt = Field(
        default=8,
        description="With router='prefix': a replica whose queue is longer than the least "
        "loaded one's by more than this is not chosen for its prefix.",
    )

    @field_validator("router")
    @classmethod
    def _check_router(cls, value: str) -> str:
        if value not in ROUTERS:
            raise ValueError(
                f"unknown router {value!r}: use 'prefix' (requests sharing a prompt prefix go "
                "to the replica that holds it) or 'default' (Ray Serve's power of two choices)"
            )
        return value

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str | None) -> str | None:
        if value is not None and not NAME_PATTERN.match(value):
            raise ValueError(
                f"name {value!r} must start with a letter and use only letters, digits, '_' or '-'"
                " (at most 64 characters), e.g. 'embedder'"
            )
        return value

    @field_validator("route")
    @classmethod
    def _check_route(cls, value: str | None) -> str | None:
        return check_route(value) if value is not None else None

    @field_validator("warm_schedule")
    @classmethod
    def _check_schedule(cls, value: list[str]) -> list[str]:
        from ember.app.schedule import parse_schedule

        parse_schedule(value)
        return value

    @field_validator("warm_schedule_tz")
    @classmethod
    def _check_tz(cls, value: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r}, e.g. 'Europe/Paris'") from None
        return value

    @model_validator(mode="after")
    def _check_cross_fields(self) -> DeploymentOptions:
        if self.warm_floor > self.max_replicas:
            raise ValueError(
                f"warm_floor ({self.warm_floor}) must not exceed max_replicas ({self.max_replicas})"
            )
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < math.ceil(
            self.target_queue_depth
        ):
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) must be at least "
                f"target_queue_depth ({self.target_queue_depth}), or the target is unreachable"
            )
        if "prefix_max_queue_gap" in self.model_fields_set and self.router != "prefix":
            raise ValueError(
                f"prefix_max_queue_gap ({self.prefix_max_queue_gap}) applies only with "
                f"router='prefix' (router is {self.router!r})"
            )
        if self.snapshot_version and self.snapshot_url is None:
            raise ValueError(
                f"snapshot_version ({self.snapshot_version!r}) needs snapshot_url, the weights "
                "URL it is a snapshot of"
            )
        return self

    def ongoing_limit(self) -> int:
        """Concurrent requests a replica accepts (Ray Serve's ``max_ongoing_requests``).

        Derived as twice the target so that a replica under target load still has room for
        a burst while the autoscaler reacts, instead of Ray's fixed default of 5.
        """
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        # With batching, a replica must admit at least two full batches of requests, or
        # Ray Serve's router caps the batch at the concurrency limit (its default is 5).
        batch_room = 2 * self.batch.max_size if self.batch is not None else 0
        return max(2, math.ceil(self.target_queue_depth * 2), batch_room)

    def with_env_overrides(self) -> DeploymentOptions:
        """Apply process-wide overrides (``EMBER_SCALEDOWN_AFTER_S``) the operator set."""
        seconds = settings.load().scaledown_after_s
        if seconds is None:
            return self
        return self.model_copy(update={"scaledown_after_s": seconds})


def serve_logging() -> dict[str, Any]:
    """Ray Serve logging for Ember's deployments: access logs only when asked for.

    Ray Serve writes (and streams to the driver) a log line per request in every replica a
    request passes; on a small machine that costs a large share of the CPU a request needs.
    Ember's /metrics already counts and times every request. ``EMBER_ACCESS_LOG=1`` turns
    the per-request lines back on.
    """
    return {"enable_access_log": settings.load().access_log}


def check_name(value: str, what: str) -> str:
    """Refuse a name from a request that could reach the filesystem, a cache or a log.

    Raises:
        BadRequest: for traversal attempts (``../``, ``%2e%2e%2f`` once decoded, absolute
            paths, NUL, backslashes) and anything else that is not a plain name.
    """
    if not SERVE_NAME_PATTERN.match(value):
        from ember.errors import BadRequest

        raise BadRequest(f"{what} name {value[:80]!r} is not a valid name "
                         "(letters, digits, '_' and '-', starting with a letter; "
                         "a version after '@')")
    return value


def check_route(value: str) -> str:
    """Validate an HTTP route, returning it unchanged.

    Raises:
        ValueError: with a message that says what a valid route looks like.
    """
    if not value.startswith("/"):
        raise ValueError(f"route must start with '/', e.g. '/embed' (got {value!r})")
    if value.startswith("/-/") or value in {"/healthz", "/readyz", "/metrics", "/docs"}:
        raise ValueError(f"route {value!r} is reserved by Ember; pick another, e.g. '/embed'")
    if ".." in value or not ROUTE_PATTERN.match(value):
        raise ValueError(
            f"route {value!r} may contain only letters, digits and '_-./{{}}', e.g. '/v1/embed'"
        )
    return value


def to_ray_options(
    options: DeploymentOptions, *, name: str, placement: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``ray.serve.deployment`` that implement ``options``.

    Ray's own delays are zeroed: the Ember policy owns all timing (``scaledown_after_s``),
    so that it can be tested as a pure function and no second timer stacks on top of it.
    ``placement`` adds actor options that steer where replicas start (see
    ``control/snapshot_placement.py``).
    """
    policy_kwargs = {
        "scaledown_after_s": options.scaledown_after_s,
        "target_queue_depth": options.target_queue_depth,
        "warm_schedule": list(options.warm_schedule),
        "warm_schedule_tz": options.warm_schedule_tz,
        "scheduled_floor": max(1, options.warm_floor),
    }
    return {
        "name": name,
        **router_options(options),
        "max_ongoing_requests": options.ongoing_limit(),
        "max_queued_requests": options.max_queue,
        "graceful_shutdown_timeout_s": options.graceful_shutdown_s,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_WAIT_LOOP_S,
        "health_check_period_s": options.health_check_period_s,
        "health_check_timeout_s": options.health_check_timeout_s,
        "max_constructor_retry_count": options.max_start_attempts,
        "ray_actor_options": {"num_cpus": options.num_cpus, "num_gpus": options.num_gpus,
                              **(placement or {})},
        "logging_config": serve_logging(),
        "autoscaling_config": {
            "min_replicas": options.warm_floor,
            "initial_replicas": options.warm_floor,
            "max_replicas": options.max_replicas,
            "target_ongoing_requests": options.target_queue_depth,
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,
            "downscale_to_zero_delay_s": 0.0,
            # Handles push queue metrics this often; the default of 10 s is the "detect"
            # phase of every cold start.
            "metrics_interval_s": 0.25,
            "look_back_period_s": 1.0,
            "policy": {"policy_function": POLICY_IMPORT_PATH, "policy_kwargs": policy_kwargs},
        },
    }


def router_options(options: DeploymentOptions) -> dict[str, Any]:
    """``request_router_config`` for ``router="prefix"``; nothing for Ray's default router."""
    if options.router != "prefix":
        return {}
    return {"request_router_config": {
        "request_router_class": PREFIX_ROUTER_IMPORT_PATH,
        "request_router_kwargs": {"max_queue_gap": options.prefix_max_queue_gap},
        "request_routing_stats_period_s": PREFIX_ROUTING_STATS_PERIOD_S,
    }}
