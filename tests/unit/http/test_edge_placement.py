"""How many edges run, and where: at least two, one per node on larger clusters."""

from __future__ import annotations

import socket

import pytest

from ember.edge.edge import edge_placement, listening_socket


@pytest.mark.parametrize(("nodes", "expected"), [(1, (2, 2)), (2, (2, 1)), (5, (5, 1))])
def test_edges_are_one_per_node_and_never_fewer_than_two(
        nodes: int, expected: tuple[int, int]) -> None:
    assert edge_placement(nodes) == expected


def test_two_edges_of_one_node_share_its_port() -> None:
    first = listening_socket("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        second = listening_socket("127.0.0.1", port)
        second.close()
        # A socket without SO_REUSEPORT (some other server) is refused the port.
        plain = socket.socket()
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        plain.close()
    finally:
        first.close()


def test_a_port_taken_by_another_server_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
            listening_socket("127.0.0.1", port)
