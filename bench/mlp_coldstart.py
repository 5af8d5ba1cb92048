"""Cold start and warm latency of the seed MLP: Ember vs plain Ray Serve, in one run.

The same model (``SeedMLP`` from ``examples/mlp_app.py``: 256 -> 512 -> 16, weights loaded
from a safetensors file in ``setup``) is served three ways on one local Ray cluster:

* ``Ember``: the app's defaults (warm pool of 1) with ``warm_floor=0``,
  ``scaledown_after_s=2``, ``num_cpus=0.5`` (``POST /mlp``).
* ``Ray Serve default``: the same class behind a plain FastAPI ``@serve.ingress``
  deployment from zero with Ray's default up-path timers (``POST /plain/mlp``).
* ``Ray Serve shrunk``: the same with every timer at its fastest (``POST /shrunk/mlp``).

Cold start: once no measured deployment has a replica in any state, one POST is timed from
send to 200; rounds interleave the three servers, median reported. Where the time goes, in
seconds after the send: when ``serve.status()`` first shows a replica (polled, an upper
bound) and, from the replica's own marks, when its process started, its setup began
(imports done) and ended. Warm latency: p50/p99 of sequential requests (concurrency 1)
after ``WARMUP_REQUESTS`` untimed ones, each server from an idle cluster.

Usage:
    .venv/bin/python bench/mlp_coldstart.py [--short] [--trials 3] [--warm-requests 200]
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Before Ray starts: local workers inherit the directories on sys.path as PYTHONPATH.
sys.path.insert(0, str(ROOT / "examples"))

import _harness as h  # noqa: E402
import _serving  # noqa: E402
import httpx  # noqa: E402
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

WARMUP_REQUESTS = 20
PAYLOAD = {"inputs": [[((i * 37) % 101) / 101.0 for i in range(IN_FEATURES)]]}


@dataclass(frozen=True)
class Target:
    label: str
    app: str
    deployment: str
    path: str


EMBER = Target("Ember", "bench-ember", "mlp", "/mlp")
DEFAULT = Target("Ray Serve default", "plain-default", "PlainDefault", "/plain/mlp")
SHRUNK = Target("Ray Serve shrunk", "plain-shrunk", "PlainShrunk", "/shrunk/mlp")
TARGETS = (EMBER, DEFAULT, SHRUNK)


@dataclass
class Samples:
    cold_s: list[float] = field(default_factory=list)
    paths: list[str | None] = field(default_factory=list)  # Ember: pool, pool-warm or replica
    scale_up_seen_s: list[float | None] = field(default_factory=list)
    marks_s: list[dict[str, float]] = field(default_factory=list)
    warm_ms: list[float] = field(default_factory=list)


@ember.deployment(name=EMBER.deployment, route="/mlp", warm_floor=0, max_replicas=2,
                  scaledown_after_s=_serving.SCALEDOWN_S, num_cpus=_serving.REPLICA_CPUS)
class EmberMLP(SeedMLP):  # type: ignore[misc]  # examples/ is not type-checked
    """The seed MLP as is, with this bench's options; setup also leaves a mark."""

    def setup(self) -> None:
        started = time.time()
        super().setup()
        _serving.write_mark(EMBER.deployment, started)

    @_serving.resolved_hints
    def __call__(self, body: MlpRequest) -> MlpResponse:
        return super().__call__(body)


plain_api = FastAPI()


@serve.deployment
@serve.ingress(plain_api)
class PlainMLP:
    """The seed MLP behind a plain Ray Serve FastAPI ingress, same bodies and route."""

    def __init__(self) -> None:
        started = time.time()
        self.model = SeedMLP()
        self.model.setup()
        _serving.write_mark(serve.get_replica_context().deployment, started)

    @plain_api.post("/mlp")
    @_serving.resolved_hints
    def mlp(self, body: MlpRequest) -> MlpResponse:
        return self.model(body)


def deploy_all(port: int, deadline: h.Deadline) -> str:
    """Ember at ``/`` and both peers beside it; the base URL."""
    base_url = _serving.start_serve(port)
    _serving.deploy_ember(ember.App([EmberMLP], name=EMBER.app, warm_pool=1), deadline)
    for target, shrunk in ((DEFAULT, False), (SHRUNK, True)):
        bound = PlainMLP.options(  # type: ignore[attr-defined]  # a Serve Deployment
            name=target.deployment, autoscaling_config=_serving.plain_autoscaling(shrunk),
            ray_actor_options={"num_cpus": _serving.REPLICA_CPUS}).bind()
        _serving.deploy_plain(bound, target.app, target.path.rsplit("/", 1)[0])
    return base_url


def wait_all_at_zero(deadline: h.Deadline) -> None:
    h.wait_until(lambda: not any(_serving.replicas(t.app, t.deployment) for t in TARGETS),
                 "every deployment at zero", deadline)


class ScaleUpProbe(threading.Thread):
    """When ``serve.status()`` first shows a replica of ``target`` (wall clock); stops then."""

    def __init__(self, target: Target) -> None:
        super().__init__(daemon=True)
        self.target = target
        self.seen_at: float | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                seen = _serving.replicas(self.target.app, self.target.deployment) > 0
            except Exception:  # the controller is busy starting replicas; try again
                seen = False
            if seen:
                self.seen_at = time.time()
                return
            self.stopped.wait(0.05)


def url_of(target: Target, base_url: str) -> str:
    """Ember on its edges at ``base_url``; the plain peers behind Serve's proxy."""
    return (base_url if target is EMBER else _serving.plain_url()) + target.path


def post_mlp(client: httpx.Client, url: str, deadline: h.Deadline) -> httpx.Response:
    """One POST; the reply, or an error unless it is a 200 of the right shape."""
    reply = client.post(url, json=PAYLOAD, timeout=deadline.timeout())
    if reply.status_code != 200:
        raise RuntimeError(f"POST {url} -> {reply.status_code}: {reply.text[:300]}")
    outputs: list[list[float]] = reply.json()["outputs"]
    if len(outputs) != 1 or len(outputs[0]) != OUT_FEATURES:
        raise RuntimeError(f"POST {url}: unexpected outputs shape")
    return reply


def cold_trial(target: Target, base_url: str, deadline: h.Deadline, out: Samples) -> None:
    wait_all_at_zero(deadline)
    probe = ScaleUpProbe(target)
    probe.start()
    with httpx.Client() as client:
        sent_wall, sent = time.time(), time.perf_counter()
        reply = post_mlp(client, url_of(target, base_url), deadline)
        took = time.perf_counter() - sent
    probe.stopped.set()
    probe.join(timeout=5)
    path, _ = _serving.cold_header(reply)
    out.cold_s.append(took)
    out.paths.append(path)
    out.scale_up_seen_s.append(None if probe.seen_at is None else probe.seen_at - sent_wall)
    out.marks_s.append(_serving.marks_since(target.deployment, sent_wall))
    print(f"  cold {target.label:<18} {took:7.3f}s  path={path}", flush=True)
    if path in ("pool", "pool-warm"):  # let the own replica it woke start, then scale down
        _serving.wait_woken(target.app, target.deployment, deadline)


def warm_run(target: Target, base_url: str, n: int, deadline: h.Deadline) -> list[float]:
    """Milliseconds of ``n`` sequential requests after the untimed warm-up (from zero)."""
    wait_all_at_zero(deadline)
    url, latencies = url_of(target, base_url), []
    with httpx.Client() as client:
        for _ in range(WARMUP_REQUESTS):
            post_mlp(client, url, deadline)
        for _ in range(n):
            sent = time.perf_counter()
            post_mlp(client, url, deadline)
            latencies.append((time.perf_counter() - sent) * 1000.0)
    return latencies


def check_same_model(base_url: str, deadline: h.Deadline) -> float:
    """Max abs difference of the peers' outputs from Ember's on the same input."""
    with httpx.Client() as client:
        rows = [post_mlp(client, url_of(t, base_url), deadline).json()["outputs"][0]
                for t in TARGETS]
    diff = float(max(abs(a - b) for row in rows[1:]
                     for a, b in zip(rows[0], row, strict=True)))
    if diff > 1e-5:
        raise RuntimeError(f"the servers disagree on the same input (max abs diff {diff})")
    return diff


def summary(out: dict[str, Samples]) -> list[dict[str, Any]]:
    """Rows: metric and one value per target."""
    def mark(key: str) -> Any:
        return lambda s: h.median_or_none([m.get(key) for m in s.marks_s])

    picks: list[tuple[str, Any]] = [
        ("cold start, send -> 200, median [s]", lambda s: h.median_or_none(s.cold_s)),
        ("  replica seen in serve.status [s]", lambda s: h.median_or_none(s.scale_up_seen_s)),
        ("  replica process started [s]", mark("process_start")),
        ("  setup begins, imports done [s]", mark("init_start")),
        ("  setup done, weights loaded [s]", mark("setup_done")),
        ("warm p50 [ms]", lambda s: h.p50_p99(s.warm_ms)["p50"]),
        ("warm p99 [ms]", lambda s: h.p50_p99(s.warm_ms)["p99"]),
    ]
    return [{"metric": name, "values": {t.label: pick(out[t.label]) for t in TARGETS}}
            for name, pick in picks]


def print_summary(rows: list[dict[str, Any]]) -> None:
    labels = [t.label for t in TARGETS]
    lines = [["metric", *labels, "default / Ember", "shrunk / Ember"]]
    for row in rows:
        v = [row["values"][label] for label in labels]
        phase = row["metric"].startswith(" ")  # Ember's phase marks may come from the pool
        lines.append([row["metric"], *(h.fmt(x) for x in v),
                      "" if phase else h.fmt_ratio(v[1], v[0]),
                      "" if phase else h.fmt_ratio(v[2], v[0])])
    h.print_table(lines)


def run(args: Any, deadline: h.Deadline, out: dict[str, Samples], doc: dict[str, Any]) -> None:
    base_url = deploy_all(args.port or h.free_port(), deadline)
    print(f"serving at {base_url}; waiting for zero replicas", flush=True)
    for trial in range(1, args.trials + 1):
        print(f"cold round {trial}/{args.trials}", flush=True)
        for target in TARGETS:
            cold_trial(target, base_url, deadline, out[target.label])
    doc["same_model_max_abs_diff"] = check_same_model(base_url, deadline)
    for target in TARGETS:
        out[target.label].warm_ms = warm_run(target, base_url, args.warm_requests, deadline)
        print(f"  warm {target.label:<18} done", flush=True)


def main() -> int:
    parser = h.parser(__doc__, deadline_s=900)
    parser.add_argument("--trials", type=int, help="cold starts per server (3; short 1)")
    parser.add_argument("--warm-requests", type=int, help="timed warm requests (200; short 50)")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    args = h.pick(parser.parse_args(), trials=(3, 1), warm_requests=(200, 50))
    _serving.clear_overrides()
    ensure_weights(weights_path())  # written once here, not inside the first cold start
    out = {t.label: Samples() for t in TARGETS}
    doc: dict[str, Any] = {"model": "seed MLP 256->512->16 (examples/mlp_app.py SeedMLP)"}
    errors: list[str] = []
    with h.deadline_run(args.deadline_s, errors, _serving.shutdown) as deadline:
        h.section("run", errors, lambda: run(args, deadline, out, doc))
    rows = summary(out)
    print_summary(rows)
    doc.update(complete=not errors, errors=errors, summary=rows,
               config={"trials": args.trials, "warm_requests": args.warm_requests,
                       "warmup_requests": WARMUP_REQUESTS, "ember_warm_pool": 1,
                       "scaledown_s": _serving.SCALEDOWN_S,
                       "replica_num_cpus": _serving.REPLICA_CPUS,
                       "plain_default_autoscaling": _serving.plain_autoscaling(False),
                       "plain_shrunk_autoscaling": _serving.plain_autoscaling(True)},
               raw={label: asdict(s) for label, s in out.items()})
    h.write_results("mlp_coldstart", doc, short=args.short)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
