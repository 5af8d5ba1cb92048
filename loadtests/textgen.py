"""Streaming generation under load: time to first token and inter-token latency budgets.

Users stream ``POST /v1/completions`` (``"stream": true``) with output lengths mixed from
8 to 128 tokens, and time each event as it arrives: the first one is the time to first
token (TTFT), the gaps between the next ones the inter-token latency (ITL). Before the ramp,
one request outside the stats wakes the deployment, so the budgets measure a warm service
(``coldstart.py`` measures cold starts). A 503 from the engine's admission control counts
as a failure: at the default user count the engine must not be full.

Budgets: TTFT p95, ITL p95, the failure ratio, and at least one streamed token.

    locust -f loadtests/textgen.py --headless -H http://127.0.0.1:8000 -u 8 -r 4 \\
        --run-time 30s --budget-ttft-p95-ms 1500
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from common import (
    Budget,
    HoldForRunTime,
    add_target_options,
    finish,
    post_ok,
    prepare_run,
    wait_until,
)
from locust import HttpUser, between, events, task

MODEL = "ember-tinylm-byte"
LENGTHS = (8, 16, 32, 64, 128)
PROMPTS = ("Return the", "The socket module", "If the file", "This function", "A list of")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


@dataclass
class TextgenState:
    error: str | None = None
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    tokens: int = 0


STATE = TextgenState()


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    add_target_options(parser, deployment="TextGen", path="/v1/completions")
    group = parser.add_argument_group("textgen scenario")
    group.add_argument("--model", default=MODEL)
    group.add_argument("--budget-ttft-p95-ms", type=float, default=1500.0,
                       help="p95 time to first token (default 1500)")
    group.add_argument("--budget-itl-p95-ms", type=float, default=150.0,
                       help="p95 time between two tokens of a stream (default 150)")
    group.add_argument("--budget-fail-ratio", type=float, default=0.01,
                       help="failed / all requests (default 0.01)")


@events.init.add_listener
def _warm_up(environment: Any, **_: Any) -> None:
    options = prepare_run(environment, STATE, users=8, spawn_rate=4, run_time_s=30)
    if options is None:
        return
    url = f"{environment.host.rstrip('/')}{options.path}"
    body = {"model": options.model, "prompt": "warm", "max_tokens": 1}
    print(f"[textgen] warming up {url}", flush=True)
    if not wait_until(lambda: post_ok(url, body, timeout_s=120), options.ready_timeout_s, 1):
        STATE.error = f"{url} never answered 200 within {options.ready_timeout_s:g}s"


class StreamingUser(HttpUser):
    wait_time = between(0.1, 0.5)

    @task
    def complete(self) -> None:
        options = self.environment.parsed_options
        body = {"model": options.model, "prompt": random.choice(PROMPTS), "stream": True,
                "max_tokens": random.choice(LENGTHS), "temperature": 0.8}
        sent = time.perf_counter()
        with self.client.post(options.path, json=body, stream=True, name="completions-stream",
                              catch_response=True, timeout=120) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
                return
            error = self._read_events(resp, sent)
            if error:
                resp.failure(error)
            else:
                resp.success()

    def _read_events(self, resp: Any, sent: float) -> str | None:
        """Time every token event; an error string if the stream was not a whole one."""
        last, done = None, False
        for line in resp.iter_lines():
            if not line or not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                done = True
                break
            if "error" in json.loads(data):
                return f"error event: {data[:200]!r}"
            now = time.perf_counter()
            if last is None:
                STATE.ttft_ms.append((now - sent) * 1000)
            else:
                STATE.itl_ms.append((now - last) * 1000)
            last = now
            STATE.tokens += 1
        return None if done else "stream ended without [DONE]"


class Ramp(HoldForRunTime):
    """Linear ramp to -u users at -r users/s, then hold until --run-time."""

    state = STATE


@events.quitting.add_listener
def _check_budgets(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    total = environment.stats.total
    budgets = [
        Budget("TTFT p95", percentile(STATE.ttft_ms, 95) if STATE.ttft_ms else None,
               options.budget_ttft_p95_ms, " ms"),
        Budget("inter-token latency p95", percentile(STATE.itl_ms, 95) if STATE.itl_ms
               else None, options.budget_itl_p95_ms, " ms"),
        Budget("failure ratio", round(total.fail_ratio, 4) if total.num_requests else None,
               options.budget_fail_ratio),
        Budget("tokens streamed", float(STATE.tokens), 1, at_least=True),
    ]
    finish(environment, "textgen", budgets, STATE.error)
