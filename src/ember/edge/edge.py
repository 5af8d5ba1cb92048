"""The edge: Ember's HTTP server, one Ray hop in front of the model replicas.

Each edge is a Ray Serve replica that serves Ember's ASGI app (``ingress.build_fastapi``)
with uvicorn on its own listening socket and calls the model replicas through
``DeploymentHandle``s. Serve's own HTTP proxy is not started: a request crosses one Ray hop,
edge -> replica, as it does on plain Ray Serve (proxy -> replica), instead of two (proxy ->
ingress replica -> model replica); ``bench/throughput.py`` compares the two engines.

Edges share one port with ``SO_REUSEPORT``, so the kernel spreads connections over them and
a dead edge only drops the requests in flight on it. Serve keeps the edge count: it health
checks each one (:meth:`EmberEdge.check_health` fails once its server stopped) and replaces
a dead one in a new process. At least two edges run, one per node on larger clusters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from ember import settings
from ember.control.listeners import bind_replica_grpc_to_node_ip
from ember.edge._head_deadline import head_deadline_protocol
from ember.edge._metrics import EdgeBoard
from ember.edge._state import EDGE_DEPLOYMENT
from ember.edge.auth import check_exposure
from ember.edge.ingress import IngressState, build_fastapi

logger = logging.getLogger("ember.edge")

MIN_EDGES = 2
#: How long a stopping edge lets its requests in flight finish before its process is ended.
DRAIN_S = 10.0
#: Serve's health check period for edges: a dead edge is noticed and replaced within it.
HEALTH_CHECK_PERIOD_S = 2.0


def edge_placement(nodes: int) -> tuple[int, int]:
    """Edge count and per-node cap on a cluster of ``nodes``: one per node, at least two.

    Two on one node share its port; on more nodes each node holds exactly one, like Serve's
    per-node proxies.
    """
    count = max(MIN_EDGES, nodes)
    return count, math.ceil(count / max(nodes, 1))


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` that other edges of this node may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # The kernel spreads new connections over every socket bound with SO_REUSEPORT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"the edge cannot listen on {host}:{port}: {exc}") from exc
    return sock


def _edge_id() -> str:
    """This edge's Serve replica id, which names its metrics."""
    from ray import serve

    return str(serve.get_replica_context().replica_id.unique_id)


def server_config(app: Any) -> uvicorn.Config:
    """The edge's uvicorn settings: at most ``EMBER_EDGE_MAX_CONCURRENCY`` connections and
    requests at once (uvicorn answers 503 beyond), so a flood of idle or slow connections
    cannot take the process's memory and file descriptors, and each request's head within
    ``EMBER_BODY_TIMEOUT_S`` (else the connection is closed), so such a flood cannot hold
    those slots either, and at most ``EMBER_EDGE_MAX_CONNECTIONS_PER_CLIENT`` from one client
    address, so one client cannot hold every slot. No protocol upgrade: the edge serves none,
    so an upgrade request is answered 400 and its connection closed (``_head_deadline``)."""
    loaded = settings.load()
    return uvicorn.Config(app, lifespan="on", access_log=False, log_config=None,
                          log_level=logging.WARNING, timeout_keep_alive=75, ws="none",
                          limit_concurrency=loaded.edge_max_concurrency,
                          http=head_deadline_protocol(
                              loaded.body_timeout_s,
                              per_client=loaded.edge_max_connections_per_client))


class _EdgeServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Ray owns the process's signals; uvicorn must not take SIGTERM from it.
        yield


class EmberEdge:
    """Serve deployment class of the edge; Serve passes the model handles as arguments."""

    # Ray actors (and Serve replicas) accept an async constructor; mypy wants None back.
    async def __init__(self, host: str, port: int, state_args: dict[str, Any]) -> None:  # type: ignore[misc]
        bind_replica_grpc_to_node_ip()
        state = IngressState(**state_args)
        check_exposure(host, state.keys)
        edge_id = _edge_id()
        self._board = state.board = EdgeBoard(state.app_name, edge_id)
        # Readiness and drains follow the process that deployed the app (see drain.py).
        self._watch = asyncio.get_running_loop().create_task(
            state.gate.watch(state.app_name, edge_id))
        # Know the replica counts before taking a connection: a request must not be sent
        # to a deployment's own replicas while they are still at zero and the pool is warm.
        await state.poll_once()
        sock = listening_socket(host, port)
        self._server = _EdgeServer(server_config(build_fastapi(state)))
        self._task = asyncio.get_running_loop().create_task(self._server.serve([sock]))
        self._host, self._port = host, port
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        self.check_health()

    def check_health(self) -> None:
        """Serve calls this every few seconds; a failure makes Serve replace the edge."""
        if self._task.done():
            raise RuntimeError(f"the edge's HTTP server on {self._host}:{self._port} stopped")

    async def __del__(self) -> None:
        if not hasattr(self, "_task"):  # refused at start: nothing listens
            return
        # Stop accepting at once (other edges keep the port), let requests in flight finish.
        self._server.should_exit = True
        await asyncio.to_thread(self._board.withdraw)
        try:
            await asyncio.wait_for(asyncio.shield(self._task), DRAIN_S)
        except (TimeoutError, asyncio.CancelledError):
            logger.warning("edge on %s:%d stopped with requests in flight", self._host,
                           self._port)
        self._watch.cancel()


__all__ = ["EDGE_DEPLOYMENT", "EmberEdge", "edge_placement"]
