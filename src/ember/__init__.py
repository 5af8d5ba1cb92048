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

from ember import errors
from ember.platform.app import App
from ember.platform.batching import Batch
from ember.platform.config import DeploymentOptions
from ember.platform.decorator import deployment, route
from ember.platform.pipeline import pipeline
from ember.platform.runtime import serve_app as serve
from ember.platform.runtime import shutdown

__version__ = "0.1.0"

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
