"""``@ember.deployment`` and ``@ember.route``: turn a class into a served deployment.

The decorator validates everything it can when it is applied (options, handler
signatures, body types), so a mistake surfaces at import time with a message that says
what to do, not as a 500 on the first request. It returns the class itself, with a
:class:`DeploymentSpec` attached, so the class stays usable (and unit-testable) as is.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, Unpack, overload

from pydantic import BaseModel, TypeAdapter, ValidationError

from ember.app.batching import Batch
from ember.app.config import (
    NAME_PATTERN,
    DeploymentKwargs,
    DeploymentOptions,
    check_route,
)
from ember.errors import ConfigError

T = TypeVar("T", bound=type)
F = TypeVar("F", bound=Callable[..., Any])

HttpMethod = Literal["GET", "POST", "PUT", "DELETE"]
#: How a handler takes its input: nothing, one pydantic body, a list of items (batch form),
#: or a tensor whose rows are the items (tensor form, stacked and split by Ember).
#: "value" is any other annotation: served with FastAPI's Body() when pydantic can parse
#: it (``dict[str, int]``), and passed through as is between pipeline stages.
BodyKind = Literal["none", "model", "batch", "tensor", "value"]
_SPEC_ATTR = "__ember_deployment__"
_ROUTE_ATTR = "__ember_route__"


@dataclass(frozen=True)
class RouteSpec:
    """One HTTP route served by a deployment method."""

    path: str
    http_method: HttpMethod
    deployment: str
    attr: str
    input_model: Any
    output_model: Any
    is_async: bool
    is_stream: bool = False
    kind: BodyKind = "model"
    #: For a pipeline route: the (deployment, attr) stages called in order, each with the
    #: previous stage's result. Empty for a plain route.
    chain: tuple[tuple[str, str], ...] = ()

    @property
    def http_servable(self) -> bool:
        """Whether the edge can parse this route's body from JSON by itself."""
        if self.kind == "tensor" or not self.path:
            return False
        if self.kind != "value":
            return True
        try:
            TypeAdapter(self.input_model)
        except Exception:  # a type pydantic cannot build a schema for (a tensor, a class)
            return False
        return True


@dataclass(frozen=True)
class DeploymentSpec:
    """What Ember knows about a decorated class."""

    cls: type
    name: str
    options: DeploymentOptions
    routes: tuple[RouteSpec, ...] = field(default_factory=tuple)
    #: The name callers know; ``name`` is ``group@version`` for a versioned class.
    group: str = ""

    @property
    def version(self) -> str:
        """The version label; "1" for a class declared without one."""
        return self.options.version or "1"

    @property
    def has_setup(self) -> bool:
        return callable(getattr(self.cls, "setup", None))


@overload
def deployment(cls: T, /) -> T: ...


@overload
def deployment(**options: Unpack[DeploymentKwargs]) -> Callable[[T], T]: ...


def deployment(cls: Any = None, /, **options: Any) -> Any:
    """Declare a class as an Ember deployment.

    Works bare (``@ember.deployment``) and with keyword-only options
    (``@ember.deployment(route="/mlp", warm_floor=1)``); see :class:`DeploymentOptions`.

    The class may define ``setup(self)``, run once per replica before it reports ready, and
    ``__call__(self, body: In) -> Out`` (sync or async), served at ``POST {route}``. Other
    methods are exposed with :func:`route`.

    Raises:
        ConfigError: when an option or a handler signature is invalid.

    Example:
        >>> from pydantic import BaseModel
        >>> class In(BaseModel):
        ...     x: float
        >>> @deployment(route="/double")
        ... class Double:
        ...     def __call__(self, body: In) -> float:
        ...         return body.x * 2
        >>> Double.__ember_deployment__.routes[0].path
        '/double'
    """
    if cls is not None and options:
        raise ConfigError("use @ember.deployment or @ember.deployment(**options), not both")
    if cls is not None:
        return _apply(cls, {})
    return lambda target: _apply(target, options)


def route(path: str | None = None, *, method: HttpMethod = "POST") -> Callable[[F], F]:
    """Expose another method of a deployment at ``path``.

    Without a path the method is an internal handler: protocol adapters (OpenAI, Open
    Inference v2) and pipelines call it, but it gets no HTTP route of its own.

    Example:
        >>> class M:
        ...     @route("/m/info", method="GET")
        ...     def info(self) -> dict[str, str]:
        ...         return {"model": "m"}
    """
    if path is not None:
        try:
            check_route(path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if method not in ("GET", "POST", "PUT", "DELETE"):
        raise ConfigError(f"method must be one of GET, POST, PUT, DELETE (got {method!r})")

    def mark(fn: F) -> F:
        setattr(fn, _ROUTE_ATTR, (path or "", method))
        return fn

    return mark


def get_spec(obj: Any) -> DeploymentSpec:
    """Return the spec of a decorated class.

    Raises:
        ConfigError: if ``obj`` was not decorated with ``@ember.deployment``.
    """
    spec = getattr(obj, _SPEC_ATTR, None)
    if not isinstance(spec, DeploymentSpec) or spec.cls is not obj:
        raise ConfigError(f"{obj!r} is not an Ember deployment; decorate it with @ember.deployment")
    return spec


def _apply(cls: Any, options: dict[str, Any]) -> Any:
    if not inspect.isclass(cls):
        raise ConfigError(f"@ember.deployment decorates classes, got {type(cls).__name__}")
    if options.get("batch") is not None and "target_queue_depth" not in options:
        # A batching replica is busy, not overloaded, with a full batch in flight.
        batch = options["batch"]
        size = batch.max_size if isinstance(batch, Batch) else dict(batch).get("max_size", 32)
        options = {**options, "target_queue_depth": float(size)}
    try:
        opts = DeploymentOptions(**options)
    except ValidationError as exc:
        raise ConfigError(_first_error(exc, cls.__name__)) from None
    group = opts.name or cls.__name__
    if not NAME_PATTERN.match(group):
        raise ConfigError(f"class name {group!r} is not a valid deployment name; pass name='...'")
    # Each version is a Serve deployment of its own, with its own replicas.
    name = group if opts.version is None else f"{group}@{opts.version}"
    setup = getattr(cls, "setup", None)
    if setup is not None and (not callable(setup) or _required_params(setup) > 1):
        raise ConfigError(f"{cls.__name__}.setup must be a method taking only self")
    routes = _collect_routes(cls, name, opts, group)
    if not routes:
        raise ConfigError(
            f"{cls.__name__} has nothing to serve: define __call__(self, body) or mark a method"
            " with @ember.route('/path')"
        )
    _check_unique_paths(routes)
    setattr(cls, _SPEC_ATTR, DeploymentSpec(cls=cls, name=name, options=opts, routes=routes,
                                            group=group))
    return cls


def _collect_routes(cls: type, name: str, opts: DeploymentOptions,
                    group: str) -> tuple[RouteSpec, ...]:
    routes: list[RouteSpec] = []
    call = cls.__dict__.get("__call__")
    if call is not None:
        path = opts.route or f"/{group.lower()}"
        routes.append(_route_spec(cls, "__call__", call, path, "POST", name))
    elif opts.route is not None:
        raise ConfigError(f"route={opts.route!r} needs {cls.__name__}.__call__ to serve it")
    for attr, member in cls.__dict__.items():
        marked = getattr(member, _ROUTE_ATTR, None)
        if marked is not None and attr != "__call__":
            routes.append(_route_spec(cls, attr, member, marked[0], marked[1], name))
    return tuple(routes)


def _route_spec(
    cls: type, attr: str, fn: Any, path: str, method: HttpMethod, name: str
) -> RouteSpec:
    where = f"{cls.__name__}.{attr}"
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # NameError and friends from unresolvable annotations
        raise ConfigError(f"cannot resolve type hints of {where}: {exc}") from None
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    if len(params) > 1:
        raise ConfigError(f"{where} must take at most one body argument, got {len(params)}")
    kind: BodyKind = "none"
    input_model: Any = None
    if params:
        if method == "GET":
            raise ConfigError(f"{where} is a GET route and cannot take a body")
        kind, input_model = _body_kind(where, attr, hints.get(params[0].name))
    is_stream = inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)
    if is_stream and kind in ("batch", "tensor"):
        raise ConfigError(f"{where}: a streaming handler cannot also be a batch handler")
    return RouteSpec(
        path=path,
        http_method=method,
        deployment=name,
        attr=attr,
        input_model=input_model,
        output_model=None if is_stream else hints.get("return"),
        is_async=inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn),
        is_stream=is_stream,
        kind=kind,
    )


def _body_kind(where: str, attr: str, annotation: Any) -> tuple[BodyKind, Any]:
    """Classify a handler's body annotation; refuse what cannot be served."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "model", annotation
    if typing.get_origin(annotation) is list:
        return "batch", annotation
    if _is_tensor_type(annotation):
        return "tensor", annotation
    if annotation is None:
        raise ConfigError(
            f"{where}: annotate the body, e.g. `def {attr}(self, body: EmbedRequest)` with a"
            " pydantic model, `items: list[str]` for batching, or `x: torch.Tensor`"
        )
    return "value", annotation


def _is_tensor_type(annotation: Any) -> bool:
    return inspect.isclass(annotation) and annotation.__module__ == "torch" and (
        annotation.__name__ == "Tensor"
    )


def _check_unique_paths(routes: tuple[RouteSpec, ...]) -> None:
    seen: set[tuple[str, str]] = set()
    for spec in routes:
        if not spec.path:
            continue
        key = (spec.http_method, spec.path)
        if key in seen:
            raise ConfigError(f"two handlers for {spec.http_method} {spec.path}")
        seen.add(key)


def _required_params(fn: Any) -> int:
    return sum(
        1
        for p in inspect.signature(fn).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


def _first_error(exc: ValidationError, where: str) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(part) for part in err["loc"]) or "options"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"@ember.deployment on {where}: {loc}: {msg}"
