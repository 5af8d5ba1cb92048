"""A request's head must arrive within the body's deadline, from the connection's first
moment or from its first byte.

uvicorn arms its keep-alive timer only after a response, so a connection that never sends
a byte, or trickles its request line and headers a byte at a time, held its slot for ever;
``limit_concurrency`` counts such connections, so a few thousand of them (no key needed:
auth runs once the head is in) made the edge answer 503 to everyone. The body already has
``EMBER_BODY_TIMEOUT_S`` (``GuardMiddleware``); this gives the head the same.

uvicorn's HTTP protocol classes keep the request under way as ``cycle`` (made when a head is
complete): a head is late when, a deadline after the connection opened or after the first
byte of a new request, ``cycle`` is still the one it was. The edges' live test
(``tests/unit/http/test_body_guard_live.py``) fails if uvicorn stops keeping it so.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol


def head_deadline_protocol(deadline_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools' or h11's, as uvicorn picks) with a deadline of
    ``deadline_s`` seconds for each request's head."""

    class HeadDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            # A new request's first bytes: nothing under way, or its response sent.
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(deadline_s, self._late, self.cycle)

        def _late(self, cycle_then: Any) -> None:
            self._head_timer = None
            if self.cycle is cycle_then and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadlineProtocol
