"""A node lost under load: ``-u`` users POST to ``--path`` while one node's raylet is killed.

For a Ray cluster on this machine (``tests/integration/test_two_nodes_node_loss.py`` starts
one with two raylets): ``--kill-pid`` names the raylet to SIGKILL ``--kill-after-s`` into
the run. It must be a raylet of this machine's own test cluster: the scenario refuses a PID
whose command line is not a raylet's. The run holds ``--run-time`` in all; the recovery is
watched by whoever started the cluster, which knows where replicas run.

Budgets: the failure ratio over all requests (default at most 1%), at least
``--min-requests`` requests, and the kill happened.

    locust -f loadtests/nodeloss.py --headless -H http://127.0.0.1:8000 -u 4 -r 4 \\
        --path /where --kill-pid 12345 --kill-after-s 10 --run-time 60s
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

import gevent
import psutil
from common import Budget, HoldForRunTime, add_target_options, finish, prepare_run
from locust import FastHttpUser, between, events, task
from locust.runners import WorkerRunner


@dataclass
class NodeLossState:
    error: str | None = None
    killed_at_s: float | None = None
    killer: Any = None


STATE = NodeLossState()


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    add_target_options(parser, deployment="Where", path="/where")
    group = parser.add_argument_group("node-loss scenario")
    group.add_argument("--kill-pid", type=int, default=0, help="the raylet to SIGKILL")
    group.add_argument("--kill-after-s", type=float, default=10.0)
    group.add_argument("--budget-fail-ratio", type=float, default=0.01,
                       help="failed / all requests (default 0.01)")
    group.add_argument("--min-requests", type=int, default=100)


@events.init.add_listener
def _prepare(environment: Any, **_: Any) -> None:
    options = prepare_run(environment, STATE, users=4, spawn_rate=4, run_time_s=60)
    if options is None:
        return
    try:
        command = " ".join(psutil.Process(options.kill_pid).cmdline())
    except (psutil.Error, OSError, ValueError):
        command = ""
    if "raylet" not in command:
        STATE.error = f"--kill-pid {options.kill_pid} is not a raylet of this machine"


def kill_later(environment: Any) -> None:
    options = environment.parsed_options
    gevent.sleep(options.kill_after_s)
    os.kill(options.kill_pid, signal.SIGKILL)
    STATE.killed_at_s = options.kill_after_s
    print(f"[nodeloss] killed raylet {options.kill_pid} at {options.kill_after_s:g} s",
          flush=True)


@events.test_start.add_listener
def _start_killer(environment: Any, **_: Any) -> None:
    if isinstance(environment.runner, WorkerRunner) or STATE.error or STATE.killer is not None:
        return
    STATE.killer = gevent.spawn(kill_later, environment)


class NodeLossUser(FastHttpUser):
    wait_time = between(0.02, 0.08)
    network_timeout = 60.0
    connection_timeout = 10.0

    @task
    def post(self) -> None:
        path = self.environment.parsed_options.path
        with self.client.post(path, json={}, name=path.strip("/"), catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
            else:
                resp.success()


class Hold(HoldForRunTime):
    """-u users for --run-time, the kill somewhere inside it."""

    state = STATE


@events.quitting.add_listener
def _check_budgets(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    total = environment.stats.total
    budgets = [
        Budget("raylet killed", 1.0 if STATE.killed_at_s is not None else 0.0, 1.0,
               at_least=True),
        Budget("requests", float(total.num_requests), float(options.min_requests),
               at_least=True),
        Budget("failure ratio", round(total.fail_ratio, 4) if total.num_requests else None,
               options.budget_fail_ratio),
    ]
    finish(environment, "nodeloss", budgets, STATE.error)
