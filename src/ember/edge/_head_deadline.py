"""The edge's HTTP protocol: a deadline for each request's head, a cap on one client's
connections, and no protocol upgrade.

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
edge's in all, so one client could otherwise hold every slot. A connection over the cap is
taken out of uvicorn's count at once and closed within ``OVER_CAP_WAIT_S``.

And it refuses every upgrade (WebSocket, h2c, CONNECT's tunnel) with a 400 before the app
sees the request, then closes: the edge serves no such protocol, and uvicorn without one
runs the request through the app while httptools stops parsing at the upgrade, so the
bytes after it (a body, or a second request hidden in one) were read as a new request.
uvicorn asks ``_should_upgrade`` at every head in both of its HTTP implementations and keeps
a request it answers yes to from the app; ``head_deadline_protocol`` fails closed if a
uvicorn lacks the methods this rests on.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

#: How long a connection over its client's cap waits for its request before it is closed.
OVER_CAP_WAIT_S = 1.0


def _answer(status: bytes, text: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"connection: close\r\ncontent-length: " + str(len(text)).encode() + b"\r\n\r\n"
            + text)


#: What a connection over its client's cap is told before it is closed.
OVER_CAP = _answer(b"503 Service Unavailable", b"too many connections from one client\n")
#: What an upgrade request is told before its connection is closed.
UPGRADE_REFUSED = _answer(b"400 Bad Request", b"protocol upgrades are not served here\n")

#: uvicorn's own methods this overrides (asyncio.Protocol's are always there).
_UVICORN_HOOKS = ("_should_upgrade", "handle_websocket_upgrade", "on_response_complete")


def _asks_upgrade(headers: list[tuple[bytes, bytes]] | None) -> bool:
    """Whether the head asks for an upgrade as llhttp reads one: an Upgrade header, and the
    ``upgrade`` token in any Connection header (RFC 9110 7.8: an Upgrade header without it is
    no upgrade, and is served as the plain request it is)."""
    pairs = list(headers or ())
    return any(name == b"upgrade" for name, _ in pairs) and any(
        name == b"connection" and b"upgrade" in (t.strip().lower() for t in value.split(b","))
        for name, value in pairs)


def head_deadline_protocol(deadline_s: float, *, per_client: int = 0,
                           base: type[asyncio.Protocol] = AutoHTTPProtocol,
                           ) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol ``base`` (httptools' or h11's, as uvicorn picks) with a
    deadline of ``deadline_s`` seconds for each request's head, at most ``per_client``
    connections (0: no cap) from one client address (counted per class: one server's), and
    every upgrade refused."""
    missing = [name for name in _UVICORN_HOOKS if not callable(getattr(base, name, None))]
    if missing:
        raise RuntimeError(f"uvicorn {uvicorn.__version__}'s {base.__name__} has no "
                           f"{', '.join(missing)}: the edge's HTTP guards rest on them")
    clients: Counter[str] = Counter()

    class HeadDeadlineProtocol(base):  # type: ignore[misc,valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _client: str | None = None
        _over_cap = False
        _refuse_when_done = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            client = str(peer[0]) if isinstance(peer, tuple) and peer else None
            if per_client and client is not None and clients[client] >= per_client:
                # Out of uvicorn's count (else one client's surplus still fills every slot),
                # answered once its request arrives (closed with a request in flight, the
                # socket would be reset before the client reads why), closed soon if none.
                self.connections.discard(self)
                self._over_cap = True
                self._head_timer = self.loop.call_later(OVER_CAP_WAIT_S, self.transport.close)
                return
            if per_client and client is not None:
                clients[client] += 1
                self._client = client
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._over_cap:
                self._finish(OVER_CAP)
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

        def _should_upgrade(self) -> bool:
            # httptools asks only when its parser saw an upgrade (CONNECT included); h11
            # asks at every head, takes a CONNECT for a plain request and reads only the
            # last Connection header. Yes keeps the request from the app.
            parser = getattr(self, "parser", None)
            seen = parser is not None and bool(parser.should_upgrade())
            if not (seen or self.scope.get("method") == "CONNECT" or _asks_upgrade(self.headers)):
                return False
            self._refuse()
            return True

        def handle_websocket_upgrade(self, *args: Any) -> None:
            self._refuse()

        def _refuse(self) -> None:
            # Pipelined behind requests still being answered (httptools parses a whole
            # segment at once): refused once their answers are out, reading paused till then.
            if self._busy():
                self._refuse_when_done = True
                self.flow.pause_reading()
            else:
                self._finish(UPGRADE_REFUSED)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._refuse_when_done and not self._busy():
                self._finish(UPGRADE_REFUSED)

        def _busy(self) -> bool:
            under_way = self.cycle is not None and not self.cycle.response_complete
            return under_way or bool(getattr(self, "pipeline", None))

        def _finish(self, answer: bytes) -> None:
            # A closed transport reads nothing more: what follows is never parsed.
            if not self.transport.is_closing():
                self.transport.write(answer)
                self.transport.close()

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(deadline_s, self._late, self.cycle)

        def _late(self, cycle_then: Any) -> None:
            self._head_timer = None
            if self.cycle is cycle_then and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadlineProtocol
