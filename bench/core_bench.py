"""Cold start and warm latency of the seed MLP: Ember vs plain Ray Serve, in one run.

The same model (``SeedMLP`` from ``examples/mlp_app.py``: 256 -> 512 -> 16, weights loaded
from a safetensors file in ``setup``) is served three ways behind one Ray Serve HTTP proxy:

* ``Ember``: ``@ember.deployment(warm_floor=0, scaledown_after_s=2, num_cpus=0.5)`` served
  with ``ember.serve`` (route prefix ``/``, ``POST /mlp``).
* ``Ray Serve default``: a FastAPI ``@serve.ingress`` deployment with
  ``autoscaling_config={"min_replicas": 0, "max_replicas": 2, "initial_replicas": 0}`` and
  Ray's default timers (``POST /plain/mlp``). One deliberate change: Ray's default
  ``downscale_delay_s`` is 600 s, so reaching zero between trials would take ten minutes.
  Only ``downscale_delay_s`` and ``downscale_to_zero_delay_s`` are set small (the down
  path, which is not measured); ``upscale_delay_s``, ``metrics_interval_s`` and
  ``look_back_period_s`` keep their defaults, because the up path is what is measured.
* ``Ray Serve shrunk``: the same peer with every timer at its fastest (``upscale_delay_s=0``,
  small down delays, ``metrics_interval_s=0.1``, ``look_back_period_s=0.2``;
  ``POST /shrunk/mlp``).

Cold start: wait until every measured deployment has no replica in any state (so each cold
start runs on an otherwise idle cluster), then time one POST from send to 200.
``--trials`` rounds, median reported. Where the time goes, in seconds after the send
(medians, indented under the cold start in the table): when ``serve.status()`` first shows
a replica (the scale-up decision; an upper bound, polled), and, written by the replica
itself, when its worker process started (negative if Ray reused an earlier worker), when
its ``setup`` began (process up, modules imported) and when the weights were loaded. The
rest, up to the 200, is Serve's readiness check, routing and the request itself.
Warm latency: p50/p99 of ``--warm-requests`` sequential requests (concurrency 1) after
``WARMUP_REQUESTS`` untimed ones, again from an idle cluster. Everything is bounded by
``--deadline-s``. Results go to stdout (a table) and ``bench/results/core.json``. Absolute
numbers on a shared 2-core machine are noisy; the ratios are the point.

Usage:
    .venv/bin/python bench/core_bench.py [--trials 3] [--deadline-s 900]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
# Before ember starts Ray: local workers inherit these directories on PYTHONPATH.
sys.path.insert(0, str(ROOT / "examples"))

import httpx  # noqa: E402
import psutil  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from mlp_app import (  # noqa: E402
    IN_FEATURES,
    OUT_FEATURES,
    MlpRequest,
    MlpResponse,
    SeedMLP,
    ensure_weights,
    weights_path,
)
from ray import serve  # noqa: E402

import ember  # noqa: E402

RESULTS_PATH = ROOT / "bench" / "results" / "core.json"
SCALEDOWN_S = 2.0
REPLICA_CPUS = 0.5
WARMUP_REQUESTS = 20
STATUS_POLL_S = 0.05
# Replicas write when they started here; pickled by value, so they see the driver's path.
MARKS_DIR = Path(tempfile.gettempdir()) / f"core-bench-marks-{os.getpid()}"
F = TypeVar("F", bound=Callable[..., Any])
PAYLOAD = {"inputs": [[((i * 37) % 101) / 101.0 for i in range(IN_FEATURES)]]}


class DeadlineExceeded(RuntimeError):
    """The global time budget ran out."""


class Deadline:
    """A global wall-clock budget every wait and request is bounded by."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"global deadline of {self.seconds:.0f}s exceeded")
        return left

    def timeout(self, cap_s: float = 120.0) -> float:
        return min(cap_s, self.left())


@dataclass(frozen=True)
class Target:
    """One way of serving the model: where to POST and what to watch in ``serve.status()``."""

    label: str
    app: str
    deployment: str
    path: str


@dataclass
class Measurements:
    """Raw samples of one target; cold phases are seconds after the request was sent."""

    cold_s: list[float] = field(default_factory=list)
    cold_scale_up_seen_s: list[float | None] = field(default_factory=list)
    cold_process_start_s: list[float | None] = field(default_factory=list)
    cold_setup_start_s: list[float | None] = field(default_factory=list)
    cold_setup_done_s: list[float | None] = field(default_factory=list)
    warm_ms: list[float] = field(default_factory=list)


EMBER_DEPLOYMENT = "mlp"
EMBER = Target("Ember", "bench-ember", EMBER_DEPLOYMENT, "/mlp")
PLAIN_DEFAULT = Target("Ray Serve default", "plain-default", "PlainDefault", "/plain/mlp")
PLAIN_SHRUNK = Target("Ray Serve shrunk", "plain-shrunk", "PlainShrunk", "/shrunk/mlp")
TARGETS = (EMBER, PLAIN_DEFAULT, PLAIN_SHRUNK)


def write_mark(deployment: str, setup_start: float) -> None:
    """In a replica: when its process started and its setup began and ended (wall clock)."""
    mark = {
        "process_start": psutil.Process().create_time(),
        "setup_start": setup_start,
        "setup_done": time.time(),
    }
    MARKS_DIR.mkdir(parents=True, exist_ok=True)
    (MARKS_DIR / f"{deployment}-{os.getpid()}.json").write_text(json.dumps(mark))


def read_mark(deployment: str, sent: float) -> dict[str, float] | None:
    """The mark of the replica of ``deployment`` whose setup began after ``sent``.

    Marks are files, so only replicas on this host leave them (a joined remote cluster
    gives None, shown as '-').
    """
    marks = [json.loads(p.read_text()) for p in MARKS_DIR.glob(f"{deployment}-*.json")]
    fresh = [m for m in marks if m["setup_start"] >= sent]
    return min(fresh, key=lambda m: m["setup_start"]) if fresh else None


@ember.deployment(
    name=EMBER_DEPLOYMENT,
    route="/mlp",
    warm_floor=0,
    max_replicas=2,
    scaledown_after_s=SCALEDOWN_S,
    num_cpus=REPLICA_CPUS,
)
class EmberMLP(SeedMLP):
    """The seed MLP as is, with this bench's deployment options; setup also leaves a mark."""

    def setup(self) -> None:
        started = time.time()
        super().setup()
        write_mark(EMBER_DEPLOYMENT, started)

    def __call__(self, body: MlpRequest) -> MlpResponse:
        return super().__call__(body)


plain_api = FastAPI()


def resolved_hints(fn: F) -> F:
    """Replace string annotations (``from __future__``) by the objects they name.

    Ray pickles this script's classes by value; the replica's copy of a method lacks this
    module's globals, so FastAPI could not resolve ``"MlpRequest"`` there and would take
    ``body`` for a query parameter (422 on every request).
    """
    fn.__annotations__ = typing.get_type_hints(fn)
    return fn


@serve.deployment
@serve.ingress(plain_api)
class PlainMLP:
    """The seed MLP behind a plain Ray Serve FastAPI ingress, same bodies and route."""

    def __init__(self) -> None:
        started = time.time()
        self.model = SeedMLP()
        self.model.setup()
        write_mark(serve.get_replica_context().deployment, started)

    @plain_api.post("/mlp")
    @resolved_hints
    def mlp(self, body: MlpRequest) -> MlpResponse:
        return self.model(body)


def plain_autoscaling(shrunk: bool) -> dict[str, Any]:
    """Autoscaling config of a plain peer; see the module docstring for the choices."""
    config: dict[str, Any] = {
        "min_replicas": 0,
        "max_replicas": 2,
        "initial_replicas": 0,
        "downscale_delay_s": SCALEDOWN_S,
        "downscale_to_zero_delay_s": SCALEDOWN_S,
    }
    if shrunk:
        config.update(upscale_delay_s=0.0, metrics_interval_s=0.1, look_back_period_s=0.2)
    return config


def deploy_all(port: int) -> str:
    """Start Ray through Ember, serve Ember at ``/`` and both peers beside it; base URL."""
    app = ember.App([EmberMLP], name=EMBER.app)
    base_url = ember.serve(app, port=port)
    for target, shrunk in ((PLAIN_DEFAULT, False), (PLAIN_SHRUNK, True)):
        bound = PlainMLP.options(
            name=target.deployment,
            autoscaling_config=plain_autoscaling(shrunk),
            ray_actor_options={"num_cpus": REPLICA_CPUS},
        ).bind()
        prefix = target.path.rsplit("/", 1)[0]
        serve.run(bound, name=target.app, route_prefix=prefix, blocking=False)
    return base_url


def replica_states(target: Target) -> dict[str, int]:
    """Replica count per state (``STARTING``, ``RUNNING``, ...) of ``target``'s deployment."""
    app = serve.status().applications.get(target.app)
    if app is None or target.deployment not in app.deployments:
        return {}
    return {str(k): int(v) for k, v in app.deployments[target.deployment].replica_states.items()}


def wait_all_at_zero(deadline: Deadline) -> float:
    """Block until no measured deployment has a replica in any state; seconds waited."""
    started = time.monotonic()
    while any(sum(replica_states(t).values()) for t in TARGETS):
        deadline.left()
        time.sleep(0.2)
    return time.monotonic() - started


class ScaleUpProbe(threading.Thread):
    """Records (wall clock) when ``serve.status()`` first shows a replica of ``target``.

    An upper bound: the controller answers slowly while a replica starts on 2 cores.
    The probe stops at the first sighting so that it does not load the controller after.
    """

    def __init__(self, target: Target) -> None:
        super().__init__(daemon=True)
        self.target = target
        self.seen_at: float | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                states = replica_states(self.target)
            except Exception:  # the controller is busy starting replicas; try again
                states = {}
            if sum(states.values()) > 0:
                self.seen_at = time.time()
                return
            self.stopped.wait(STATUS_POLL_S)


def post_mlp(client: httpx.Client, url: str, deadline: Deadline) -> list[list[float]]:
    """One POST; the outputs, or an error if the answer is not a 200 of the right shape."""
    reply = client.post(url, json=PAYLOAD, timeout=deadline.timeout())
    if reply.status_code != 200:
        raise RuntimeError(f"POST {url} -> {reply.status_code}: {reply.text[:300]}")
    outputs: list[list[float]] = reply.json()["outputs"]
    if len(outputs) != 1 or len(outputs[0]) != OUT_FEATURES:
        raise RuntimeError(f"POST {url}: unexpected outputs shape")
    return outputs


def cold_trial(target: Target, base_url: str, deadline: Deadline, out: Measurements) -> None:
    """From zero replicas everywhere, time one POST from send to 200."""
    wait_all_at_zero(deadline)
    probe = ScaleUpProbe(target)
    probe.start()
    with httpx.Client() as client:
        sent_wall, sent = time.time(), time.perf_counter()
        post_mlp(client, base_url + target.path, deadline)
        took = time.perf_counter() - sent
    probe.stopped.set()
    probe.join(timeout=5)
    mark = read_mark(target.deployment, sent_wall) or {}
    out.cold_s.append(took)
    out.cold_scale_up_seen_s.append(_since(probe.seen_at, sent_wall))
    out.cold_process_start_s.append(_since(mark.get("process_start"), sent_wall))
    out.cold_setup_start_s.append(_since(mark.get("setup_start"), sent_wall))
    out.cold_setup_done_s.append(_since(mark.get("setup_done"), sent_wall))
    print(f"  cold {target.label:<18} {took:7.3f}s", flush=True)


def _since(at: float | None, sent: float) -> float | None:
    # Not clamped: a negative process start means Ray reused a worker started earlier.
    return None if at is None else at - sent


def warm_run(target: Target, base_url: str, n: int, deadline: Deadline) -> list[float]:
    """Latencies in ms of ``n`` sequential requests after ``WARMUP_REQUESTS`` untimed ones.

    Starts from zero replicas everywhere, like a cold trial, so that no other deployment is
    scaling while this one is timed; the first warm-up request is therefore a cold start.
    """
    wait_all_at_zero(deadline)
    url = base_url + target.path
    latencies: list[float] = []
    with httpx.Client() as client:
        for _ in range(WARMUP_REQUESTS):
            post_mlp(client, url, deadline)
        for _ in range(n):
            sent = time.perf_counter()
            post_mlp(client, url, deadline)
            latencies.append((time.perf_counter() - sent) * 1000.0)
    return latencies


def check_same_model(base_url: str, deadline: Deadline) -> None:
    """All three servers must compute the same function (same weights, same class)."""
    with httpx.Client() as client:
        outs = [post_mlp(client, base_url + t.path, deadline)[0] for t in TARGETS]
    for target, row in zip(TARGETS[1:], outs[1:], strict=True):
        if max(abs(a - b) for a, b in zip(outs[0], row, strict=True)) > 1e-5:
            raise RuntimeError(f"{target.label} disagrees with Ember on the same input")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def median_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(results: dict[str, Measurements]) -> list[dict[str, Any]]:
    """Table rows: the metric (with its unit) and one value per target (None: not measured)."""
    picks: list[tuple[str, Any]] = [
        ("cold start, send -> 200, median [s]", lambda m: median_of(list(m.cold_s))),
        ("  replica seen in serve.status [s]", lambda m: median_of(m.cold_scale_up_seen_s)),
        ("  replica process started [s]", lambda m: median_of(m.cold_process_start_s)),
        ("  setup begins, imports done [s]", lambda m: median_of(m.cold_setup_start_s)),
        ("  setup done, weights loaded [s]", lambda m: median_of(m.cold_setup_done_s)),
        ("warm p50 [ms]", lambda m: percentile(m.warm_ms, 50) if m.warm_ms else None),
        ("warm p99 [ms]", lambda m: percentile(m.warm_ms, 99) if m.warm_ms else None),
    ]
    return [
        {"metric": name, "values": {t.label: pick(results[t.label]) for t in TARGETS}}
        for name, pick in picks
    ]


def ratio(peer: float | None, base: float | None) -> str:
    if peer is None or base is None or base <= 0:
        return "-"
    return f"{peer / base:.2f}x"


def print_table(table: list[dict[str, Any]]) -> None:
    labels = [t.label for t in TARGETS]
    header = ["metric", *labels, "ratio default/Ember", "ratio shrunk/Ember"]
    lines = [header]
    for row in table:
        vals = [row["values"][label] for label in labels]
        cells = ["-" if v is None else f"{v:.3f}" for v in vals]
        lines.append([row["metric"], *cells, ratio(vals[1], vals[0]), ratio(vals[2], vals[0])])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for i, line in enumerate(lines):
        print(" | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_bench(args: argparse.Namespace, deadline: Deadline, out: dict[str, Measurements]) -> str:
    """Deploy, then cold trials (interleaved by round), then warm runs; the base URL."""
    base_url = deploy_all(args.port or free_port())
    print(f"serving at {base_url}; waiting for zero replicas", flush=True)
    wait_all_at_zero(deadline)
    for trial in range(1, args.trials + 1):
        print(f"cold round {trial}/{args.trials}", flush=True)
        for target in TARGETS:
            cold_trial(target, base_url, deadline, out[target.label])
    check_same_model(base_url, deadline)
    for target in TARGETS:
        out[target.label].warm_ms = warm_run(target, base_url, args.warm_requests, deadline)
        print(f"  warm {target.label:<18} done", flush=True)
    return base_url


def write_json(args: argparse.Namespace, out: dict[str, Measurements], error: str | None) -> None:
    table = summarize(out)
    doc = {
        "benchmark": "core",
        "model": "seed MLP 256->512->16 (examples/mlp_app.py SeedMLP)",
        "complete": error is None,
        "error": error,
        "config": {
            "trials": args.trials,
            "warm_requests": args.warm_requests,
            "warmup_requests": WARMUP_REQUESTS,
            "scaledown_s": SCALEDOWN_S,
            "replica_num_cpus": REPLICA_CPUS,
            "plain_default_autoscaling": plain_autoscaling(False),
            "plain_shrunk_autoscaling": plain_autoscaling(True),
        },
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "summary": table,
        "raw": {label: asdict(m) for label, m in out.items()},
    }
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(doc, indent=2) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trials", type=int, default=3, help="cold starts per server")
    parser.add_argument("--warm-requests", type=int, default=200, help="timed warm requests")
    parser.add_argument("--deadline-s", type=float, default=900.0, help="global time budget")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.warm_requests < 1 or args.deadline_s <= 0:
        parser.error("--trials, --warm-requests and --deadline-s must be positive")
    return args


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise DeadlineExceeded("hard deadline: a call blocked past the global deadline")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The bench fixes its own scale-down timer; an operator override would skew it.
    os.environ.pop("EMBER_SCALEDOWN_AFTER_S", None)
    ensure_weights(weights_path())  # written once here, not inside the first cold start
    deadline = Deadline(args.deadline_s)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(int(args.deadline_s) + 60)  # backstop for a call that ignores timeouts
    out = {t.label: Measurements() for t in TARGETS}
    error: str | None = None
    try:
        run_bench(args, deadline, out)
    except (DeadlineExceeded, RuntimeError, httpx.HTTPError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        print(f"benchmark stopped early: {error}", file=sys.stderr)
    finally:
        signal.alarm(0)
        ember.shutdown()
        shutil.rmtree(MARKS_DIR, ignore_errors=True)
    print_table(summarize(out))
    write_json(args, out, error)
    print(f"wrote {RESULTS_PATH.relative_to(ROOT)}")
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
