"""Every protocol upgrade is refused with a 400 before the app sees the request.

Real HTTP: a counting ASGI app on uvicorn, with the edge's protocol class built on each of
uvicorn's HTTP implementations (httptools', the edge's, and h11's), on 127.0.0.1; raw
sockets send what a client library would not (an upgrade with a request hidden after it).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ember.edge._head_deadline import head_deadline_protocol

from support import free_port, wait_for

SEEN: list[str] = []


async def counting_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    SEEN.append(f"{scope['method']} {scope['path']}")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module", params=[HttpToolsProtocol, H11Protocol],
                ids=["httptools", "h11"])
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    number = free_port()
    config = uvicorn.Config(counting_app, host="127.0.0.1", port=number, lifespan="off",
                            ws="none", log_level="warning",
                            http=head_deadline_protocol(5, base=request.param))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 20, interval_s=0.05, what="uvicorn")
    yield number
    server.should_exit = True
    thread.join(timeout=10)


def _until_closed(sock: socket.socket) -> bytes:
    answer = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            answer += chunk
    return answer


def _send(port: int, data: bytes) -> bytes:
    """Everything the server answers to ``data``, read until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(data)
        return _until_closed(sock)


def test_a_plain_request_reaches_the_app(port: int) -> None:
    SEEN.clear()
    plain = b"GET /plain HTTP/1.1\r\nHost: edge\r\nConnection: close\r\n\r\n"
    assert _send(port, plain).startswith(b"HTTP/1.1 200")
    assert SEEN == ["GET /plain"]


def test_a_websocket_upgrade_is_refused_and_closed(port: int) -> None:
    SEEN.clear()
    head = (b"GET /ws HTTP/1.1\r\nHost: edge\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    answer = _send(port, head)
    assert answer.startswith(b"HTTP/1.1 400") and b"upgrades are not served" in answer, answer
    assert SEEN == [], "the app saw an upgrade request"


def test_an_h2c_upgrade_with_a_body_smuggles_no_request(port: int) -> None:
    SEEN.clear()
    head = (b"POST /first HTTP/1.1\r\nHost: edge\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\nContent-Length: 5\r\n\r\n")
    hidden = b"hello" + b"GET /smuggled HTTP/1.1\r\nHost: edge\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(head)
        time.sleep(0.3)  # the body and what follows it come in a segment of their own
        with contextlib.suppress(OSError):  # already closed: the refusal came first
            sock.sendall(hidden)
        answer = _until_closed(sock)
    time.sleep(0.3)  # a smuggled request would have reached the app by now
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert answer.count(b"HTTP/1.1 ") == 1, answer
    assert SEEN == [], f"the app saw {SEEN}"


def test_an_upgrade_in_a_second_connection_header_is_refused(port: int) -> None:
    SEEN.clear()
    head = (b"POST /second HTTP/1.1\r\nHost: edge\r\nConnection: Upgrade\r\n"
            b"Connection: keep-alive\r\nUpgrade: h2c\r\nContent-Length: 0\r\n\r\n")
    answer = _send(port, head)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert SEEN == [], f"the app saw {SEEN}"


def test_an_upgrade_pipelined_behind_a_request_is_refused_after_its_answer(port: int) -> None:
    SEEN.clear()
    both = (b"GET /first HTTP/1.1\r\nHost: edge\r\n\r\n"
            b"GET /ws HTTP/1.1\r\nHost: edge\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    answer = _send(port, both)
    first, _, rest = answer.partition(b"ok")
    assert first.startswith(b"HTTP/1.1 200"), answer
    assert rest.startswith(b"HTTP/1.1 400") and b"upgrades are not served" in rest, answer
    assert SEEN == ["GET /first"], SEEN


def test_a_uvicorn_without_the_hooks_fails_closed() -> None:
    class Bare(asyncio.Protocol):
        pass

    with pytest.raises(RuntimeError, match="_should_upgrade"):
        head_deadline_protocol(5, base=Bare)


def test_a_connect_is_refused_and_no_tunnel_opens(port: int) -> None:
    SEEN.clear()
    answer = _send(port, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"
                         b"GET /tunnelled HTTP/1.1\r\nHost: edge\r\n\r\n")
    time.sleep(0.3)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert SEEN == [], f"the app saw {SEEN}"
