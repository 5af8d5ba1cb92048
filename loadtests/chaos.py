"""Chaos: SIGKILL a replica (or an edge) every ``--kill-every-s`` under load; almost nothing fails.

Meant for ``loadtests/apps.py:app`` (deployment ``Sleeper``: two replicas, 100-200 ms
per request, each answer naming the PID of its replica), served on this machine. Users
POST steadily for ``--run-time``. Meanwhile a killer (one, on the master or local runner)
wakes every ``--kill-every-s``, finds the replica processes by asking ``--pid-path`` a few
times, checks that the PID is a Ray Serve replica of that deployment on this machine, and
SIGKILLs one. It then polls ``/-/status`` until ``replicas_running`` is back to
``--replicas`` and the replicas answering are two live processes, not the killed one, and
records how long that took. No kill is made in the last ``--quiet-tail-s`` of the run; a
recovery still under way when the load ends is waited for before the budgets are checked.

With ``--kill edge`` the victims are Ember's edges, the processes that accept the
connections (at least two share the port): their PIDs come from ``/-/status`` asked on fresh
connections, and whole again means ``--edges`` edges running and answering. Only requests in
flight on the killed edge may fail.

Budgets: the share of requests that succeeded (a request caught on the killed replica is
retried once on the other, so nearly all should), the slowest recovery to full size, and
at least one kill (a run that never killed anything proves nothing).

    locust -f loadtests/chaos.py --headless -H http://127.0.0.1:8000 -u 8 -r 4 \\
        --run-time 90s --kill-every-s 20
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import gevent
import httpx
import psutil
from common import (
    Budget,
    HoldForRunTime,
    add_target_options,
    deployment_row,
    finish,
    post_ok,
    prepare_run,
    wait_until,
)
from locust import FastHttpUser, between, events, task
from locust.runners import WorkerRunner

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
#: Polls of /-/status while a replica is replaced.
RECOVERY_POLL_S = 0.25
#: How long past the recovery budget a recovery is still waited for (to report how late).
RECOVERY_GRACE_S = 5.0


@dataclass
class Kill:
    """One SIGKILL: when (seconds since the load started), whom, and how long until whole."""

    at_s: float
    pid: int
    recovery_s: float | None = None  # None while the replacement is awaited
    recovered: bool = False


@dataclass
class ChaosState:
    """What the hooks, the killer, the users and the shape of this process share."""

    error: str | None = None
    started: float = 0.0  # time.monotonic() when the load started
    stopping: bool = False  # the load is over: no more kills
    kills: list[Kill] = field(default_factory=list)
    killer: Any = None  # the killer's greenlet


STATE = ChaosState()


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    add_target_options(parser, deployment="Sleeper", path="/sleep")
    group = parser.add_argument_group("chaos scenario")
    group.add_argument("--pid-path", default="/sleep/pid",
                       help="GET route answering {\"pid\": ...} of the replica that served it")
    group.add_argument("--replicas", type=int, default=2,
                       help="the deployment's size, to which it must come back (default 2)")
    group.add_argument("--kill", choices=("replica", "edge"), default="replica",
                       help="what to SIGKILL: a replica of --deployment, or an edge")
    group.add_argument("--edges", type=int, default=2,
                       help="edges the server runs, to which it must come back (default 2)")
    group.add_argument("--kill-every-s", type=float, default=20.0,
                       help="SIGKILL one replica this often (default 20)")
    group.add_argument("--quiet-tail-s", type=float, default=5.0,
                       help="no kill in the last seconds of the run (default 5)")
    group.add_argument("--budget-success-ratio", type=float, default=0.99,
                       help="successful / all requests, for replica kills (default 0.99); "
                       "edge kills may fail at most one request per user each")
    group.add_argument("--budget-recovery-s", type=float, default=15.0,
                       help="max seconds from a kill until the deployment is back to size "
                       "(default 15)")
    group.add_argument("--budget-min-kills", type=int, default=1,
                       help="kills needed for the run to count (default 1)")


@events.init.add_listener
def _wait_ready(environment: Any, **_: Any) -> None:
    """Before any user: the deployment answers and has all its replicas running."""
    options = prepare_run(environment, STATE, users=8, spawn_rate=4, run_time_s=90)
    if options is None:
        return
    if urlsplit(environment.host).hostname not in LOCAL_HOSTS:
        # The killer signals replica processes by PID, which only means something here.
        STATE.error = f"the server must run on this machine (127.0.0.1), not {environment.host}"
        return
    host = environment.host.rstrip("/")

    def ready() -> bool:
        row = deployment_row(host, options.deployment)
        return (row is not None and row.get("replicas_running", 0) >= options.replicas
                and post_ok(f"{host}{options.path}", {}, timeout_s=30))

    if not wait_until(ready, options.ready_timeout_s, 1):
        STATE.error = (f"{options.deployment} never had {options.replicas} replicas running "
                       f"and answering within {options.ready_timeout_s:g}s")


def elapsed_s() -> float:
    return time.monotonic() - STATE.started


def replica_pids(host: str, options: Any, tries: int = 16) -> set[int]:
    """PIDs of the replicas answering ``--pid-path`` (up to ``tries`` asks, outside stats)."""
    pids: set[int] = set()
    with httpx.Client(timeout=5) as client:
        for _ in range(tries):
            try:
                reply = client.get(f"{host}{options.pid_path}")
                if reply.status_code == 200:
                    pids.add(int(reply.json()["pid"]))
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass  # a replica dying under the ask: ask again
            if len(pids) >= options.replicas:
                break
    return pids


def is_replica(pid: int, deployment: str) -> bool:
    """Whether ``pid`` is a live Ray Serve replica process of ``deployment`` on this machine.

    Ray names a replica's process ``ray::ServeReplica:<app>:<deployment>...``: checking it
    keeps the killer from ever signalling some other process with the same PID.
    """
    try:
        title = " ".join(psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return False
    return "ServeReplica:" in title and f":{deployment}" in title


def edge_pids(host: str, tries: int = 16) -> tuple[set[int], int]:
    """PIDs of the edges answering ``/-/status`` on fresh connections, and how many run.

    A new connection is how a caller meets another edge: the kernel spreads connections,
    not requests, over the edges that share the port.
    """
    pids: set[int] = set()
    running = 0
    for _ in range(tries):
        try:
            edges = httpx.get(f"{host}/-/status", timeout=5).json()["edges"]
            pids.add(int(edges["pid"]))
            running = max(running, int(edges["running"]))
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass  # an edge dying under the ask: ask again
    return pids, running


def is_edge(pid: int) -> bool:
    """Whether ``pid`` is a live Ember edge process on this machine (its Ray title says so)."""
    try:
        title = " ".join(psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return False
    return "ServeReplica:" in title and ":ember-edge" in title


def victims(host: str, options: Any) -> set[int]:
    """The processes one of which is killed next."""
    if options.kill == "edge":
        return edge_pids(host)[0]
    return replica_pids(host, options)


def is_victim(pid: int, options: Any) -> bool:
    return is_edge(pid) if options.kill == "edge" else is_replica(pid, options.deployment)


def whole(host: str, options: Any, victim: int) -> bool:
    """Back to size: the expected count runs and answers, the killed process not among them."""
    if options.kill == "edge":
        pids, running = edge_pids(host)
        return running >= options.edges and len(pids) >= options.edges and victim not in pids
    row = deployment_row(host, options.deployment)
    if row is None or row.get("replicas_running", 0) < options.replicas:
        return False
    pids = replica_pids(host, options)
    return len(pids) >= options.replicas and victim not in pids


def wait_recovered(host: str, options: Any, victim: int) -> tuple[float, bool]:
    """Seconds until the target is back to size without ``victim``, and whether it was.

    Back to size means ``/-/status`` counts them all running and that many distinct
    processes, none of them the killed one, answer: the status alone can lag the kill.
    """
    started = time.monotonic()
    deadline = started + options.budget_recovery_s + RECOVERY_GRACE_S
    while time.monotonic() < deadline:
        if whole(host, options, victim):
            return round(time.monotonic() - started, 2), True
        gevent.sleep(RECOVERY_POLL_S)
    return round(time.monotonic() - started, 2), False


def kill_loop(environment: Any) -> None:
    """Kill one replica every ``--kill-every-s`` and time each recovery, until told to stop."""
    options = environment.parsed_options
    host = environment.host.rstrip("/")
    last_kill_s = options.run_time_s - options.quiet_tail_s
    due_s = options.kill_every_s
    while due_s <= last_kill_s:
        gevent.sleep(max(0.0, due_s - elapsed_s()))
        if STATE.stopping or STATE.error:
            return
        what = "edge" if options.kill == "edge" else f"{options.deployment} replica"
        pids = victims(host, options)
        if not pids:
            STATE.error = f"no {what} answered at {elapsed_s():.1f}s"
            return
        victim = random.choice(sorted(pids))
        if not is_victim(victim, options):
            STATE.error = f"pid {victim} is not a {what} on this machine; nothing was killed"
            return
        try:
            os.kill(victim, signal.SIGKILL)
        except OSError as exc:  # gone in between, or not ours to signal
            STATE.error = f"could not SIGKILL pid {victim}: {exc}"
            return
        kill = Kill(at_s=round(elapsed_s(), 2), pid=victim)
        STATE.kills.append(kill)
        print(f"[chaos] kill {len(STATE.kills)} at {kill.at_s:.1f}s: SIGKILL {what} pid "
              f"{victim} ({len(pids)} seen)", flush=True)
        kill.recovery_s, kill.recovered = wait_recovered(host, options, victim)
        size = options.edges if options.kill == "edge" else options.replicas
        print(f"[chaos] kill {len(STATE.kills)}: "
              + (f"back to {size} in {kill.recovery_s:.2f}s" if kill.recovered else
                 f"NOT back to {size} after {kill.recovery_s:.2f}s"), flush=True)
        if not kill.recovered:
            return  # the budget is missed already; more kills would only add noise
        due_s += options.kill_every_s


@events.test_start.add_listener
def _start_killer(environment: Any, **_: Any) -> None:
    # One killer per run: on the master (or the local runner), never on each worker.
    if isinstance(environment.runner, WorkerRunner) or STATE.error or STATE.killer is not None:
        return
    STATE.started = time.monotonic()
    STATE.killer = gevent.spawn(kill_loop, environment)


@events.test_stop.add_listener
def _stop_killing(**_: Any) -> None:
    STATE.stopping = True


def check_served(response: Any) -> None:
    """Mark a ``catch_response`` response ok only if a replica answered with its PID."""
    if response.status_code != 200:
        response.failure(f"HTTP {response.status_code}: {(response.text or '')[:200]}")
        return
    try:
        pid = response.json()["pid"]
    except (ValueError, KeyError, TypeError) as exc:
        response.failure(f"unexpected body: {exc!r}")
        return
    if isinstance(pid, int):
        response.success()
    else:
        response.failure(f"unexpected pid: {pid!r}")


class ChaosUser(FastHttpUser):
    wait_time = between(0.05, 0.25)
    network_timeout = 60.0
    connection_timeout = 10.0

    @task
    def work(self) -> None:
        path = self.environment.parsed_options.path
        with self.client.post(path, json={}, name=path.strip("/") or "root",
                              catch_response=True) as resp:
            check_served(resp)


class Steady(HoldForRunTime):
    """-u users at -r users/s, held until --run-time (kills or not)."""

    state = STATE


@events.quitting.add_listener
def _check_budgets(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    STATE.stopping = True
    if STATE.killer is not None:
        # A recovery under way when the load ended still counts: wait for its verdict.
        STATE.killer.join(timeout=options.budget_recovery_s + RECOVERY_GRACE_S + 20)
        STATE.killer.kill(block=False)
    total = environment.stats.total
    recoveries = [k.recovery_s for k in STATE.kills if k.recovery_s is not None]
    slowest = max(recoveries) if recoveries else None
    if any(k.recovery_s is None for k in STATE.kills):
        slowest = None  # a recovery was cut short: unknown, so not a pass
    for number, kill in enumerate(STATE.kills, 1):
        verdict = ("not measured" if kill.recovery_s is None else
                   f"{'back' if kill.recovered else 'NOT back'} after {kill.recovery_s:g}s")
        print(f"[chaos] kill {number}: pid {kill.pid} at {kill.at_s:g}s, {verdict}", flush=True)
    size = (f"{options.edges} edges" if options.kill == "edge"
            else f"{options.replicas} replicas")
    if options.kill == "edge":
        # A killed edge drops what its connections carry: at most one request per user (in
        # flight, or the next one on a connection to the dead edge), and nothing after.
        lost = Budget("failed requests (at most one per user per edge kill)",
                      total.num_failures, len(STATE.kills) * options.num_users)
    else:  # a request whose replica dies is retried on another: nearly all succeed
        lost = Budget("success ratio",
                      round(1 - total.fail_ratio, 4) if total.num_requests else None,
                      options.budget_success_ratio, at_least=True)
    budgets = [
        lost,
        Budget(f"{options.kill} kills", len(STATE.kills), options.budget_min_kills,
               at_least=True),
        Budget(f"slowest recovery to {size}", slowest, options.budget_recovery_s, " s"),
    ]
    finish(environment, "chaos", budgets, STATE.error)
