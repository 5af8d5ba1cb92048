"""Where the edges listen and what the always-on pieces reserve, without Ray.

The command line reads these for commands that only talk HTTP (``ember status``, ``ember
plan``, ``ember rollout``); importing ``cluster/runtime.py`` for them would load Ray Serve
and torch, seconds of CPU before a one-line answer. ``runtime`` re-exports them.
"""

from __future__ import annotations

from ember import settings

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

#: CPUs each edge and each warm-pool replica reserves: small, so they fit beside the models
#: (cluster manifests size their nodes with these too, see ``cluster/k8s.py``).
EDGE_NUM_CPUS = 0.1
POOL_NUM_CPUS = 0.1


def default_port() -> int:
    """``EMBER_PORT`` or 8000."""
    return settings.load().port
