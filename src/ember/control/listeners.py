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

from ember import ray_internals

#: Makes Ray pick the loopback address as the node IP (what it does on macOS and Windows);
#: set in a local cluster's environment only, never when joining a cluster.
LOCAL_CLUSTER_ENV = ray_internals.LOOPBACK_ENV
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
    ray_internals.set_driver_loopback_flag()


def verify_loopback(gcs_address: str, node_ip: str) -> None:
    """After a local cluster started: refuse it unless Ray bound it to loopback.

    The last line of defence when a Ray upgrade ignores the loopback switch in a way the
    checks in :mod:`ember.ray_internals` cannot see.

    Raises:
        RayInternalsChanged: the cluster's GCS or node IP is not on loopback.
    """
    hosts = {"gcs": gcs_address.rsplit(":", 1)[0].strip("[]"), "node": node_ip}
    for what, host in hosts.items():
        if not ipaddress.ip_address(host).is_loopback:
            raise ray_internals.RayInternalsChanged(
                [f"loopback_node_ip: the local cluster's {what} is on {host}, not loopback"])


def bind_replica_grpc_to_node_ip() -> None:
    """In a Serve replica process: bind its inter-deployment gRPC server to the node's IP.

    Idempotent; a no-op outside Ray. Must run before Serve calls ``_on_initialized``, i.e.
    in the replica's constructor.

    Raises:
        RayInternalsChanged: Serve binds its server some other way now; the replica must
            not start (its server would listen on every interface).
    """
    import ray

    if not ray.is_initialized():
        return
    node_ip = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]

    def narrowing(original: Any) -> Any:
        def add_port(server: Any, address: str) -> int:
            return int(original(server, narrow(address, node_ip)))
        return add_port

    ray_internals.wrap_replica_grpc_bind(narrowing)


def cluster_access(gcs_address: str, *, token_auth: bool,
                   dashboard: str | None = None) -> dict[str, str | None]:
    """How a second shell on this machine reaches the cluster at ``gcs_address``.

    Ray's CLI and ``ray.init`` turn a loopback address into the machine's own address unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, and a cluster started by ``ray.init`` has token
    authentication on: its token is in ``~/.ray/auth_token``, used only with
    ``RAY_AUTH_MODE=token``. ``address="auto"`` cannot find a loopback cluster by itself.

    Example:
        >>> cluster_access("10.0.0.5:6379", token_auth=True)["ray_status"]
        'RAY_ADDRESS=10.0.0.5:6379 RAY_AUTH_MODE=token ray status'
    """
    host = gcs_address.rsplit(":", 1)[0].strip("[]")
    env = [f"RAY_ADDRESS={gcs_address}"]
    try:
        if ipaddress.ip_address(host).is_loopback:
            env += [f"{k}={v}" for k, v in LOCAL_CLUSTER_ENV.items()]
    except ValueError:  # a host name: Ray resolves it as it is
        pass
    if token_auth:
        env.append("RAY_AUTH_MODE=token")
    dashboard = f"http://{dashboard}" if dashboard else None
    prefix = " ".join(env)
    return {
        "gcs_address": gcs_address,
        "env": prefix,
        "ray_status": f"{prefix} ray status",
        "dashboard": dashboard,
        "serve_status": f"{prefix} RAY_DASHBOARD_ADDRESS={dashboard} serve status"
        if dashboard else None,
    }
