"""Overload: more concurrent requests than the deployment's ``max_queue`` admits.

Meant for ``loadtests/apps.py:app`` (deployment ``Slow``: one request at a time, 200 ms
each, a queue of four), hit by ``-u`` users for ``--run-time``. Requests are named by
outcome: ``slow [200]`` (admitted), ``slow [503]`` (refused at once, with ``Retry-After``
and Ember's ``QueueFull`` error body) and ``slow [other]`` (anything else: a failure).

Pass means Ember sheds the excess load quickly and cleanly: some 503s, every one of them
fast, no timeouts, connection errors or other statuses, and once the load stops the
deployment answers 200 again within ``--recovery-s``.

    locust -f loadtests/overload.py --headless -H http://127.0.0.1:8000 -u 24 --run-time 30s
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from common import (
    Budget,
    add_target_options,
    entry,
    finish,
    post_ok,
    prepare_run,
    wait_until,
)
from locust import FastHttpUser, LoadTestShape, between, events, task


@dataclass
class OverloadState:
    error: str | None = None


STATE = OverloadState()


def names(options: Any) -> tuple[str, str, str]:
    base = options.path.strip("/") or "root"
    return f"{base} [200]", f"{base} [503]", f"{base} [other]"


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    add_target_options(parser, deployment="Slow", path="/slow")
    group = parser.add_argument_group("overload scenario")
    group.add_argument("--sleep-ms", type=int, default=200,
                       help="work per request asked of the Slow deployment (default 200)")
    # Ember's 503 asks the client to come back after 1 s (Retry-After): a refusal slower
    # than that is no help to anyone, and most should take a small fraction of it.
    group.add_argument("--budget-503-max-ms", type=float, default=1000.0,
                       help="max latency of a 503 (default 1000)")
    group.add_argument("--budget-503-p95-ms", type=float, default=300.0,
                       help="p95 latency of the 503s (default 300)")
    group.add_argument("--budget-min-503", type=int, default=1,
                       help="503s needed to call it an overload (default 1)")
    group.add_argument("--budget-failures", type=int, default=0,
                       help="timeouts, connection errors and other statuses allowed (default 0)")
    group.add_argument("--recovery-s", type=float, default=15.0,
                       help="after the load, seconds within which a request must get 200")


@events.init.add_listener
def _wait_ready(environment: Any, **_: Any) -> None:
    options = prepare_run(environment, STATE, users=24, spawn_rate=24, run_time_s=30)
    if options is None:
        return
    url = f"{environment.host.rstrip('/')}{options.path}"
    body = {"sleep_ms": options.sleep_ms}
    if not wait_until(lambda: post_ok(url, body), options.ready_timeout_s, 1):
        STATE.error = f"{url} never answered 200 within {options.ready_timeout_s:g}s"


def classify(resp: Any, options: Any) -> None:
    """Name the request by outcome; only a 200 or a proper QueueFull 503 is a success."""
    _, shed_name, other_name = names(options)
    if resp.status_code == 200:
        resp.success()
        return
    if resp.status_code == 503:
        try:
            error_type = resp.json()["error"]["type"]
        except (ValueError, KeyError, TypeError):
            error_type = None
        if error_type == "QueueFull" and resp.headers.get("Retry-After"):
            resp.request_meta["name"] = shed_name
            resp.success()
            return
    resp.request_meta["name"] = other_name
    resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")


class OverloadUser(FastHttpUser):
    # Short waits: a refused user comes back quickly, as impatient clients do, which keeps
    # the queue full without needing hundreds of users on a small machine.
    wait_time = between(0.05, 0.25)
    network_timeout = 60.0
    connection_timeout = 10.0

    @task
    def slow(self) -> None:
        options = self.environment.parsed_options
        body = {"sleep_ms": options.sleep_ms}
        with self.client.post(options.path, json=body, name=names(options)[0],
                              catch_response=True) as resp:
            classify(resp, options)


class Spike(LoadTestShape):
    """-u users at -r users/s (by default all at once) until --run-time."""

    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        if STATE.error or self.get_run_time() >= options.run_time_s:
            return None
        return options.num_users, options.spawn_rate


def recovery_s(environment: Any) -> float | None:
    """Seconds from the end of the load until a request gets 200 again, None if never."""
    options = environment.parsed_options
    if STATE.error or not environment.host:
        return None
    url = f"{environment.host.rstrip('/')}{options.path}"
    started = time.monotonic()
    if wait_until(lambda: post_ok(url, {"sleep_ms": options.sleep_ms}, timeout_s=10),
                  options.recovery_s, 0.25):
        return round(time.monotonic() - started, 2)
    return None


@events.quitting.add_listener
def _check_budgets(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    ok_name, shed_name, _other = names(options)
    admitted, shed = entry(environment, ok_name), entry(environment, shed_name)
    budgets = [
        Budget("503s (load beyond max_queue)", shed.num_requests if shed else 0,
               options.budget_min_503, at_least=True),
        Budget("503 p95 latency", shed.get_response_time_percentile(0.95) if shed else None,
               options.budget_503_p95_ms, " ms"),
        Budget("503 max latency", shed.max_response_time if shed else None,
               options.budget_503_max_ms, " ms"),
        Budget("requests admitted (200)", admitted.num_requests if admitted else 0, 1,
               at_least=True),
        Budget("timeouts, errors, other statuses", environment.stats.total.num_failures,
               options.budget_failures),
        Budget("recovery: 200 again after the load", recovery_s(environment),
               options.recovery_s, " s"),
    ]
    finish(environment, "overload", budgets, STATE.error)
