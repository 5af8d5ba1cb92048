"""Steady load: ramp up to ``-u`` users at ``-r`` users/s, hold until ``--run-time``.

Before the ramp, one request outside the stats wakes the deployment, so the budgets
measure a warm service under load, not the cold start (``coldstart.py`` measures that).
Users mix ``POST /embed`` and, unless ``--openai-path ''``, ``POST /v1/embeddings``.

Budgets: p95 and p99 latency over all requests, and the failure ratio.

    locust -f loadtests/steady.py --headless -H http://127.0.0.1:8000 -u 8 -r 1 \\
        --run-time 60s --budget-p95-ms 500
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common import (
    Budget,
    HoldForRunTime,
    add_target_options,
    check_embeddings,
    finish,
    post_ok,
    prepare_run,
    texts,
    wait_until,
)
from locust import FastHttpUser, between, events, task


@dataclass
class SteadyState:
    error: str | None = None


STATE = SteadyState()


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    add_target_options(parser, deployment="MiniLM", path="/embed")
    group = parser.add_argument_group("steady scenario")
    group.add_argument("--openai-path", default="/v1/embeddings",
                       help="OpenAI embeddings route; '' to skip it")
    group.add_argument("--openai-model", default="all-MiniLM-L6-v2")
    group.add_argument("--budget-p95-ms", type=float, default=1000.0,
                       help="p95 latency over all requests (default 1000)")
    group.add_argument("--budget-p99-ms", type=float, default=2000.0,
                       help="p99 latency over all requests (default 2000)")
    group.add_argument("--budget-fail-ratio", type=float, default=0.01,
                       help="failed / all requests (default 0.01)")


@events.init.add_listener
def _warm_up(environment: Any, **_: Any) -> None:
    """Wake the deployment before the ramp; its cold start is not what this measures."""
    options = prepare_run(environment, STATE, users=8, spawn_rate=1, run_time_s=60)
    if options is None:
        return
    url = f"{environment.host.rstrip('/')}{options.path}"
    print(f"[steady] warming up {url}", flush=True)
    if not wait_until(lambda: post_ok(url, texts(1), timeout_s=60), options.ready_timeout_s, 1):
        STATE.error = f"{url} never answered 200 within {options.ready_timeout_s:g}s"


class SteadyUser(FastHttpUser):
    wait_time = between(0.2, 0.8)
    network_timeout = 60.0
    connection_timeout = 10.0

    @task(3)
    def embed(self) -> None:
        path = self.environment.parsed_options.path
        sent = texts()
        with self.client.post(path, json=sent, name=path.strip("/"),
                              catch_response=True) as resp:
            check_embeddings(resp, sent)

    @task(1)
    def openai(self) -> None:
        options = self.environment.parsed_options
        if not options.openai_path:
            return
        sent = texts()
        body = {"model": options.openai_model, "input": sent}
        with self.client.post(options.openai_path, json=body,
                              name=options.openai_path.strip("/"), catch_response=True) as resp:
            check_embeddings(resp, sent)


class Ramp(HoldForRunTime):
    """Linear ramp to -u users at -r users/s (locust spawns at that rate), then hold.

    The whole run, ramp included, lasts --run-time: the budgets cover the ramp too, since
    a service that misbehaves while it scales up misbehaves for its users.
    """

    state = STATE


@events.quitting.add_listener
def _check_budgets(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    total = environment.stats.total
    has_requests = total.num_requests > 0
    budgets = [
        Budget("p95 latency", total.get_response_time_percentile(0.95) if has_requests else None,
               options.budget_p95_ms, " ms"),
        Budget("p99 latency", total.get_response_time_percentile(0.99) if has_requests else None,
               options.budget_p99_ms, " ms"),
        Budget("failure ratio", round(total.fail_ratio, 4) if has_requests else None,
               options.budget_fail_ratio),
    ]
    finish(environment, "steady", budgets, STATE.error)
