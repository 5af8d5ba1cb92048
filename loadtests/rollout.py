"""A rollout under load: the candidate goes 5 -> 25 -> 50 -> 100% and no request fails.

Users POST to ``--path`` at a steady pace. Once the load runs, the scenario starts
``PUT /-/rollout/{deployment}`` to ``--to`` with ``--steps`` every ``--every-s``, follows it
on ``GET /-/rollout/{deployment}`` and ends the load a few seconds after it ends.

Budgets: the rollout succeeded (reached 100% and held), no request failed, and both
versions answered requests (so the split really moved under load).

    ember run loadtests/apps.py:app
    locust -f loadtests/rollout.py --headless -H http://127.0.0.1:8000 -u 6 -r 6
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import gevent
import httpx
from common import (
    Budget,
    HoldForRunTime,
    add_target_options,
    finish,
    post_ok,
    prepare_run,
    wait_until,
)
from locust import FastHttpUser, between, events, task
from locust.runners import WorkerRunner

#: Load before the rollout starts, and after it ends, so every step meets a steady load.
SETTLE_S = 3.0


@dataclass
class RolloutState:
    error: str | None = None
    rollout: dict[str, Any] | None = None
    ended_at: float | None = None
    versions: Counter[str] = field(default_factory=Counter)
    driver: Any = None


STATE = RolloutState()


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    add_target_options(parser, deployment="Scorer", path="/score")
    group = parser.add_argument_group("rollout scenario")
    group.add_argument("--to", default="2", help="the candidate version (default 2)")
    group.add_argument("--steps", default="5,25,50,100", help="percent per step")
    group.add_argument("--every-s", type=float, default=5.0, help="how long each step holds")
    # The versions run the same code: a p99 verdict here could only be the machine's noise.
    group.add_argument("--max-p99-ratio", type=float, default=3.0)
    group.add_argument("--rollout-timeout-s", type=float, default=120.0,
                       help="how long the rollout may take before the scenario fails")
    group.add_argument("--budget-fail-ratio", type=float, default=0.0,
                       help="failed / all requests (default 0: none may fail)")


@events.init.add_listener
def _warm_up(environment: Any, **_: Any) -> None:
    options = prepare_run(environment, STATE, users=6, spawn_rate=6, run_time_s=180)
    if options is None:
        return
    url = f"{environment.host.rstrip('/')}{options.path}"
    if not wait_until(lambda: post_ok(url, {"text": "warm"}), options.ready_timeout_s, 1):
        STATE.error = f"{url} never answered 200 within {options.ready_timeout_s:g}s"


def drive(environment: Any) -> None:
    """Start the rollout once the load runs, follow it until it ends."""
    options = environment.parsed_options
    url = f"{environment.host.rstrip('/')}/-/rollout/{options.deployment}"
    gevent.sleep(SETTLE_S)
    body = {"to": options.to, "steps": [int(s) for s in options.steps.split(",")],
            "every_s": options.every_s, "max_p99_ratio": options.max_p99_ratio}
    reply = httpx.put(url, json=body, timeout=30)
    if reply.status_code != 200:
        STATE.error = f"the rollout was refused: {reply.status_code} {reply.text[:200]}"
        return
    print(f"[rollout] began: {body}", flush=True)
    deadline = time.monotonic() + options.rollout_timeout_s
    while time.monotonic() < deadline:
        gevent.sleep(0.5)
        try:
            STATE.rollout = httpx.get(url, timeout=10).json()
        except (httpx.HTTPError, ValueError):
            continue
        if STATE.rollout["state"] != "running":
            print(f"[rollout] {STATE.rollout['state']}: {STATE.rollout['history']}", flush=True)
            STATE.ended_at = time.monotonic()
            return
    STATE.error = f"the rollout did not end in {options.rollout_timeout_s:g}s"


@events.test_start.add_listener
def _start_driver(environment: Any, **_: Any) -> None:
    if isinstance(environment.runner, WorkerRunner) or STATE.error or STATE.driver is not None:
        return
    STATE.driver = gevent.spawn(drive, environment)


class RolloutUser(FastHttpUser):
    wait_time = between(0.05, 0.15)
    network_timeout = 30.0
    connection_timeout = 10.0

    @task
    def score(self) -> None:
        path = self.environment.parsed_options.path
        with self.client.post(path, json={"text": "rollout"}, name=path.strip("/"),
                              catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
                return
            STATE.versions[resp.headers.get("x-ember-version", "?")] += 1
            resp.success()


class UntilTheRolloutEnds(HoldForRunTime):
    """-u users until the rollout ended SETTLE_S ago (or failed to run)."""

    state = STATE

    def done(self) -> bool:
        return STATE.ended_at is not None and time.monotonic() - STATE.ended_at > SETTLE_S


@events.quitting.add_listener
def _check_budgets(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    total = environment.stats.total
    rollout = STATE.rollout or {}
    budgets = [
        Budget("rollout succeeded", 1.0 if rollout.get("state") == "succeeded" else 0.0, 1.0,
               at_least=True, detail="" if rollout.get("state") == "succeeded" else
               f"rollout {rollout.get('state', 'never began')}: {rollout.get('reason', '')}"),
        Budget("failure ratio", round(total.fail_ratio, 4) if total.num_requests else None,
               options.budget_fail_ratio),
        Budget("requests the candidate answered", float(STATE.versions[options.to]), 1.0,
               at_least=True),
    ]
    finish(environment, "rollout", budgets, STATE.error)
