"""What every edge last reported: its metrics exposition and status, in Ray's key-value store.

Each edge publishes once a second while its figures change, and an unchanged report every
ten seconds (``edge/_metrics.EdgeBoard`` builds on this to merge
scrapes); the control plane reads the same records to judge versions during a rollout
(``rollout_driver``). The records live here, in the control room, so that the control
plane reads them without importing the edge. An edge silent for ``STALE_S`` is dropped.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ember import ray_internals


class EdgeReports:
    """The edges' published reports of one app; ``edge`` names the one this process writes."""

    NAMESPACE = "ember"
    STALE_S = 30.0

    def __init__(self, app: str, edge: str) -> None:
        self.app, self.edge = app, edge

    def _key(self, edge: str) -> str:
        return f"metrics:{self.app}:{edge}"

    def publish(self, text: bytes, status: dict[str, Any]) -> None:
        value = json.dumps({"at": time.time(), "text": text.decode(), "status": status}).encode()
        ray_internals.kv_put(self._key(self.edge), value, namespace=self.NAMESPACE)

    def withdraw(self) -> None:
        ray_internals.kv_delete(self._key(self.edge), namespace=self.NAMESPACE)

    def published(self) -> dict[str, dict[str, Any]]:
        """Every edge's fresh publication (``at``, ``text``, ``status``), by edge id."""
        prefix = self._key("")
        found = {}
        for key in ray_internals.kv_list(prefix, namespace=self.NAMESPACE):
            edge = key.decode()[len(prefix):]
            raw = ray_internals.kv_get(key, namespace=self.NAMESPACE)
            try:
                value = json.loads(raw or b"")
                fresh = time.time() - float(value["at"]) < self.STALE_S
            except (ValueError, KeyError, TypeError):  # damaged: skip it rather than fail
                continue
            if fresh:
                found[edge] = value
        return found
