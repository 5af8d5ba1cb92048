"""Ember: serverless-style model serving on Ray Serve, built for fast cold starts.

Example:
    >>> import ember
    >>> from pydantic import BaseModel
    >>> class In(BaseModel):
    ...     text: str
    >>> @ember.deployment(route="/echo", warm_floor=0)
    ... class Echo:
    ...     async def __call__(self, body: In) -> dict[str, str]:
    ...         return {"echo": body.text}
    >>> app = ember.App([Echo])
"""

from __future__ import annotations

from typing import Any

from ember import errors
from ember.app.app import App
from ember.app.batching import Batch
from ember.app.config import DeploymentOptions
from ember.app.decorator import deployment, route
from ember.app.pipeline import pipeline

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # serve/shutdown need Ray (seconds to import); declaring deployments, the loaders and
    # the CLI's cache commands do not, so Ray is imported on first use only.
    if name in ("serve", "shutdown"):
        from ember.cluster import runtime

        return runtime.serve_app if name == "serve" else runtime.shutdown
    raise AttributeError(f"module 'ember' has no attribute {name!r}")

__all__ = [
    "App",
    "Batch",
    "DeploymentOptions",
    "__version__",
    "deployment",
    "errors",
    "pipeline",
    "route",
    "serve",
    "shutdown",
]
