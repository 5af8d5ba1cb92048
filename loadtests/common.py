"""What the load-test scenarios share: options, budgets, and Ember's status endpoint.

Every scenario is a locustfile run headless; at exit it turns locust's stats into a list
of :class:`Budget` and sets the process exit code, so a missed budget fails the run (and
CI) on its own, whoever started locust.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx
from locust import LoadTestShape

from ember import settings

STATUS_PATH = "/-/status"

# Locust logs at INFO; httpx would then log every status poll and warm-up request.
logging.getLogger("httpx").setLevel(logging.WARNING)

SENTENCES = (
    "Ember scales a deployment to zero when it is idle.",
    "A cold request waits while a replica starts.",
    "The quick brown fox jumps over the lazy dog.",
    "Queue-depth autoscaling starts replicas for a burst in one decision.",
    "Serverless model serving on Ray Serve.",
    "Sentence embeddings map text to vectors of 384 numbers.",
)


@dataclass(frozen=True)
class Budget:
    """One pass/fail check of a run: ``measured`` against ``limit``.

    ``measured`` is None when there was nothing to measure (no request of that kind was
    made), which counts as a miss: a budget that cannot be checked must not pass silently.
    """

    name: str
    measured: float | None
    limit: float
    unit: str = ""
    at_least: bool = False  # True for floors ("at least one 503"), False for ceilings
    detail: str = ""  # why nothing could be measured (a setup failure)

    @property
    def passed(self) -> bool:
        if self.measured is None:
            return False
        return self.measured >= self.limit if self.at_least else self.measured <= self.limit

    def describe(self) -> str:
        if self.detail:
            return f"{'ok' if self.passed else 'MISSED':6} {self.name}: {self.detail}"
        sign = ">=" if self.at_least else "<="
        shown = "nothing measured" if self.measured is None else f"{self.measured:g}{self.unit}"
        verdict = "ok" if self.passed else "MISSED"
        return f"{verdict:6} {self.name}: {shown} (budget {sign} {self.limit:g}{self.unit})"


def add_target_options(parser: Any, *, deployment: str, path: str) -> None:
    """Options every scenario takes: what to hit and where to write the budget results."""
    group = parser.add_argument_group("Ember target")
    group.add_argument("--deployment", default=deployment,
                       help=f"deployment name in /-/status (default {deployment})")
    group.add_argument("--path", default=path, help=f"route to POST to (default {path})")
    group.add_argument("--ready-timeout-s", type=float, default=180.0,
                       help="how long to wait for the deployment before the load starts")
    group.add_argument("--budget-report", default="",
                       help="write the budget results to this JSON file")
    group.add_argument("--requests-log", default="",
                       help="write every request (start time, name, ms, ok) to this CSV file")


def log_requests(environment: Any) -> None:
    """Write one CSV row per request to ``--requests-log`` at exit, if given.

    Locust's stats history only has percentiles over a sliding window that needs a few
    seconds of data; a cold burst is over before that, so the report plots every request.
    """
    path = getattr(environment.parsed_options, "requests_log", "")
    if not path:
        return
    rows = ["start,name,ms,ok"]
    done = False

    def on_request(name: str, response_time: float, exception: Any = None,
                   start_time: float | None = None, **_: Any) -> None:
        if done:  # a request after the end (a recovery probe) is not part of the run
            return
        started = start_time if start_time is not None else time.time() - response_time / 1000
        rows.append(f"{started:.3f},{name.replace(',', ' ')},{response_time:.1f},"
                    f"{0 if exception else 1}")

    def on_quitting(**_: Any) -> None:
        nonlocal done
        done = True
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("\n".join(rows) + "\n")

    environment.events.request.add_listener(on_request)
    environment.events.quitting.add_listener(on_quitting)


def fill_run_defaults(options: Any, *, users: int, spawn_rate: float, run_time_s: int) -> None:
    """Scenario defaults for -u and -r, and ``options.run_time_s``: what the shapes read.

    Locust would otherwise default to one user, which makes every scenario meaningless.
    The shapes end the run themselves, so --run-time is kept apart rather than filled in
    (locust would then announce a time limit it does not enforce on a shape).
    """
    if options.num_users is None:
        options.num_users = users
    if options.spawn_rate is None:
        options.spawn_rate = spawn_rate
    options.run_time_s = options.run_time or run_time_s


def texts(count: int | None = None) -> list[str]:
    """A few sentences to embed (1 to 4 unless ``count`` is given)."""
    return random.sample(SENTENCES, count or random.randint(1, 4))


def check_embeddings(response: Any, sent: list[str]) -> None:
    """Mark a locust ``catch_response`` response ok only if it holds one embedding per text."""
    if response.status_code != 200:
        response.failure(f"HTTP {response.status_code}: {(response.text or '')[:200]}")
        return
    try:
        body = response.json()
        rows = body["data"] if isinstance(body, dict) else body
        ok = len(rows) == len(sent) and all(len(r["embedding"]) > 0 for r in rows)
    except (ValueError, KeyError, TypeError) as exc:
        response.failure(f"unexpected body: {exc!r}")
        return
    if ok:
        response.success()
    else:
        response.failure(f"expected {len(sent)} embeddings, got {len(rows)}")


def deployment_row(host: str, deployment: str) -> dict[str, Any] | None:
    """The deployment's row of ``/-/status``, or None if Ember cannot say right now.

    ``/-/status`` is an admin route: the key is ``EMBER_ADMIN_KEY``'s, when set.
    """
    key = settings.load().admin_key
    headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
    try:
        reply = httpx.get(f"{host.rstrip('/')}{STATUS_PATH}", headers=headers, timeout=10)
        rows = reply.json()["deployments"] if reply.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return next((dict(r) for r in rows if r.get("deployment") == deployment), None)


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.5) -> bool:
    """Poll ``predicate``; True as soon as it holds, False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def post_ok(url: str, body: Any, timeout_s: float = 60.0) -> bool:
    """One request outside locust's stats (warm-up, recovery probe): did it get a 200?"""
    try:
        return httpx.post(url, json=body, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def entry(environment: Any, name: str, method: str = "POST") -> Any | None:
    """Locust's stats for one request name, or None if no such request was made."""
    found = environment.stats.entries.get((name, method))
    return found if found is not None and found.num_requests > 0 else None


def finish(environment: Any, scenario: str, budgets: list[Budget], error: str | None) -> bool:
    """Print the budgets, write them as JSON if asked, and set locust's exit code.

    A setup error (the deployment never reached the state the scenario needs) is a miss
    of its own, so a scenario that could not run never passes.
    """
    if error:
        budgets = [Budget("setup", None, 0, detail=error), *budgets]
    passed = all(b.passed for b in budgets)
    lines = [f"[{scenario}] budgets: {'PASS' if passed else 'FAIL'}"]
    lines += [f"  {b.describe()}" for b in budgets]
    print("\n".join(lines), flush=True)
    report = getattr(environment.parsed_options, "budget_report", "")
    if report:
        rows = [{**asdict(b), "passed": b.passed} for b in budgets]
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        Path(report).write_text(json.dumps(
            {"scenario": scenario, "passed": passed, "budgets": rows}, indent=2))
    environment.process_exit_code = 0 if passed else 1
    return passed


def prepare_run(environment: Any, state: Any, *, users: int, spawn_rate: float,
                run_time_s: int) -> Any | None:
    """A scenario's init step: defaults filled, requests logged, the host checked.

    Returns the parsed options, or None when there is nothing to run: used as a library
    (no options), or no host given (``state.error`` then says so and the run fails).
    """
    options = environment.parsed_options
    if options is None:  # used as a library: nothing to prepare
        return None
    fill_run_defaults(options, users=users, spawn_rate=spawn_rate, run_time_s=run_time_s)
    log_requests(environment)
    if not environment.host:
        state.error = "no host: pass -H http://127.0.0.1:PORT"
        return None
    return options



class HoldForRunTime(LoadTestShape):
    """-u users at -r users/s (locust spawns at that rate) until --run-time, until the
    scenario's ``state`` has an ``error``, or until :meth:`done`.

    Abstract, so locust never picks it up from an import: a scenario declares its shape as a
    subclass that names its state (``class Ramp(HoldForRunTime): state = STATE``).
    """

    abstract = True
    use_common_options = True
    state: ClassVar[Any] = None

    def done(self) -> bool:
        """Whether the scenario is over before --run-time (the default: never)."""
        return False

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        if getattr(self.state, "error", None) or self.done() or (
                self.get_run_time() >= options.run_time_s):
            return None
        return options.num_users, options.spawn_rate
