"""Why a deployment's replica is not starting: no node has room for it.

A replica Ray cannot place waits silently: Serve keeps it STARTING and, after 30 s, logs a
warning nobody calling over HTTP sees. A request waiting for it would time out without a
reason. The edge asks instead, while a deployment has no running replica and one is
starting, whether the cluster holds an unplaced request of the replica's shape (Ray's own
resource demand, the same one its autoscaler reads) that no live node can fit right now. If
so, the caller gets 503 with the reason at once, and ``ember status`` shows it.

Both checks are needed: a placed replica's resources are already taken from its node, so
"no node fits" alone is also true of a replica that is merely starting on a full node.

Example:
    >>> unplaceable({"CPU": 1.0}, pending=[{"CPU": 1.0}], free=[{"CPU": 0.8}])
    'waiting for resources: needs CPU 1.0, 0.8 free'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Resources = Mapping[str, float]

#: Ray's own accounting is in units of 1/10000; smaller differences are rounding.
_EPSILON = 1e-4


def replica_shape(num_cpus: float, num_gpus: float) -> dict[str, float]:
    """The resource request of one replica, as Ray reports it (zero amounts left out)."""
    return {name: amount for name, amount in (("CPU", num_cpus), ("GPU", num_gpus)) if amount}


def _amount(value: float) -> str:
    text = f"{value:.2f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _fits(need: Resources, free: Resources) -> bool:
    return all(free.get(name, 0.0) + _EPSILON >= amount for name, amount in need.items())


def _same_shape(a: Resources, b: Resources) -> bool:
    names = {n for n, v in a.items() if v} | {n for n, v in b.items() if v}
    return all(abs(a.get(n, 0.0) - b.get(n, 0.0)) < _EPSILON for n in names)


def unplaceable(need: Resources, *, pending: Sequence[Resources],
                free: Sequence[Resources]) -> str | None:
    """The reason a replica asking for ``need`` waits, or None if nothing says it must.

    Args:
        need: One replica's resources (:func:`replica_shape`).
        pending: Resource requests Ray holds unplaced, one entry per request.
        free: Free resources of every live node.
    """
    if not need or any(_fits(need, node) for node in free):
        return None
    if not any(_same_shape(need, request) for request in pending):
        return None
    short = [name for name in need if not any(_fits({name: need[name]}, n) for n in free)]
    parts = [f"{name} {_amount(need[name])}, "
             f"{_amount(max((n.get(name, 0.0) for n in free), default=0.0))} free"
             for name in short or list(need)]
    return "waiting for resources: needs " + "; ".join(parts)


def cluster_view() -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Unplaced resource requests and each live node's free resources, read from the GCS.

    Both come from the state Ray's autoscaler reads; one call costs a few milliseconds.
    """
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status

    status = get_cluster_status(ray.get_runtime_context().gcs_address)
    pending: list[dict[str, float]] = []
    for demand in status.resource_demands.ray_task_actor_demand:
        for request in demand.bundles_by_count:
            pending.extend(dict(request.bundle) for _ in range(max(1, request.count)))
    free = [{u.resource_name: u.total - u.used for u in node.resource_usage.usage}
            for node in [*status.active_nodes, *status.idle_nodes]
            if node.resource_usage is not None]
    return pending, free
