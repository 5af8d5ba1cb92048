"""The application builder a cluster's own Serve config names (``import_path``).

On Kubernetes, KubeRay submits ``spec.serveConfigV2`` to the cluster and Ray Serve builds the
application itself; no ``ember run`` process exists to call :func:`runtime.serve_app`. The
config's ``import_path`` therefore names :func:`build`, and its ``args`` say which Ember app to
load and where the edges listen::

    applications:
    - name: embeddings
      import_path: ember.cluster.build:build
      args: {target: "ember.deployments.embeddings:app", host: 0.0.0.0, port: 8000}

``cluster/k8s.py`` writes that config; this module is what runs on the cluster.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: What a Serve config's ``import_path`` names to build an Ember app on a cluster.
IMPORT_PATH = "ember.cluster.build:build"


class BuildArgs(BaseModel):
    """The ``args`` of the Serve application that :func:`build` reads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field(description="module:app of the Ember app, importable in the image")
    # A pod is reached on its own address by the Service and the kubelet's probes, so the
    # edges listen on every interface of the pod; locally Ember keeps to 127.0.0.1.
    host: str = "0.0.0.0"
    port: int | None = Field(default=None, ge=1, le=65535, description="default: EMBER_PORT")


def build(args: dict[str, Any]) -> Any:
    """The Ray Serve application of the Ember app ``args["target"]``: edges and deployments.

    Ray Serve calls it with the application's ``args`` when it deploys a config; it must take
    exactly one parameter.

    Raises:
        pydantic.ValidationError: ``args`` misses ``target`` or holds an unknown key.
        ConfigError: the target does not name an ``ember.App``.

    Example:
        >>> build({"target": "ember.deployments.embeddings:app"})  # doctest: +SKIP
    """
    from ember.app.targets import load_app
    from ember.cluster import runtime

    parsed = BuildArgs.model_validate(args)
    return runtime.build_application(load_app(parsed.target), host=parsed.host,
                                     port=parsed.port)
