"""``ember.App``: a named group of deployments served together behind one ingress."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ember.errors import ConfigError
from ember.platform.config import NAME_PATTERN
from ember.platform.decorator import DeploymentSpec, RouteSpec, get_spec


class App:
    """An application: deployments plus the routes the ingress serves for them.

    Args:
        deployments: Classes decorated with ``@ember.deployment``.
        name: Ray Serve application name.
        curl: Optional example request printed by ``ember run``; ``{url}`` is replaced by
            the server's base URL.

    Raises:
        ConfigError: on duplicate deployment names or routes.

    Example:
        >>> from ember.platform.decorator import deployment
        >>> @deployment(route="/ping")
        ... class Ping:
        ...     def __call__(self) -> str:
        ...         return "pong"
        >>> [r.path for r in App([Ping]).routes()]
        ['/ping']
    """

    def __init__(
        self, deployments: Sequence[Any], *, name: str = "ember", curl: str | None = None
    ) -> None:
        if not NAME_PATTERN.match(name):
            raise ConfigError(f"app name {name!r} must look like 'ember' or 'my-app'")
        if not deployments:
            raise ConfigError("an App needs at least one deployment")
        self.name = name
        self.curl = curl
        self.specs: tuple[DeploymentSpec, ...] = tuple(get_spec(d) for d in deployments)
        self._check_unique()

    def routes(self) -> Iterator[RouteSpec]:
        """Every route of every deployment, in declaration order."""
        for spec in self.specs:
            yield from spec.routes

    def spec(self, name: str) -> DeploymentSpec:
        """The deployment called ``name``.

        Raises:
            KeyError: if there is none.
        """
        for spec in self.specs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def _check_unique(self) -> None:
        names = [s.name for s in self.specs]
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

    def __repr__(self) -> str:
        return f"App(name={self.name!r}, deployments={[s.name for s in self.specs]})"
