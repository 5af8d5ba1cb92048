"""No door left open: nothing the embedded cluster starts listens beyond loopback."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import httpx
import psutil
import pytest

from apps import core
from serving import ServeApp
from support import wait_for

pytestmark = pytest.mark.cluster


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1, as gRPC reports a dual-stack bind
    return address.is_loopback


def _listeners() -> tuple[list[str], int]:
    """Every listening TCP/UDP socket of this process's tree, and how many processes it has."""
    me = psutil.Process()
    tree = [me, *me.children(recursive=True)]
    found = []
    for proc in tree:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN or (conn.type == 2 and not conn.raddr):
                    found.append(f"{proc.pid} {proc.name()} {conn.laddr.ip}:{conn.laddr.port}")
        except psutil.NoSuchProcess:
            continue
    return found, len(tree)


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    """One serving of the core app for both tests: each only looks at it."""
    with serve_app(core.app) as base:
        yield base


def test_every_socket_of_the_cluster_listens_on_loopback(url: str) -> None:
    # The session's cluster with an app served: GCS, raylet, agents, Serve's controller, the
    # edges and model replicas (each with Serve's inter-deployment gRPC server, which binds
    # all interfaces unless Ember narrows it). Serve's HTTP proxy is not started.
    assert httpx.post(f"{url}/echo", json={"text": "hi"}, timeout=30).status_code == 200
    found, processes = _listeners()
    assert processes >= 8, f"expected Ray's processes under the test process, saw {processes}"
    assert any(" ray::ServeReplica" in f for f in found), found  # replicas were inspected
    open_doors = [f for f in found if not _is_loopback(f.rsplit(":", 1)[0].split(" ")[-1])]
    assert open_doors == []
    assert not any("ProxyActor" in f for f in found), found


def test_two_edge_processes_share_the_apps_port(url: str) -> None:
    # No single point of failure: the port is held by two processes, each a whole edge.
    port = int(url.rsplit(":", 1)[1])
    found, _ = _listeners()
    holders = {f.split(" ")[0] for f in found if f.endswith(f":{port}")}
    assert len(holders) == 2, found
    answered = set()
    for _ in range(32):  # new connections spread over the edges
        answered.add(httpx.get(f"{url}/-/status", timeout=10).json()["edges"]["pid"])
    assert {str(pid) for pid in answered} == holders
    # Each edge reads Serve's replica states on its own period; the one answering may have
    # last read them while its sibling was still starting.
    wait_for(lambda: httpx.get(f"{url}/-/status", timeout=10).json()["edges"]["running"]
             == 2 or None, timeout_s=30, what="both edges counted as running")
