"""Losing a node under load, on two Ray nodes on this machine (see ``test_two_nodes.py``).

A module of its own, so that it has a cluster of its own: the test leaves node-b dead.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from test_two_nodes import Load, _get, cluster, placed, stores  # noqa: F401 (fixtures)

import ember

from apps.two_nodes import survivor_app
from support import free_port, wait_for

pytestmark = pytest.mark.slow


def test_a_lost_node_fails_under_1pc_of_requests_and_its_replicas_come_back(
    cluster: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    """Kill node-b's raylet under load: node-a's edge and replicas carry on, and the lost
    replica is started again on node-a."""
    import signal

    url = ember.serve(survivor_app, port=free_port())
    wait_for(lambda: _get(f"{url}/readyz") == 200, 60, what="the survivor app")
    wait_for(lambda: placed("Where", survivor_app.name) == ["node-a", "node-b"], 60,
             what="a replica on each node")
    [node_b] = cluster.worker_nodes
    with Load(url, threads=4, sleep_s=0.05) as load:
        wait_for(lambda: len(load.codes) >= 100, 60, what="load before the kill")
        killed = time.monotonic()
        os.kill(node_b.all_processes["raylet"][0].process.pid, signal.SIGKILL)
        wait_for(lambda: placed("Where", survivor_app.name) == ["node-a", "node-a"], 60,
                 what="the lost replica back on node-a")
        back_s = time.monotonic() - killed
        sent = len(load.codes)
        wait_for(lambda: len(load.codes) >= sent + 100, 30, what="load after the recovery")
    ok = load.codes.count(200) / len(load.codes)
    print(f"node lost: {len(load.codes)} requests, {ok:.2%} answered 200, "
          f"replica back on node-a in {back_s:.1f} s")
    assert ok >= 0.99, sorted(set(load.codes))
    assert back_s < 60
