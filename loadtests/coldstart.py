"""Cold start: wait for the deployment to be at zero replicas, then send a burst.

Before any user starts, the scenario polls ``/-/status`` until the deployment has no
running or starting replica (bounded by ``--zero-wait-s``). Then all ``-u`` users start at
once and each sends one request, named ``embed [cold]``: they all arrive while there is
no replica. Each then sends ``--warm-requests`` more, named ``embed [warm]``, and the run
ends when every user is done (or after ``--run-time``).

Budgets: max latency of the cold requests (by default the ``cold_start_budget_s`` the
deployment declares, shown in ``/-/status``), p95 of the warm ones, failures, and Ember
itself counting at least one cold start (proof that the burst really hit zero replicas).
With ``--expect-path replica-warm-runtime`` (a server without the warm pool), every cold
request must also say, in ``X-Ember-Cold-Start``, that the deployment's own replica served it
from a pre-started worker (``path=replica;...;start=0;import=0``); ``--expect-path pool``
asks for the pool.

    locust -f loadtests/coldstart.py --headless -H http://127.0.0.1:8000 -u 8 \\
        --budget-cold-max-ms 30000
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common import (
    Budget,
    add_target_options,
    check_embeddings,
    deployment_row,
    entry,
    finish,
    prepare_run,
    texts,
    wait_until,
)
from locust import FastHttpUser, LoadTestShape, constant, events, task


@dataclass
class ColdState:
    """What the hooks, the users and the shape of this process share."""

    error: str | None = None
    cold_starts_before: int | None = None
    declared_cold_budget_s: float | None = None
    users_done: int = 0
    cold_paths: list[str] | None = None


STATE = ColdState()
# For a deployment that declares no cold-start budget: catches a cold start that hangs or
# crawls, without failing on a slow shared machine.
UNDECLARED_COLD_BUDGET_MS = 30000.0


def names(options: Any) -> tuple[str, str]:
    base = options.path.strip("/") or "root"
    return f"{base} [cold]", f"{base} [warm]"


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    add_target_options(parser, deployment="MiniLM", path="/embed")
    group = parser.add_argument_group("coldstart scenario")
    group.add_argument("--warm-requests", type=int, default=3,
                       help="requests each user sends after its cold one (default 3)")
    group.add_argument("--zero-wait-s", type=float, default=120.0,
                       help="how long to wait for the deployment to reach zero replicas")
    group.add_argument("--budget-cold-max-ms", type=float, default=None,
                       help="max latency of a cold request (default: the deployment's "
                       f"cold_start_budget_s, else {UNDECLARED_COLD_BUDGET_MS:g})")
    group.add_argument("--budget-warm-p95-ms", type=float, default=2000.0,
                       help="p95 latency of the warm requests (default 2000)")
    group.add_argument("--budget-failures", type=int, default=0,
                       help="failed requests allowed (default 0)")
    group.add_argument("--expect-path",
                       choices=("any", "pool", "pool-warm", "replica-warm-runtime"),
                       default="any", help="how every cold request must have been served")


def cold_path(header: str | None) -> str:
    """``pool``, ``pool-warm``, ``replica-warm-runtime``, ``replica-fresh-process`` or ``none``."""
    if not header:
        return "none"
    fields = dict(part.split("=", 1) for part in header.split(";") if "=" in part)
    if fields.get("path") != "replica":
        return fields.get("path", "none")
    warm = fields.get("start") == "0" and fields.get("import") == "0"
    return "replica-warm-runtime" if warm else "replica-fresh-process"


@events.init.add_listener
def _wait_for_zero(environment: Any, **_: Any) -> None:
    """Block until the deployment has no replica, before any user exists."""
    # The burst is -u users at once; --run-time only bounds how long it may take.
    options = prepare_run(environment, STATE, users=8, spawn_rate=8, run_time_s=180)
    if options is None:
        return
    options.spawn_rate = options.num_users
    host, name = environment.host, options.deployment
    print(f"[coldstart] waiting up to {options.zero_wait_s:g}s for {name} to reach zero "
          "replicas", flush=True)

    def at_zero() -> bool:
        row = deployment_row(host, name)
        return row is not None and row["replicas_running"] + row["replicas_starting"] == 0

    if not wait_until(at_zero, options.zero_wait_s):
        STATE.error = never_at_zero(host, name, options.zero_wait_s)
        return
    row = deployment_row(host, name) or {}
    STATE.cold_starts_before = row.get("cold_starts")
    STATE.declared_cold_budget_s = row.get("cold_start_budget_s")


def never_at_zero(host: str, name: str, waited_s: float) -> str:
    row = deployment_row(host, name)
    if row is None:
        return (f"no row for {name} in {host}/-/status: is Ember serving there, and is "
                f"{name} one of its deployments (--deployment)?")
    return (f"{name} never reached zero replicas in {waited_s:g}s (last status: "
            f"{row['replicas_running']} running, {row['replicas_starting']} starting); is its "
            "scaledown_after_s short (EMBER_SCALEDOWN_AFTER_S) and its warm_floor 0?")


class ColdUser(FastHttpUser):
    """Sends one cold request, then ``--warm-requests`` warm ones, then idles."""

    wait_time = constant(0.2)
    # A cold request waits for a replica to start: far longer than locust's default.
    network_timeout = 300.0
    connection_timeout = 10.0

    def on_start(self) -> None:
        self.sent = 0

    @task
    def embed(self) -> None:
        options = self.environment.parsed_options
        if self.sent > options.warm_requests:
            return  # done; the shape ends the run once every user is
        cold_name, warm_name = names(options)
        sent = texts()
        name = cold_name if self.sent == 0 else warm_name
        with self.client.post(options.path, json=sent, name=name, catch_response=True) as resp:
            check_embeddings(resp, sent)
            if self.sent == 0:
                STATE.cold_paths = [*(STATE.cold_paths or []),
                                    cold_path(resp.headers.get("x-ember-cold-start"))]
        self.sent += 1
        if self.sent > options.warm_requests:
            STATE.users_done += 1


class Burst(LoadTestShape):
    """All users at once; stop when each has sent its requests, or at --run-time."""

    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        if STATE.error or STATE.users_done >= options.num_users:
            return None
        if self.get_run_time() > options.run_time_s:
            STATE.error = (f"only {STATE.users_done} of {options.num_users} users finished "
                           f"within --run-time {options.run_time_s}s")
            return None
        return options.num_users, options.num_users


def cold_budget(options: Any, measured: float | None) -> Budget:
    """--budget-cold-max-ms if given, else what the deployment promises, else a backstop."""
    if options.budget_cold_max_ms is not None:
        return Budget("cold max latency", measured, options.budget_cold_max_ms, " ms")
    if STATE.declared_cold_budget_s:
        return Budget("cold max latency (deployment's cold_start_budget_s)", measured,
                      STATE.declared_cold_budget_s * 1000, " ms")
    return Budget("cold max latency", measured, UNDECLARED_COLD_BUDGET_MS, " ms")


#: How long the count may take to reach the edge that answers ``/-/status``: each edge counts
#: the cold requests it served and publishes its counts to the others about once a second.
COUNT_WAIT_S = 15.0


def counted_cold_starts(host: str, deployment: str, before: int) -> int | None:
    """Cold starts Ember counted since ``before``, once at least one shows (or the last read
    after :data:`COUNT_WAIT_S`); ``None`` if ``/-/status`` never answered."""
    seen: list[int] = []

    def counted() -> bool:
        after = (deployment_row(host, deployment) or {}).get("cold_starts")
        if after is not None:
            seen.append(int(after) - before)
        return bool(seen) and seen[-1] >= 1

    wait_until(counted, COUNT_WAIT_S)
    return seen[-1] if seen else None


@events.quitting.add_listener
def _check_budgets(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    cold_name, warm_name = names(options)
    cold, warm = entry(environment, cold_name), entry(environment, warm_name)
    budgets = [
        Budget("cold requests sent", cold.num_requests if cold else None, options.num_users,
               at_least=True),
        cold_budget(options, cold.max_response_time if cold else None),
        Budget("failures", environment.stats.total.num_failures, options.budget_failures),
    ]
    if options.expect_path != "any":
        paths = STATE.cold_paths or []
        served = sum(1 for p in paths if p == options.expect_path)
        budgets.append(Budget(f"cold requests served by {options.expect_path}", served,
                              options.num_users, at_least=True,
                              detail=f"{served} of {len(paths)}: {sorted(set(paths))}"))
    if options.warm_requests > 0:
        budgets.append(Budget("warm p95 latency",
                              warm.get_response_time_percentile(0.95) if warm else None,
                              options.budget_warm_p95_ms, " ms"))
    if STATE.cold_starts_before is not None and environment.host:
        seen = counted_cold_starts(environment.host, options.deployment,
                                   STATE.cold_starts_before)
        budgets.append(Budget("cold starts counted by Ember", seen, 1, at_least=True))
    finish(environment, "coldstart", budgets, STATE.error)
