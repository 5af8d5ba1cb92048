"""``ember.App``: a named group of deployments served together behind Ember's edges, and the
:class:`Protocol` interface of the client APIs (OpenAI, Open Inference) an App serves on top;
the adapters themselves are the edge's (``edge/protocols/``)."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from typing import Protocol as TypingProtocol

from ember import settings
from ember.app.config import NAME_PATTERN
from ember.app.decorator import DeploymentSpec, RouteSpec, get_spec
from ember.app.pipeline import PipelineSpec
from ember.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry


class Gateway(TypingProtocol):
    """What an adapter may do: call a handler, stream from one, ask about readiness, and
    register its own metric families in the edge's registry (served at ``/metrics``)."""

    async def call(self, deployment: str, attr: str, body: Any, request_id: str) -> Any: ...

    def stream(self, deployment: str, attr: str, body: Any, request_id: str, *,
               model_id: str | None = None) -> AsyncIterator[Any]:
        """``model_id``: Ray Serve's multiplexed model id (a LoRA adapter's name), so the
        request goes to a replica that holds that model when one does."""
        ...

    @property
    def registry(self) -> CollectorRegistry: ...

    def ready(self) -> bool: ...


class Protocol(ABC):
    """One client-facing API served by the ingress."""

    @abstractmethod
    def validate(self, app: App) -> None:
        """Check, when the App is built, that the deployments the adapter targets fit.

        Raises:
            ConfigError: naming what does not fit.
        """

    @abstractmethod
    def install(self, api: FastAPI, gateway: Gateway) -> None:
        """Add this protocol's routes to the ingress app."""

    def deployments(self) -> tuple[str, ...]:
        """The deployments this protocol's routes call: a body sent to one of its routes may
        be as large as the largest of their ``max_request_bytes`` (none: the edge's default
        of 1 MiB)."""
        return ()

    def deployment_for(self, path_params: Mapping[str, Any]) -> str | None:
        """The deployment a request calls, where its path says (``/v2/models/{name}/infer``):
        its body limit is that deployment's alone. ``None``: any of :meth:`deployments`."""
        return None


class App:
    """An application: deployments plus the routes the edges serve for them.

    Args:
        deployments: Classes decorated with ``@ember.deployment`` (their routes are served)
            and pipelines from ``ember.pipeline`` (their stages run as deployments; only
            the pipeline's route is served).
        name: Ray Serve application name.
        curl: Optional example request printed by ``ember run``; ``{url}`` is replaced by
            the server's base URL.
        protocols: Client APIs served on top (OpenAI embeddings, Open Inference v2).
        warm_pool: Pre-warmed pool replicas that serve deployments at zero replicas while
            their own replicas start; ``None`` reads ``EMBER_WARM_POOL`` (default 1), 0 = off.
        warm_pool_bytes: Model memory (torch parameters and buffers) each pool replica keeps
            constructed, least recently used out; ``None`` reads ``EMBER_WARM_POOL_BYTES``
            (default 2 GiB).
        preload_modules: More modules the warm runtime's workers import before they become
            replicas, beside the deployments' own modules: what a ``setup()`` imports only
            when it runs (transformers' model code is seconds of CPU), so that a cold start
            does not. Every worker of the local cluster imports them, edges included.

    Raises:
        ConfigError: on duplicate deployment names or routes.

    Example:
        >>> from ember.app.decorator import deployment
        >>> @deployment(route="/ping")
        ... class Ping:
        ...     def __call__(self) -> str:
        ...         return "pong"
        >>> [r.path for r in App([Ping]).routes()]
        ['/ping']
    """

    def __init__(
        self,
        deployments: Sequence[Any],
        *,
        name: str = "ember",
        curl: str | None = None,
        protocols: Sequence[Protocol] = (),
        warm_pool: int | None = None,
        warm_pool_bytes: int | None = None,
        preload_modules: Sequence[str] = (),
    ) -> None:
        if not NAME_PATTERN.match(name):
            raise ConfigError(f"app name {name!r} must look like 'ember' or 'my-app'")
        if not deployments:
            raise ConfigError("an App needs at least one deployment")
        self.name = name
        self.curl = curl
        self.protocols = tuple(protocols)
        self.warm_pool = _count("warm_pool", warm_pool)
        self.warm_pool_bytes = _count("warm_pool_bytes", warm_pool_bytes)
        self.preload_modules = _module_names(preload_modules)
        self.pipelines = tuple(d for d in deployments if isinstance(d, PipelineSpec))
        self.served = tuple(get_spec(d) for d in deployments if not isinstance(d, PipelineSpec))
        stages = [stage for pipe in self.pipelines for stage in pipe.stages]
        self.specs: tuple[DeploymentSpec, ...] = tuple(
            {spec.name: spec for spec in [*self.served, *stages]}.values()
        )
        #: Every served deployment by the name callers know, its versions in listed order:
        #: the first is stable and gets all traffic until told otherwise.
        self.versions: dict[str, tuple[str, ...]] = {}
        for spec in self.served:
            self.versions[spec.group] = (*self.versions.get(spec.group, ()), spec.name)
        self._check_unique(stages)
        self._check_versions()
        for protocol in self.protocols:
            protocol.validate(self)

    def routes(self) -> Iterator[RouteSpec]:
        """Every HTTP route: those of listed deployments, then pipelines', in order.

        A versioned deployment's routes are its stable version's; which version serves a
        request is decided per request (``control/traffic.py``).
        """
        stable = {names[0] for names in self.versions.values()}
        for spec in self.served:
            if spec.name in stable:
                yield from (r for r in spec.routes if r.http_servable)
        for pipe in self.pipelines:
            yield pipe.route_spec()

    def pool_specs(self, *, gpu: bool = False) -> list[DeploymentSpec]:
        """Deployments a warm pool may serve: those opted in, CPU-only ones in the CPU pool
        and GPU ones in the GPU pool (see ``control/pool.py``)."""
        if self.warm_pool == 0:
            return []
        return [s for s in self.specs
                if s.options.warm_pool and (s.options.num_gpus > 0) == gpu]

    def timeouts(self) -> dict[str, float]:
        """Per-route timeouts that differ from the deployment's (pipelines own theirs)."""
        return {pipe.route: pipe.request_timeout_s for pipe in self.pipelines}

    def spec(self, name: str) -> DeploymentSpec:
        """The deployment called ``name``.

        Raises:
            KeyError: if there is none.
        """
        for spec in self.specs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def _check_unique(self, stages: list[DeploymentSpec]) -> None:
        by_name: dict[str, DeploymentSpec] = {}
        for spec in [*self.served, *stages]:
            if by_name.setdefault(spec.name, spec).cls is not spec.cls:
                raise ConfigError(f"two different classes are named {spec.name!r} in one App")
        names = [s.name for s in self.served]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"deployment names must be unique in an App, repeated: {dupes}")
        seen: dict[tuple[str, str], str] = {}
        for r in self.routes():
            key = (r.http_method, r.path)
            if key in seen:
                raise ConfigError(
                    f"{r.http_method} {r.path} is served by both {seen[key]} and {r.deployment}"
                )
            seen[key] = r.deployment

    def _check_versions(self) -> None:
        specs = {spec.name: spec for spec in self.served}
        for group, names in self.versions.items():
            if len(names) == 1:
                continue
            unversioned = [n for n in names if specs[n].options.version is None]
            if unversioned:
                raise ConfigError(f"{group!r} is listed more than once: give each class a "
                                  f"version, e.g. @ember.deployment(name={group!r}, version='2')")
            shapes = {n: sorted((r.http_method, r.path, r.attr) for r in specs[n].routes)
                      for n in names}
            if len({tuple(shape) for shape in shapes.values()}) > 1:
                raise ConfigError(f"the versions of {group!r} must serve the same routes: "
                                  + "; ".join(f"{n}: {shapes[n]}" for n in names))

    def __repr__(self) -> str:
        return f"App(name={self.name!r}, deployments={[s.name for s in self.specs]})"


#: A dotted module name: Ray joins the preload list with commas, so nothing else may pass.
_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _module_names(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` as a tuple, each a dotted module name (a lone string is refused: it would
    read as one module per letter)."""
    if isinstance(names, str):
        raise ConfigError(f"preload_modules must be a list of module names, got {names!r}")
    bad = [n for n in names if not isinstance(n, str) or not _MODULE_NAME.match(n)]
    if bad:
        raise ConfigError(f"preload_modules: {bad[0]!r} is not a module name like 'pkg.mod'")
    return tuple(names)


def _count(name: str, value: int | None) -> int:
    """``value``, or the setting of the same name (``EMBER_<NAME>``) when None; never < 0."""
    if value is None:
        value = int(getattr(settings.load(), name))
    if value < 0:
        raise ConfigError(f"{name} must be 0 or more, got {value}")
    return value
