"""Which warm-runtime imports a worker makes, told through its environment.

Ray's ``preload_python_modules`` is one list for every worker the raylet starts. The warm
runtime wants torch, Serve's replica code and the app's modules in the workers that become
replicas; Ember's edges and its rollout driver use none of them, and paid for them anyway:
seconds of a core each at start, and torch's memory for as long as they run.

So the raylet preloads one gate module (``control/warm_imports.py``), and the gate imports
the list ``WARM_IMPORTS_ENV`` names (set where the cluster starts, inherited by every
worker), unless the worker runs with ``LIGHT_WORKER_ENV`` set: the processes above get it
from their runtime environment (:func:`light_runtime_env`). An actor with a runtime
environment of its own never takes a pre-started idle worker, so the light ones start
fresh, and the idle workers stay for replicas.

Serve's controller would be light too, but Ray gives the actors an actor creates its own
runtime environment: the replicas would inherit the flag, import torch themselves and never
take an idle worker (the warm runtime would be gone). The edges create only the rollout
driver, which is light anyway.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# Both variables are a private channel from the process that starts the cluster to its
# workers, not settings an operator sets (``settings.py`` owns every ``EMBER_*``): hence the
# leading underscore.

#: The modules a worker imports, comma-separated (as in Ray's own preload list).
WARM_IMPORTS_ENV = "_EMBER_WARM_IMPORTS"
#: Set to 1 in a worker that must import none of them.
LIGHT_WORKER_ENV = "_EMBER_LIGHT_WORKER"


def modules_to_import(environ: Mapping[str, str]) -> list[str]:
    """What a worker with ``environ`` imports.

    Example:
        >>> modules_to_import({"_EMBER_WARM_IMPORTS": "torch,apps.core"})
        ['torch', 'apps.core']
        >>> modules_to_import({"_EMBER_WARM_IMPORTS": "torch", "_EMBER_LIGHT_WORKER": "1"})
        []
    """
    if environ.get(LIGHT_WORKER_ENV) == "1":
        return []
    return [name for name in environ.get(WARM_IMPORTS_ENV, "").split(",") if name]


def light_runtime_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The runtime environment of an actor that needs none of the warm runtime's imports.

    ``None`` where this process's cluster preloads nothing through the gate (a cluster Ember
    joined, or one started with the warm runtime off): there a runtime environment of the
    actor's own would only keep it from idle workers.

    Example:
        >>> light_runtime_env({"_EMBER_WARM_IMPORTS": "torch"})
        {'env_vars': {'_EMBER_LIGHT_WORKER': '1'}}
        >>> light_runtime_env({}) is None
        True
    """
    if not environ.get(WARM_IMPORTS_ENV):
        return None
    return {"env_vars": {LIGHT_WORKER_ENV: "1"}}
