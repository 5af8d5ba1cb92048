"""Cold start of a causal LM with the page cache cold, against a budget.

Before any user starts, the scenario sends one request (the node serves the model once, so
its snapshot is in the node cache on disk, as on a node that served it before), waits for
the deployment (``CausalLM`` by default) to have no replica, then drops from the page
cache every blob of the node cache (``EMBER_CACHE_DIR``) and, for a ``file://`` origin,
the weights files themselves (``--weights-dir``), checked with ``mincore``. Then all
``-u`` users send one ``POST /lm`` at once (``lm [cold]``): they all arrive while there is
no replica and no weight page is in memory. Each then sends ``--warm-requests`` more
(``lm [warm]``).

Before dropping the weights, it measures this node's cold sequential read bandwidth
(``ember.loaders.limits.local_limits``: a scratch file in the node cache, written, dropped
and read back), so the load is judged against the disk it ran on, not against a figure
from another machine.

Budgets: max latency of the cold requests (``--budget-cold-max-ms``), failures, the
proof that the weights came from storage (a cold answer's load report read bytes from disk
or filled the node cache), the slowest cold load's GB/s as a share of the disk's measured
GB/s (``--budget-disk-share``: a loader that reads them slowly or twice misses it), the
major page faults of a cold answer's forward (``--budget-forward-major-faults``: a load that
left its pages to be faulted in by the forward, one readahead window at a time, misses
it), and the modules the cold replica imported in ``setup()``
(``--budget-setup-imports``): transformers' model code must come with the deployment's
module, not with the first load.

    locust -f loadtests/coldstart_lm.py --headless -H http://127.0.0.1:8000 -u 2 \\
        --weights-dir ~/.cache/ember-bench/ladder/2gb --budget-cold-max-ms 20000
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    Budget,
    add_target_options,
    deployment_row,
    entry,
    finish,
    post_ok,
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
    disk_gbps: float | None = None  # this node's cold sequential read, measured before
    load_gbps: list[float] = field(default_factory=list)  # each cold answer's load, GB/s
    forward_major_faults: int | None = None  # the most of a cold answer's forward


STATE = State()


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    add_target_options(parser, deployment="CausalLM", path="/lm")
    group = parser.add_argument_group("coldstart-lm scenario")
    group.add_argument("--warm-requests", type=int, default=2)
    group.add_argument("--zero-wait-s", type=float, default=120.0)
    group.add_argument("--weights-dir", default="", help="a file:// origin's folder, dropped too")
    group.add_argument("--budget-cold-max-ms", type=float, default=20000.0)
    group.add_argument("--budget-disk-share", type=float, default=0.3,
                       help="the slowest cold load's GB/s over the disk's measured GB/s")
    group.add_argument("--budget-forward-major-faults", type=int, default=10)
    group.add_argument("--budget-failures", type=int, default=0)
    # transformers' model code (1,500 modules, seconds of CPU) comes with the deployment's
    # module, which the warm runtime preloaded: a load imports only its architecture's
    # module and its URL scheme's.
    group.add_argument("--budget-setup-imports", type=int, default=10)


def disk_gbps() -> float:
    """This node's cold sequential read, GB/s, on the node cache's own disk."""
    from ember.loaders._config import default_cache_dir
    from ember.loaders.limits import local_limits

    return local_limits(default_cache_dir(), 512 << 20)["disk_cold_gbps"]


def load_gbps(load: dict[str, Any]) -> float | None:
    """A cold answer's load from the node cache: bytes read from disk over its wall time
    (None for a fill from the origin, whose report counts no disk reads)."""
    seconds = float(load.get("phases_s", {}).get("total", 0.0))
    read = int(load.get("read_bytes", 0))
    return read / seconds / 1e9 if seconds > 0 and load.get("restored") and read else None


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
    if not post_ok(f"{host}{options.path}", TOKENS, timeout_s=600):
        STATE.error = f"the priming request to {options.path} failed"
        return

    def at_zero() -> bool:
        row = deployment_row(host, name)
        return row is not None and row["replicas_running"] + row["replicas_starting"] == 0

    if not wait_until(at_zero, options.zero_wait_s):
        STATE.error = f"{name} never reached zero replicas in {options.zero_wait_s:g}s"
        return
    STATE.disk_gbps = disk_gbps()
    STATE.resident_after_drop_bytes = drop_page_cache(options.weights_dir)
    print(f"[coldstart-lm] disk reads {STATE.disk_gbps:.2f} GB/s cold; page cache dropped, "
          f"{STATE.resident_after_drop_bytes} bytes still resident", flush=True)


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
                reply = resp.json()
                load = reply.get("load", {})
                if load.get("read_bytes", 0) > 0 or not load.get("restored", True):
                    STATE.from_storage += 1
                print(f"[coldstart-lm] cold answer's load: {load}; cold start: "
                      f"{resp.headers.get('x-ember-cold-start')}", flush=True)
                gbps = load_gbps(load)
                if gbps is not None:
                    STATE.load_gbps.append(gbps)
                faults = int(reply.get("forward_faults", {}).get("major", 0))
                STATE.forward_major_faults = max(STATE.forward_major_faults or 0, faults)
                imported = int(reply.get("setup_imports", 0))
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
    # Several users' cold requests share one load: its GB/s is each answer's report.
    share = None
    if STATE.load_gbps and STATE.disk_gbps:
        share = round(min(STATE.load_gbps) / STATE.disk_gbps, 3)
        print(f"[coldstart-lm] cold loads {[round(g, 2) for g in STATE.load_gbps]} GB/s; "
              f"disk {STATE.disk_gbps:.2f} GB/s", flush=True)
    budgets = [
        Budget("cold requests sent", cold.num_requests if cold else None, options.num_users,
               at_least=True),
        Budget("cold max latency (page cache cold)", cold.max_response_time if cold else None,
               options.budget_cold_max_ms, " ms"),
        Budget("failures", environment.stats.total.num_failures, options.budget_failures),
        Budget("cold answers that read their weights from storage", STATE.from_storage, 1,
               at_least=True),
        Budget("slowest cold load's GB/s over the disk's", share,
               options.budget_disk_share, "x", at_least=True,
               detail="" if STATE.disk_gbps else "the disk was not measured"),
        Budget("major page faults in a cold answer's forward", STATE.forward_major_faults,
               options.budget_forward_major_faults),
        Budget("modules a cold replica imported in setup()", STATE.setup_imports,
               options.budget_setup_imports),
    ]
    finish(environment, "coldstart-lm", budgets, STATE.error)
