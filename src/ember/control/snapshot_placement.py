"""Cache-aware placement: a new replica prefers a node that holds its deployment's snapshot.

A node holds a snapshot when its node cache has the record ``snapshots/<key>.json`` (written
by the first replica there, or by ``ember cache warm URL --snapshot VERSION --all-nodes``);
that record is the mark. Ray 2.60 fixes a node's labels when the node starts and no longer
has dynamic custom resources, so Ember does not label nodes: when it builds the app it asks
every alive node which records it holds (one pinned task per node, no CPU) and gives the
deployment's replicas a label selector on Ray's own ``ray.io/node-id`` label naming the
holders, with a fallback to any node. Ray Serve then starts a replica on a holder with room,
and anywhere else when none has room. Snapshots recorded after the app was built count from
its next deployment.

Example:
    >>> prefer_nodes(["ab12", "cd34"])["label_selector"]
    {'ray.io/node-id': 'in(ab12,cd34)'}
    >>> prefer_nodes([])
    {}
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from ember.loaders import list_snapshots

log = logging.getLogger("ember.control")
#: The label Ray gives every node: its node id.
NODE_ID_LABEL = "ray.io/node-id"
#: How long a node may take to say which snapshots it holds before it counts as none.
ANSWER_S = 20.0


def prefer_nodes(node_ids: Sequence[str]) -> dict[str, Any]:
    """Ray actor options that prefer ``node_ids`` and fall back to any node; ``{}`` if none."""
    if not node_ids:
        return {}
    return {
        "label_selector": {NODE_ID_LABEL: f"in({','.join(sorted(node_ids))})"},
        "fallback_strategy": [{"label_selector": {}}],
    }


def held_here(keys: Iterable[str]) -> list[str]:
    """Which of ``keys`` have a snapshot record in this node's cache."""
    here = {info.key for info in list_snapshots()}
    return [key for key in keys if key in here]


def holders(keys: Sequence[str]) -> dict[str, list[str]]:
    """Snapshot key -> ids of the alive nodes whose cache holds it (asked on each node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    found: dict[str, list[str]] = {key: [] for key in keys}
    if not keys:
        return found
    task = ray.remote(held_here)
    refs = {}
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if node.get("Alive"):
            strategy = NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
            ref = task.options(num_cpus=0, max_retries=0,
                               scheduling_strategy=strategy).remote(list(keys))
            refs[ref] = str(node["NodeID"])
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=ANSWER_S)
    for ref in late:
        log.warning("node %s did not say which snapshots it holds", refs[ref])
        ray.cancel(ref, force=True)
    for ref in ready:
        try:
            held = ray.get(ref)
        except ray.exceptions.RayError as exc:
            log.warning("node %s could not list its snapshots: %s", refs[ref], exc)
            continue
        for key in held:
            found[key].append(refs[ref])
    return found
