"""Every body is capped by its route and read against a deadline; the edge caps connections.

Real HTTP: the edge's app on uvicorn with the edge's own settings (``edge.server_config``)
and listening socket, on 127.0.0.1; only Ray's handles are faked, as in the other edge
tests. Raw sockets send what an HTTP client library would refuse to (a body that trickles).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import uvicorn
from serve_fakes import FakeHandle, as_handle, replica_of

import ember
from ember.edge.auth import ApiKeys
from ember.edge.edge import listening_socket, server_config
from ember.edge.ingress import SMALL_BODY_LIMIT, IngressState, build_fastapi
from ember.protocols import OpenInferenceProtocol, TensorModel, TensorSpec

from support import free_port

ADMIN = "admin-0123456789abcdef"
BIG = 1 << 20  # the Echo route's limit: larger than any admin or unknown path's


@ember.deployment(name="Echo", max_request_bytes=BIG)
class Echo:
    def __call__(self, body: dict[str, str]) -> dict[str, int]:
        return {"size": len(body.get("x", ""))}


ITEM_LIMIT, TENSOR_LIMIT = 2000, 4000  # far under Echo's: each route keeps its own


@ember.deployment(name="Item", route="/items/{item}", max_request_bytes=ITEM_LIMIT)
class Item:
    def __call__(self, body: dict[str, str]) -> dict[str, int]:
        return {"size": len(body.get("x", ""))}


@ember.deployment(name="Doubler", max_request_bytes=TENSOR_LIMIT)
class Doubler:
    @ember.route()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


APP = ember.App([Echo, Item, Doubler], name="guard", warm_pool=0, protocols=[
    OpenInferenceProtocol([TensorModel(
        name="double", deployment="Doubler", attr="forward",
        input=TensorSpec("x", "FP32", (-1, 4)), output=TensorSpec("y", "FP32", (-1, 4)))])])


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EMBER_BODY_TIMEOUT_S", "1")
        env.setenv("EMBER_EDGE_MAX_CONCURRENCY", "4")
        handles = {cls.__name__: as_handle(FakeHandle(replica_of(cls)))
                   for cls in (Echo, Item, Doubler)}
        state = IngressState(APP.name, list(APP.routes()), {s.name: s.options for s in APP.specs},
                             handles, APP.timeouts(), APP.protocols, keys=ApiKeys([], [ADMIN]))
        config = server_config(build_fastapi(state))
    for name in handles:
        state.tracker.loads[name].running = 1
    config.lifespan = "off"  # no replica poller: the fake handle is always running
    port = free_port()
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run,
                              kwargs={"sockets": [listening_socket("127.0.0.1", port)]},
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def test_a_route_takes_bodies_up_to_its_own_limit(url: str) -> None:
    reply = httpx.post(f"{url}/echo", json={"x": "a" * (BIG // 2)}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"size": BIG // 2}


@pytest.mark.parametrize(("method", "path"), [
    ("DELETE", "/-/warm/Echo"),   # DELETE bodies were read whole, uncapped
    ("PUT", "/-/rollout/Echo"),   # admin paths took the largest deployment's limit
    ("POST", "/nowhere"),         # so did paths no route serves
    ("GET", "/echo"),             # and read-only methods
])
def test_admin_unknown_and_bodiless_requests_get_the_small_cap(url: str, method: str,
                                                               path: str) -> None:
    body = b"{" + b" " * (SMALL_BODY_LIMIT * 2) + b"}"
    reply = httpx.request(method, f"{url}{path}", content=body, headers=_admin(), timeout=30)
    assert reply.status_code == 413, reply.text
    assert f"exceeds {SMALL_BODY_LIMIT} bytes" in reply.json()["error"]["message"]


@pytest.mark.parametrize(("path", "limit"), [
    ("/items/7", ITEM_LIMIT),                 # a templated route took the largest limit
    ("/v2/models/double/infer", TENSOR_LIMIT),  # so did a protocol's, for any model
])
def test_templated_and_protocol_routes_get_their_own_deployments_cap(
        url: str, path: str, limit: int) -> None:
    small = httpx.post(f"{url}{path}", json={"x": "a" * 10}, timeout=30)
    assert small.status_code != 413, small.text
    body = b"{" + b" " * (limit * 4) + b"}"  # far under Echo's 1 MiB
    reply = httpx.post(f"{url}{path}", content=body, timeout=30,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == 413, reply.text
    assert f"exceeds {limit} bytes" in reply.text


def _raw(url: str, head: bytes, timeout_s: float) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.sendall(head)
    return sock


def test_a_body_that_trickles_gets_408_at_the_deadline(url: str) -> None:
    head = (b"POST /echo HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"x\": \"")
    started = time.monotonic()
    with _raw(url, head, timeout_s=20) as sock:
        answer = sock.recv(4096)  # nothing more is sent: the edge must not wait for ever
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"BodyTimeout" in answer
    assert time.monotonic() - started < 15  # the 1 s deadline, with a wide margin


def test_the_edge_answers_503_beyond_its_concurrency_limit(url: str) -> None:
    idle = [_raw(url, b"", timeout_s=10) for _ in range(4)]
    try:
        time.sleep(0.5)  # let uvicorn accept them
        reply = httpx.get(f"{url}/healthz", timeout=10)
        assert reply.status_code == 503, reply.text
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/healthz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the edge did not recover after the idle sockets"
        time.sleep(0.1)


def test_a_connection_whose_head_never_completes_is_closed_at_the_deadline(url: str) -> None:
    """uvicorn arms no timer before a connection's first response: one that sends nothing,
    or trickles its head, held its slot for ever."""
    started = time.monotonic()
    with _raw(url, b"", timeout_s=20) as silent, \
            _raw(url, b"GET /healthz HTTP/1.1\r\nHost: ed", timeout_s=20) as trickle:
        time.sleep(0.4)
        trickle.sendall(b"g")  # a byte now and then does not move the deadline
        for sock in (silent, trickle):
            assert sock.recv(4096) == b"", "the edge answered a head it never received"
    assert time.monotonic() - started < 15  # the 1 s deadline, with a wide margin


def test_idle_connections_at_the_concurrency_limit_free_their_slots_by_themselves(
        url: str) -> None:
    idle = [_raw(url, b"", timeout_s=20) for _ in range(4)]
    try:
        deadline = time.monotonic() + 15
        while httpx.get(f"{url}/healthz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "idle connections held every slot"
            time.sleep(0.2)
        # Kept alive after a response, a connection's next head has the deadline too.
        with httpx.Client(timeout=10) as client:
            assert client.get(f"{url}/healthz").status_code == 200
            assert client.get(f"{url}/healthz").status_code == 200
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.parametrize("path", ["/-/status", "/echo", "/nowhere"])
def test_a_websocket_upgrade_is_refused_before_any_route(url: str, path: str) -> None:
    # The edge serves no WebSocket route: with the edge's own server settings, an upgrade is
    # answered 400 and closed, on every path, never switched and never run through the app.
    head = (f"GET {path} HTTP/1.1\r\nHost: edge\r\nConnection: Upgrade\r\n"
            "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n").encode()
    answer = b""
    with _raw(url, head, timeout_s=20) as sock:
        while chunk := sock.recv(4096):  # until the edge closes
            answer += chunk
    assert answer.split(b"\r\n", 1)[0] == b"HTTP/1.1 400 Bad Request", answer
    assert b"upgrades are not served" in answer, answer
