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

The same class caps the connections of one client address: ``limit_concurrency`` is the
edge's in all, so one client could otherwise hold every slot (by keeping connections open
within the head deadline, again and again) and leave none to the rest.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

#: What a connection over its client's cap is told before it is closed.
OVER_CAP = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"connection: close\r\ncontent-length: 37\r\n\r\n"
            b"too many connections from one client\n")


def head_deadline_protocol(deadline_s: float, *,
                           per_client: int = 0) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools' or h11's, as uvicorn picks) with a deadline of
    ``deadline_s`` seconds for each request's head, and at most ``per_client`` connections
    (0: no cap) from one client address; the class counts the connections of one server."""
    clients: Counter[str] = Counter()

    class HeadDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _client: str | None = None
        _over_cap = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            client = str(peer[0]) if isinstance(peer, tuple) and peer else None
            if per_client and client is not None:
                if clients[client] >= per_client:
                    # Answered once its request arrives (as a closed socket with a request
                    # in flight would be a reset the client cannot read), and closed at the
                    # head's deadline if it sends none.
                    self._over_cap = True
                else:
                    clients[client] += 1
                    self._client = client
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._over_cap:
                if not self.transport.is_closing():
                    self.transport.write(OVER_CAP)
                    self.transport.close()
                return
            # A new request's first bytes: nothing under way, or its response sent.
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._client is not None:
                clients[self._client] -= 1
                if clients[self._client] <= 0:
                    del clients[self._client]
                self._client = None
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
