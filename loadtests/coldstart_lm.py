"""Cold start of a causal LM with the page cache cold, against a budget.

Before any user starts, the scenario waits for the deployment (``CausalLM`` by default)
to have no replica, then drops from the page cache every blob of the node cache
(``EMBER_CACHE_DIR``) and, for a ``file://`` origin, the weights files themselves
(``--weights-dir``), checked with ``mincore``. Then all ``-u`` users send one ``POST /lm``
at once (``lm [cold]``): they all arrive while there is no replica and no weight page is in
memory. Each then sends ``--warm-requests`` more (``lm [warm]``).

Budgets: max latency of the cold requests (``--budget-cold-max-ms``), failures, the
proof that the weights came from storage (a cold answer's load report read bytes from disk
or filled the node cache), and the modules the cold replica imported in ``setup()``
(``--budget-setup-imports``): transformers' model code must come with the deployment's
module, not with the first load.

    locust -f loadtests/coldstart_lm.py --headless -H http://127.0.0.1:8000 -u 2 \\
        --weights-dir ~/.cache/ember-bench/ladder/2gb --budget-cold-max-ms 120000
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import (
    Budget,
    add_target_options,
    deployment_row,
    entry,
    finish,
    prepare_run,
    wait_until,
)
from locust import FastHttpUser, LoadTestShape, constant, events, task

TOKENS = [1, 306, 496, 445, 124, 289]


@dataclass
class State:
    error: str | None = None
    users_done: int = 0
    resident_after_drop_bytes: int | None = None
    from_storage: int = 0  # cold answers whose weights were read from storage
    setup_imports: int | None = None  # the most a cold answer's replica imported in setup()


STATE = State()


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    add_target_options(parser, deployment="CausalLM", path="/lm")
    group = parser.add_argument_group("coldstart-lm scenario")
    group.add_argument("--warm-requests", type=int, default=2)
    group.add_argument("--zero-wait-s", type=float, default=120.0)
    group.add_argument("--weights-dir", default="", help="a file:// origin's folder, dropped too")
    group.add_argument("--budget-cold-max-ms", type=float, default=120000.0)
    group.add_argument("--budget-failures", type=int, default=0)
    # transformers' model code (1,500 modules, seconds of CPU) comes with the deployment's
    # module, which the warm runtime preloaded: a load imports only its architecture's
    # module and its URL scheme's.
    group.add_argument("--budget-setup-imports", type=int, default=10)


def drop_page_cache(weights_dir: str) -> int:
    """Drop the node cache's blobs (and the origin's files); bytes still resident after."""
    from ember.loaders._config import default_cache_dir
    from ember.loaders.pages import evict, resident_bytes

    files = [p for p in default_cache_dir().glob("*/blobs/*") if p.is_file()]
    if weights_dir:
        files += sorted(Path(weights_dir).expanduser().glob("*.safetensors"))
    for path in files:
        evict(path)
    return sum(resident_bytes(p) for p in files)


@events.init.add_listener
def _cold_node(environment: Any, **_: Any) -> None:
    options = prepare_run(environment, STATE, users=2, spawn_rate=2, run_time_s=300)
    if options is None:
        return
    options.spawn_rate = options.num_users
    host, name = environment.host, options.deployment

    def at_zero() -> bool:
        row = deployment_row(host, name)
        return row is not None and row["replicas_running"] + row["replicas_starting"] == 0

    if not wait_until(at_zero, options.zero_wait_s):
        STATE.error = f"{name} never reached zero replicas in {options.zero_wait_s:g}s"
        return
    STATE.resident_after_drop_bytes = drop_page_cache(options.weights_dir)
    print(f"[coldstart-lm] page cache dropped; {STATE.resident_after_drop_bytes} bytes "
          "still resident", flush=True)


class ColdUser(FastHttpUser):
    wait_time = constant(0.2)
    network_timeout = 600.0
    connection_timeout = 10.0

    def on_start(self) -> None:
        self.sent = 0

    @task
    def forward(self) -> None:
        options = self.environment.parsed_options
        if self.sent > options.warm_requests:
            return
        name = "lm [cold]" if self.sent == 0 else "lm [warm]"
        with self.client.post(options.path, json=TOKENS, name=name, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"status {resp.status_code}: {resp.text[:200]}")
            elif self.sent == 0:
                load = resp.json().get("load", {})
                if load.get("read_bytes", 0) > 0 or not load.get("restored", True):
                    STATE.from_storage += 1
                imported = int(resp.json().get("setup_imports", 0))
                STATE.setup_imports = max(STATE.setup_imports or 0, imported)
        self.sent += 1
        if self.sent > options.warm_requests:
            STATE.users_done += 1


class Burst(LoadTestShape):
    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        if STATE.error or STATE.users_done >= options.num_users:
            return None
        if self.get_run_time() > options.run_time_s:
            STATE.error = f"only {STATE.users_done} of {options.num_users} users finished"
            return None
        return options.num_users, options.num_users


@events.quitting.add_listener
def _check_budgets(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    cold = entry(environment, "lm [cold]")
    budgets = [
        Budget("cold requests sent", cold.num_requests if cold else None, options.num_users,
               at_least=True),
        Budget("cold max latency (page cache cold)", cold.max_response_time if cold else None,
               options.budget_cold_max_ms, " ms"),
        Budget("failures", environment.stats.total.num_failures, options.budget_failures),
        Budget("cold answers that read their weights from storage", STATE.from_storage, 1,
               at_least=True),
        Budget("modules a cold replica imported in setup()", STATE.setup_imports,
               options.budget_setup_imports),
    ]
    finish(environment, "coldstart-lm", budgets, STATE.error)
