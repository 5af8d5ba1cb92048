"""What Ember's processes listen on: loopback in embedded mode, the node's own IP otherwise.

Every listening socket is a door. A local cluster started by Ember (``ember run``,
``ember.serve`` without ``RAY_ADDRESS``) advertises 127.0.0.1 as its node IP, and Ray then
binds its GCS, raylet, object manager, agents and every worker's core gRPC server to loopback.
One server does not follow the node IP in Ray 2.60: each Serve replica's inter-deployment
gRPC server, which binds ``[::]:0`` (all interfaces) and unpickles request metadata.
:func:`bind_replica_grpc_to_node_ip`, called in each of Ember's replica classes before Serve
starts that server, makes it bind the node's IP instead: loopback on a local cluster, the
address Ray advertises on a multi-node one. ``tests/integration/test_listeners.py`` lists the
sockets of the whole process tree, so a Ray upgrade that moves this fails there.
"""

from __future__ import annotations

import ipaddress
from typing import Any

#: Makes Ray pick the loopback address as the node IP (what it does on macOS and Windows);
#: set in a local cluster's environment only, never when joining a cluster.
LOCAL_CLUSTER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
LOOPBACK = "127.0.0.1"
_WILDCARDS = ("[::]:", "0.0.0.0:")


def host_port(host: str, port: int | str) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"


def narrow(address: str, node_ip: str) -> str:
    """``address`` with a wildcard host replaced by ``node_ip``; other addresses unchanged.

    Example:
        >>> narrow("[::]:0", "127.0.0.1"), narrow("10.0.0.5:9000", "127.0.0.1")
        ('127.0.0.1:0', '10.0.0.5:9000')
    """
    for wildcard in _WILDCARDS:
        if address.startswith(wildcard):
            return host_port(node_ip, address[len(wildcard):])
    return address


def use_loopback_node_ip() -> None:
    """In the driver of a local cluster, before ``ray.init``: advertise loopback as the node IP.

    Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when ``ray`` is imported; the
    processes it starts read it from the environment they inherit. The driver has imported
    Ray already, so its copy of the flag is set here too, unless the operator set the
    variable to something else.
    """
    import os

    from ray._private import ray_constants

    for name, value in LOCAL_CLUSTER_ENV.items():
        if os.environ.get(name) == value:
            ray_constants.ENABLE_RAY_CLUSTER = False


def bind_replica_grpc_to_node_ip() -> None:
    """In a Serve replica process: bind its inter-deployment gRPC server to the node's IP.

    Idempotent; a no-op outside Ray. Must run before Serve calls ``_on_initialized``, i.e.
    in the replica's constructor.
    """
    import ray
    from ray.serve._private import replica as serve_replica

    original: Any = getattr(serve_replica, "add_port_to_grpc_server")  # noqa: B009
    if getattr(original, "__ember_narrowed__", False) or not ray.is_initialized():
        return
    node_ip = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]

    def add_port(server: Any, address: str) -> int:
        return int(original(server, narrow(address, node_ip)))

    add_port.__ember_narrowed__ = True  # type: ignore[attr-defined]
    setattr(serve_replica, "add_port_to_grpc_server", add_port)  # noqa: B010
