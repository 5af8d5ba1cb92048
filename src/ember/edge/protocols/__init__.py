"""Protocol adapters: APIs that clients already speak, mapped onto Ember deployments.

A :class:`Protocol` adds routes to the ingress and turns their requests into calls of a
deployment's handler through a :class:`Gateway`, so batching, queues, timeouts and scaling
apply to them exactly as to native routes. One file per protocol.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any
from typing import Protocol as TypingProtocol

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry

    from ember.app.app import App


class Gateway(TypingProtocol):
    """What an adapter may do: call a handler, stream from one, ask about readiness, and
    register its own metric families in the edge's registry (served at ``/metrics``)."""

    async def call(self, deployment: str, attr: str, body: Any, request_id: str) -> Any: ...

    def stream(self, deployment: str, attr: str, body: Any,
               request_id: str) -> AsyncIterator[Any]: ...

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
