"""``ember cache warm --all-nodes``: the same fill on every alive node of the Ray cluster.

One Ray task per node, pinned to it (``NodeAffinitySchedulingStrategy(soft=False)``), each
running :func:`ember.cli.cache.fill` against that node's own cache (its ``EMBER_CACHE_DIR``)
and the shared regional tier. One node fills first, from the origin, and publishes to the
region; the others then fill at once, from the region: the origin serves the bytes once
(fills are single-flight within a node, not across nodes, so filling every node at once
would fetch from the origin once per node). The tasks ask for no CPU, so a node busy with
replicas still takes its fill. A line is printed per node as its task ends; a node whose
fill failed, or that died, is named, and the exit code is 1.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.cli.cache_fill import Filled, fill

Print = Callable[[str], None]


@dataclass(frozen=True)
class Node:
    """An alive Ray node: its id and the address it advertises."""

    node_id: str
    address: str

    def describe(self) -> str:
        """How a report line names the node."""
        return f"node {self.node_id} ({self.address})"


def alive_nodes() -> list[Node]:
    """Every alive node of the cluster this process joined."""
    import ray

    return [Node(str(n["NodeID"]), str(n.get("NodeManagerAddress", "?")))
            for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]


def _fill_here(url: str, cache_dir: Path | None, regional: str | None,
               snapshot: str | None) -> Filled:
    return fill(url, cache_dir=cache_dir, regional=regional, snapshot=snapshot)


def submit(nodes: Sequence[Node], url: str, *, cache_dir: Path | None, regional: str | None,
           snapshot: str | None) -> dict[Any, Node]:
    """Start one fill task pinned to each node; returns object ref -> node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(_fill_here)
    refs = {}
    for node in nodes:
        strategy = NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False)
        # No CPU: a node whose CPUs hold replicas still takes its fill. No retries: a fill
        # that failed is reported, not repeated on the same node.
        ref = task.options(num_cpus=0, max_retries=0, scheduling_strategy=strategy).remote(
            url, cache_dir, regional, snapshot)
        refs[ref] = node
    return refs


def describe_fill(filled: Filled) -> str:
    """One node's report: files, bytes, where they came from, time, snapshot."""
    counts: dict[str, int] = {}
    for source in filled.sources:
        counts[source] = counts.get(source, 0) + 1
    origin = ", ".join(f"{n} from {where}" for where, n in sorted(counts.items())) or "none"
    line = (f"{len(filled.paths)} file(s), {filled.total_bytes} bytes ({origin}) in "
            f"{filled.seconds:.2f} s")
    if filled.snapshot_key is not None:
        line += f"; snapshot {filled.snapshot_key[:12]} ready"
    return line


def collect(refs: dict[Any, Node], out: Print = print) -> list[Node]:
    """Wait for every task, printing a line per node as it ends; returns the failed nodes."""
    import ray

    failed: list[Node] = []
    pending = list(refs)
    while pending:
        [ref], pending = ray.wait(pending, num_returns=1)
        node = refs[ref]
        try:
            filled: Filled = ray.get(ref)
        except Exception as exc:  # the fill's own error, or the node's death
            failed.append(node)
            out(f"{node.describe()}: failed: {_reason(exc)}")
            continue
        out(f"{node.describe()}: {describe_fill(filled)}")
    return failed


def _reason(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # a task's exception arrives wrapped
    error = cause if isinstance(cause, BaseException) else exc
    return f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error) else ''}"


def _join() -> bool:
    import ray

    if ray.is_initialized():
        return True
    address = os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    except ConnectionError as exc:
        print(f"error: --all-nodes needs a running Ray cluster (RAY_ADDRESS): {exc}",
              file=sys.stderr)
        return False
    return True


def warm_all_nodes(url: str, *, cache_dir: Path | None = None, regional: str | None = None,
                   snapshot: str | None = None) -> int:
    """Run :func:`ember.cli.cache.fill` on every alive node; the command's exit code.

    Args:
        url: the weights URL.
        cache_dir: each node's cache directory; ``None``: each node's ``EMBER_CACHE_DIR``.
        regional: the regional tier's URL; ``None``: each node's ``EMBER_REGIONAL_CACHE``.
        snapshot: a code version whose snapshot each node records, or ``None``.

    Returns:
        0 when every node filled, 1 when some failed (named on stderr), 2 without a cluster.
    """
    if not _join():
        return 2
    nodes = alive_nodes()
    print(f"warming {url} on {len(nodes)} node(s)")
    failed: list[Node] = []
    for wave in (nodes[:1], nodes[1:]):  # the first publishes to the region for the rest
        failed += collect(submit(wave, url, cache_dir=cache_dir, regional=regional,
                                 snapshot=snapshot))
    if failed:
        names = ", ".join(node.node_id for node in failed)
        print(f"error: the fill failed on {len(failed)} of {len(nodes)} node(s): {names}",
              file=sys.stderr)
        return 1
    print(f"{len(nodes)} node(s) filled")
    return 0
