"""Protocol adapters: APIs that clients already speak, mapped onto Ember deployments.

A :class:`Protocol` adds routes to the ingress and turns their requests into calls of a
deployment's handler through a :class:`Gateway`, so batching, queues, timeouts and scaling
apply to them exactly as to native routes. One file per protocol.
"""

from __future__ import annotations

from ember.app.app import Gateway, Protocol

__all__ = ["Gateway", "Protocol"]
