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
    from fastapi import FastAPI

    from ember.platform.app import App


class Gateway(TypingProtocol):
    """What an adapter may do: call a handler, and ask about readiness."""

    async def call(self, deployment: str, attr: str, body: Any, request_id: str) -> Any: ...

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
