"""Replica states per deployment, as the edges poll them from Serve's controller.

Split from ``ingress.py``, whose poll calls it from a worker thread.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any


def read_replica_states(app_name: str) -> dict[str, Any]:
    """Replica states per deployment of ``app_name``, read from the controller's details.

    ``serve.status()`` builds Serve's full pydantic schema from the same details, which
    re-serializes every deployment's router class: measured at a third of the ingress's CPU
    under load when polled twice a second. The plain dict has all Ember needs.
    """
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    if client is None:
        return {}
    app = (client.get_serve_details().get("applications") or {}).get(app_name) or {}
    overviews: dict[str, Any] = {}
    for name, details in (app.get("deployments") or {}).items():
        states = Counter(_enum_text(r.get("state")) for r in details.get("replicas") or [])
        overviews[name] = SimpleNamespace(replica_states=dict(states),
                                          status=_enum_text(details.get("status", "UNKNOWN")),
                                          message=str(details.get("message") or ""))
    return overviews


def _enum_text(value: Any) -> str:
    # The details hold Serve's str-valued enums; str() of those is "ReplicaState.RUNNING".
    return str(getattr(value, "value", value))
