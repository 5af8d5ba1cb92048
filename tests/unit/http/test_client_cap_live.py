"""One client address holds at most ``EMBER_EDGE_MAX_CONNECTIONS_PER_CLIENT`` connections.

Real HTTP: a small ASGI app on uvicorn with the edge's own settings (``edge.server_config``)
on 127.0.0.1. Clients are told apart by their source address: Linux's loopback answers for
all of 127.0.0.0/8, so each "client" binds its own.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from ember.edge.edge import listening_socket, server_config

from support import free_port, wait_for

CAP = 2
SLOTS = 5  # limit_concurrency: the edge's connections in all
REQUEST = b"GET / HTTP/1.1\r\nHost: edge\r\nConnection: close\r\n\r\n"


async def ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EMBER_EDGE_MAX_CONNECTIONS_PER_CLIENT", str(CAP))
        env.setenv("EMBER_EDGE_MAX_CONCURRENCY", str(SLOTS))
        config = server_config(ok_app)
    config.lifespan = "off"
    number = free_port()
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True,
                              kwargs={"sockets": [listening_socket("127.0.0.1", number)]})
    thread.start()
    wait_for(lambda: server.started, 20, interval_s=0.05, what="uvicorn")
    yield number
    server.should_exit = True
    thread.join(timeout=10)


def _connect(port: int, source: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20, source_address=(source, 0))
    return sock


def _status(sock: socket.socket) -> bytes:
    sock.sendall(REQUEST)
    answer = b""
    while chunk := sock.recv(4096):
        answer += chunk
    return answer.split(b"\r\n", 1)[0] + b" " + answer.rsplit(b"\r\n\r\n", 1)[-1]


def test_a_client_over_its_cap_gets_503_while_others_are_served(port: int) -> None:
    held = [_connect(port, "127.0.0.2") for _ in range(CAP)]  # idle, within their deadline
    try:
        time.sleep(0.2)  # the server has taken both
        with _connect(port, "127.0.0.2") as third:
            answer = _status(third)
        assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer, answer
        with _connect(port, "127.0.0.3") as other:  # another client is not held back
            assert _status(other).startswith(b"HTTP/1.1 200"), "another client was refused"
    finally:
        closing = held.pop()
        closing.close()
    # A closed connection gives its slot back.
    def served() -> bool:
        with _connect(port, "127.0.0.2") as again:
            return _status(again).startswith(b"HTTP/1.1 200")

    try:
        wait_for(served, 20, what="the freed slot")
    finally:
        for sock in held:
            sock.close()


def test_a_clients_surplus_takes_no_slot_and_is_closed(port: int) -> None:
    # More connections than the edge has slots, all from one client: those over its cap
    # must leave uvicorn's count (else the next client gets "Exceeded concurrency limit").
    held = [_connect(port, "127.0.0.2") for _ in range(CAP + SLOTS)]
    try:
        time.sleep(0.2)
        with _connect(port, "127.0.0.3") as other:
            assert _status(other).startswith(b"HTTP/1.1 200"), "a surplus took the slots"
        # A surplus connection that sends nothing is closed soon, not at the head deadline.
        surplus = held[-1]
        surplus.settimeout(10)
        started = time.monotonic()
        assert surplus.recv(4096) == b""
        assert time.monotonic() - started < 8, "a surplus connection was held"
    finally:
        for sock in held:
            sock.close()
