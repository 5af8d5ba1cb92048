"""Cold start of the MiniLM embeddings flagship: Ember three ways vs plain Ray Serve, one run.

The model is ``MiniLM`` from ``ember.deployments.embeddings`` (all-MiniLM-L6-v2, weights
memory-mapped from the node cache, ``warmup()`` before ready). Every variant runs the same
class; the Ember ones are subclasses that copy the shipped ``@ember.deployment`` options and
change only what is named below, plus ``num_cpus=0.5`` and ``scaledown_after_s=2`` (so that a
2-core node can hold them and they return to zero between trials):

* (a) ``Ember pool+preload``: the flagship as shipped: warm pool of 1, ``preload=True``.
* (b) ``Ember pool, lazy``: warm pool of 1, ``preload=False``; the pool constructs the model
  on the first request. The pool keeps what it constructed, so the app is deployed afresh
  before every trial; each trial is a first request to a fresh pool (and a fresh ingress).
* (c) ``Ember no pool``: ``warm_pool=0``; the deployment's own replica starts (Ember's
  queue-depth policy path).
* (d) ``Ray Serve default``: the same class behind a plain ``@serve.ingress`` FastAPI
  deployment (``POST /plain/embed``), ``min_replicas=0`` and Ray's default timers. One
  deliberate change: Ray's default ``downscale_delay_s`` is 600 s, so only
  ``downscale_delay_s`` and ``downscale_to_zero_delay_s`` are set to 2 s (the down path,
  which is not measured); ``upscale_delay_s``, ``metrics_interval_s`` and
  ``look_back_period_s`` keep their defaults, because the up path is what is measured.
* (e) ``Ray Serve shrunk``: (d) with every timer at its fastest (``upscale_delay_s=0``,
  ``metrics_interval_s=0.1``, ``look_back_period_s=0.2``; ``POST /shrunk/embed``).

The Ember variants own route prefix ``/`` one at a time (each app is deleted before the
next is deployed); (d) and (e) stay deployed at ``/plain`` and ``/shrunk`` throughout, idle
at zero replicas, and are measured last, interleaved by round, with no Ember app deployed.
Every app and the Serve controller/proxy log at WARNING without access logs, alike.

Cold start: once the measured deployment has no replica in any state (``serve.status()``)
and, for Ember, its ingress also sees none (``GET /-/status``), wait ``QUIET_S`` and time one
``POST /embed`` with one text from send to 200; ``--trials`` rounds, median reported. For
Ember the ``X-Ember-Cold-Start`` phases are recorded; for plain Ray Serve the replica writes
when its process started, when its constructor began (imports done) and when
setup+warmup ended. After a request served by the pool, the deployment's own replica (which
the request woke) is let start and scale back to zero before the next trial.

Burst: ``BURST`` concurrent requests at zero for (a) and (c); all must be 200.

Memory: an Ember variant with ``warm_floor=2`` (no pool) runs two replicas on this node.
For the later-started replica ("replica 2") psutil reports whole-process RSS, PSS and USS,
and, from its memory maps, the weights file's mapping: resident, proportional, private
(resident in this process only; USS's share) and anonymous (copied-on-write) bytes. The
pass/fail figure is that mapping's private + anonymous bytes against the file's size:
clean file-backed pages are the node's page cache, shared by every replica, whereas
whole-process USS is mostly the Python + torch runtime every replica has whatever the
weights. For contrast the same is measured for a variant whose ``setup`` copies the weights
into a normally built model (``safetensors.torch.load_file`` + ``load_state_dict``).

Everything is bounded by ``--deadline-s``. Output: a table on stdout and
``bench/results/coldstart.json``. Absolute numbers on a shared 2-core machine are noisy.

Usage:
    .venv/bin/python bench/coldstart_bench.py [--trials 5] [--deadline-s 1200]
"""

from __future__ import annotations

import argparse
import asyncio
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
import time
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, TypeVar

import httpx
import psutil
import torch
from fastapi import Body, FastAPI
from ray import serve
from ray.serve.config import HTTPOptions
from safetensors.torch import load_file

import ember
from ember import loaders
from ember.deployments._minilm import (
    MiniLMConfig,
    MiniLMEncoder,
    Tokenizer,
    build_model,
    find_model_files,
)
from ember.deployments.embeddings import DIMENSIONS, Embedding, MiniLM, weights_url
from ember.platform.control.pool import POOL_DEPLOYMENT
from ember.platform.decorator import get_spec
from ember.platform.runtime import build_application, start_ray

ROOT = Path(__file__).resolve().parents[1]
RESULTS_PATH = ROOT / "bench" / "results" / "coldstart.json"
HOST = "127.0.0.1"
SCALEDOWN_S = 2.0
REPLICA_CPUS = 0.5
BURST = 32
QUIET_S = 1.0  # idle time at zero before each cold request
POOL_SEEN_S = 1.5  # the ingress polls replica states every 0.5 s
WAKE_SEEN_S = 15.0  # at most this long for the replica a pool-served request woke to show
TEXT = "Ember measures how long a sentence embedding takes from zero replicas."
LOGGING = {"log_level": "WARNING", "enable_access_log": False}
# Plain replicas write when they started here; pickled by value, so they see this path.
MARKS_DIR = Path(tempfile.gettempdir()) / f"coldstart-bench-marks-{os.getpid()}"
OVERRIDES = ("EMBER_SCALEDOWN_AFTER_S", "EMBER_WARM_POOL", "EMBER_API_KEYS",
             "EMBER_API_KEYS_FILE", "EMBER_RATE_LIMIT_RPS", "EMBER_RATE_LIMIT_BURST")
PHASES = ("queue", "start", "import", "weights", "warmup")
MARKS = ("process_start", "init_start", "setup_done")
F = TypeVar("F", bound=Callable[..., Any])


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


# --- the model, served every way ------------------------------------------------------------


def resolved_hints(fn: F) -> F:
    """Replace string annotations (``from __future__``) by the objects they name.

    Ray pickles this script's classes by value. Unpickling one in this process (Serve does)
    puts copies of its methods, whose globals hold only the names their code uses, onto the
    original class; string annotations could then no longer be resolved, neither by a later
    variant's decorator here nor by FastAPI in a replica.
    """
    fn.__annotations__ = typing.get_type_hints(fn, include_extras=True)
    return fn


class _Served(MiniLM):
    """The flagship class; a variant's ``__call__`` must be its own to be served."""

    @resolved_hints
    def __call__(self, texts: list[str]) -> list[Embedding]:
        return super().__call__(texts)


class _CopyLoaded(_Served):
    """Weights copied into a normally built model, as ``torch.load`` users do."""

    def setup(self) -> None:
        files = find_model_files()
        config = MiniLMConfig.from_file(files.config)
        mapped = build_model(load_file(str(files.weights), device="cpu"), config)
        model = MiniLMEncoder(config)  # allocated and initialised on the CPU heap
        model.load_state_dict(mapped.state_dict())  # copies; the mapping is dropped after
        self.device = torch.device("cpu")
        self.model = model.requires_grad_(False).eval()
        self.tokenizer = Tokenizer(files.tokenizer)


@resolved_hints
def _report_pid(self: Any) -> dict[str, int]:
    return {"pid": os.getpid()}


def ember_variant(name: str, *, base: type = _Served, pid_route: bool = False,
                  **overrides: Any) -> type:
    """A copy of ``MiniLM`` under ``name`` with the shipped options, bench timers and
    ``overrides``."""
    shipped = get_spec(MiniLM).options
    options = {key: getattr(shipped, key) for key in type(shipped).model_fields}
    options.update(name=name, num_cpus=REPLICA_CPUS, scaledown_after_s=SCALEDOWN_S)
    options.update(overrides)
    members: dict[str, Any] = {"__call__": base.__call__, "__module__": __name__}
    if pid_route:
        members["pid"] = ember.route("/pid", method="GET")(_report_pid)
    return ember.deployment(**options)(type(name, (base,), members))


@dataclass(frozen=True)
class EmberVariant:
    label: str
    key: str
    app: str
    deployment: str
    warm_pool: int
    preload: bool
    redeploy_each_trial: bool = False

    def build(self) -> ember.App:
        cls = ember_variant(self.deployment, preload=self.preload)
        return ember.App([cls], name=self.app, warm_pool=self.warm_pool)


@dataclass(frozen=True)
class PlainVariant:
    label: str
    key: str
    app: str
    deployment: str
    prefix: str
    shrunk: bool


POOL_PRELOAD = EmberVariant("Ember pool+preload", "a", "cs-pool-preload", "MiniLMPreload", 1,
                            True)
POOL_LAZY = EmberVariant("Ember pool, lazy", "b", "cs-pool-lazy", "MiniLMLazy", 1, False,
                         redeploy_each_trial=True)
NO_POOL = EmberVariant("Ember no pool", "c", "cs-no-pool", "MiniLMNoPool", 0, True)
PLAIN_DEFAULT = PlainVariant("Ray Serve default", "d", "cs-plain", "PlainDefault", "/plain",
                             False)
PLAIN_SHRUNK = PlainVariant("Ray Serve shrunk", "e", "cs-shrunk", "PlainShrunk", "/shrunk",
                            True)
EMBER_VARIANTS = (POOL_PRELOAD, POOL_LAZY, NO_POOL)
PLAIN_VARIANTS = (PLAIN_DEFAULT, PLAIN_SHRUNK)
LABELS = {v.key: v.label for v in (*EMBER_VARIANTS, *PLAIN_VARIANTS)}


def write_mark(deployment: str, init_start: float) -> None:
    """In a plain replica: when its process started, its constructor began and ended."""
    mark = {"process_start": psutil.Process().create_time(), "init_start": init_start,
            "setup_done": time.time()}
    MARKS_DIR.mkdir(parents=True, exist_ok=True)
    (MARKS_DIR / f"{deployment}-{os.getpid()}.json").write_text(json.dumps(mark))


def read_mark(deployment: str, sent: float) -> dict[str, float]:
    """The mark of the replica of ``deployment`` whose constructor began after ``sent``."""
    marks = [json.loads(p.read_text()) for p in MARKS_DIR.glob(f"{deployment}-*.json")]
    fresh = [m for m in marks if m["init_start"] >= sent]
    return min(fresh, key=lambda m: m["init_start"]) if fresh else {}


plain_api = FastAPI()


@serve.deployment
@serve.ingress(plain_api)
class PlainMiniLM:
    """The same class behind a plain Ray Serve FastAPI ingress: setup and warmup in
    ``__init__``, as Ember runs them before the replica reports ready."""

    def __init__(self) -> None:
        started = time.time()
        self.model = MiniLM()
        self.model.setup()
        self.model.warmup()
        write_mark(serve.get_replica_context().deployment, started)

    @plain_api.post("/embed")
    @resolved_hints
    def embed(self, texts: Annotated[list[str], Body()]) -> list[Embedding]:
        return self.model(texts)


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


# --- measurements ---------------------------------------------------------------------------


@dataclass
class Sample:
    """One cold request: client time, and where the time went (seconds)."""

    total_s: float
    path: str | None = None  # Ember: pool or replica
    phases_s: dict[str, float] = field(default_factory=dict)  # Ember header, with "total"
    marks_s: dict[str, float] = field(default_factory=dict)  # plain: after the send


@dataclass
class Burst:
    n: int
    statuses: list[int] = field(default_factory=list)  # 0: no answer
    latencies_s: list[float] = field(default_factory=list)
    paths: dict[str, int] = field(default_factory=dict)

    @property
    def non_200(self) -> int:
        return sum(1 for s in self.statuses if s != 200)


@dataclass
class Results:
    cold: dict[str, list[Sample]] = field(default_factory=dict)
    bursts: dict[str, Burst] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    vectors: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


# --- cluster state --------------------------------------------------------------------------


def replica_states(app: str, deployment: str) -> dict[str, int]:
    """Replica count per state of ``deployment`` in ``app`` (empty if it does not exist)."""
    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return {}
    states = status.deployments[deployment].replica_states
    return {str(getattr(k, "value", k)): int(v) for k, v in states.items()}


def app_status(app: str) -> str | None:
    status = serve.status().applications.get(app)
    return None if status is None else str(getattr(status.status, "value", status.status))


def wait_for(check: Callable[[], bool], what: str, deadline: Deadline,
             cap_s: float = 300.0, poll_s: float = 0.2) -> float:
    """Poll ``check`` until true; seconds waited. Raises on timeout."""
    started = time.monotonic()
    limit = deadline.timeout(cap_s)
    while not check():
        if time.monotonic() - started > limit:
            deadline.left()
            raise RuntimeError(f"timed out after {limit:.0f}s waiting for {what}")
        time.sleep(poll_s)
    return time.monotonic() - started


def ingress_view(base_url: str, deployment: str) -> int | None:
    """Running + starting replicas of ``deployment`` as the Ember ingress sees them (None:
    no answer)."""
    try:
        reply = httpx.get(f"{base_url}/-/status", timeout=5)
        reply.raise_for_status()
        loads = reply.json()["deployments"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    for load in loads:
        if load["deployment"] == deployment:
            return int(load["replicas_running"]) + int(load["replicas_starting"])
    return None


def deploy_ember(app: ember.App, deadline: Deadline) -> None:
    """``ember.serve`` of ``app`` at ``/`` (Serve already started), with the bench's logging."""
    serve.run(build_application(app), name=app.name, route_prefix="/", blocking=False,
              logging_config=LOGGING)
    wait_for(lambda: app_status(app.name) == "RUNNING", f"{app.name} running", deadline)
    if app.warm_pool:
        wait_for(lambda: replica_states(app.name, POOL_DEPLOYMENT).get("RUNNING", 0) >= 1,
                 "the warm pool", deadline)
        time.sleep(POOL_SEEN_S)


def wait_ember_zero(v: EmberVariant, base_url: str, deadline: Deadline) -> None:
    wait_for(lambda: sum(replica_states(v.app, v.deployment).values()) == 0
             and not any(sum(replica_states(p.app, p.deployment).values())
                         for p in PLAIN_VARIANTS),
             f"{v.deployment} at zero", deadline)
    wait_for(lambda: ingress_view(base_url, v.deployment) == 0,
             f"the ingress to see {v.deployment} at zero", deadline)
    time.sleep(QUIET_S)


def wait_plain_zero(deadline: Deadline) -> None:
    wait_for(lambda: not any(sum(replica_states(p.app, p.deployment).values())
                             for p in PLAIN_VARIANTS), "plain deployments at zero", deadline)
    time.sleep(QUIET_S)


def wait_woken(v: EmberVariant, deadline: Deadline) -> None:
    """After a pool-served request: let the own replica it woke show up (it then scales down
    before the next trial, which waits for zero)."""
    try:
        wait_for(lambda: sum(replica_states(v.app, v.deployment).values()) > 0,
                 f"{v.deployment}'s own replica", deadline, cap_s=WAKE_SEEN_S)
    except RuntimeError:
        print(f"  note: no own replica of {v.deployment} seen after a pool answer", flush=True)


# --- requests -------------------------------------------------------------------------------


def parse_cold_header(value: str | None) -> tuple[str | None, dict[str, float]]:
    """``X-Ember-Cold-Start`` -> (path, phases in seconds, with ``total``)."""
    if not value:
        return None, {}
    parts = dict(part.split("=", 1) for part in value.split(";") if "=" in part)
    path = parts.pop("path", None)
    return path, {k: float(v) / 1000.0 for k, v in parts.items()}


def check_reply(reply: httpx.Response, url: str) -> list[float]:
    """The embedding of a 200 with one item, or an error naming what came back."""
    if reply.status_code != 200:
        raise RuntimeError(f"POST {url} -> {reply.status_code}: {reply.text[:300]}")
    items = reply.json()
    if len(items) != 1 or len(items[0]["embedding"]) != DIMENSIONS:
        raise RuntimeError(f"POST {url}: unexpected reply shape")
    vector: list[float] = items[0]["embedding"]
    return vector


def cold_request(url: str, deadline: Deadline) -> tuple[Sample, list[float], float]:
    """One timed POST; the sample (with Ember's header phases), the vector, send wall time."""
    with httpx.Client() as client:
        sent_wall, sent = time.time(), time.perf_counter()
        reply = client.post(url, json=[TEXT], timeout=deadline.timeout())
        took = time.perf_counter() - sent
    vector = check_reply(reply, url)
    path, phases = parse_cold_header(reply.headers.get("x-ember-cold-start"))
    return Sample(took, path, phases), vector, sent_wall


def burst(url: str, n: int, deadline: Deadline) -> Burst:
    """``n`` concurrent POSTs, each timed from its send; no answer counts as status 0."""
    timeout = deadline.timeout()

    async def run() -> Burst:
        out = Burst(n)
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

            async def one(i: int) -> tuple[int, float, str | None]:
                sent = time.perf_counter()
                try:
                    reply = await client.post(url, json=[f"{TEXT} ({i})"])
                except httpx.HTTPError:
                    return 0, time.perf_counter() - sent, None
                path, _ = parse_cold_header(reply.headers.get("x-ember-cold-start"))
                return reply.status_code, time.perf_counter() - sent, path

            for status, took, path in await asyncio.gather(*(one(i) for i in range(n))):
                out.statuses.append(status)
                out.latencies_s.append(took)
                key = path or "warm"
                out.paths[key] = out.paths.get(key, 0) + 1
        return out

    return asyncio.run(run())


# --- the runs -------------------------------------------------------------------------------


def ember_trial(v: EmberVariant, base_url: str, deadline: Deadline, res: Results) -> None:
    wait_ember_zero(v, base_url, deadline)
    sample, vector, _ = cold_request(base_url + "/embed", deadline)
    res.cold.setdefault(v.key, []).append(sample)
    res.vectors.setdefault(v.key, vector)
    phases = " ".join(f"{k}={sample.phases_s.get(k, 0.0) * 1000:.0f}" for k in PHASES)
    print(f"  cold ({v.key}) {v.label:<20} {sample.total_s:7.3f}s  path={sample.path} "
          f"{phases} [ms]", flush=True)
    if sample.path == "pool":
        wait_woken(v, deadline)


def ember_burst(v: EmberVariant, base_url: str, deadline: Deadline, res: Results) -> None:
    wait_ember_zero(v, base_url, deadline)
    out = burst(base_url + "/embed", BURST, deadline)
    res.bursts[v.key] = out
    print(f"  burst ({v.key}) {v.label:<19} non-200={out.non_200} "
          f"p50={percentile(out.latencies_s, 50):.3f}s max={max(out.latencies_s):.3f}s "
          f"paths={out.paths}", flush=True)


def run_ember(v: EmberVariant, base_url: str, trials: int, deadline: Deadline,
              res: Results) -> None:
    """All trials (and, for (a) and (c), the burst) of one Ember variant."""
    print(f"Ember ({v.key}) {v.label}: deploying {v.app}", flush=True)
    app = v.build()
    try:
        deploy_ember(app, deadline)
        for trial in range(trials):
            if v.redeploy_each_trial and trial:
                serve.delete(app.name)
                deploy_ember(app, deadline)
            ember_trial(v, base_url, deadline, res)
        if v in (POOL_PRELOAD, NO_POOL):
            ember_burst(v, base_url, deadline, res)
    finally:
        serve.delete(app.name)


def run_plain(base_url: str, trials: int, deadline: Deadline, res: Results) -> None:
    """Cold trials of (d) and (e), interleaved by round."""
    for trial in range(1, trials + 1):
        print(f"plain round {trial}/{trials}", flush=True)
        for v in PLAIN_VARIANTS:
            wait_plain_zero(deadline)
            url = f"{base_url}{v.prefix}/embed"
            sample, vector, sent_wall = cold_request(url, deadline)
            mark = read_mark(v.deployment, sent_wall)
            sample.marks_s = {k: mark[k] - sent_wall for k in MARKS if k in mark}
            res.cold.setdefault(v.key, []).append(sample)
            res.vectors.setdefault(v.key, vector)
            marks = " ".join(f"{k}={val:.2f}" for k, val in sample.marks_s.items())
            print(f"  cold ({v.key}) {v.label:<20} {sample.total_s:7.3f}s  {marks} [s]",
                  flush=True)


def replica_pids(base_url: str, app: str, deadline: Deadline) -> list[int]:
    """PIDs of the two replicas, from ``GET /pid`` (the router spreads requests over both)."""
    seen: set[int] = set()
    with httpx.Client() as client:
        for _ in range(60):
            reply = client.get(f"{base_url}/pid", timeout=deadline.timeout(30))
            if reply.status_code == 200:
                seen.add(int(reply.json()["pid"]))
            if len(seen) >= 2:
                break
    if len(seen) < 2:
        raise RuntimeError(f"{app}: found replica PIDs {sorted(seen)}, expected two")
    return sorted(seen, key=lambda pid: psutil.Process(pid).create_time())


def process_memory(pid: int, blob: str) -> dict[str, Any]:
    """Whole-process RSS/PSS/USS and the weights file mapping's share, in bytes."""
    proc = psutil.Process(pid)
    full = proc.memory_full_info()
    mapping = {"rss": 0, "pss": 0, "private": 0, "anonymous": 0}
    for region in proc.memory_maps(grouped=True):
        if region.path and os.path.realpath(region.path) == blob:
            mapping["rss"] += region.rss
            mapping["pss"] += region.pss
            mapping["private"] += region.private_clean + region.private_dirty
            mapping["anonymous"] += region.anonymous
    return {"pid": pid, "rss": full.rss, "pss": full.pss, "uss": full.uss,
            "weights_mapping": mapping}


def other_mappers(blob: str, ours: set[int]) -> int:
    """Processes outside this measurement that map the weights file too (they make pages
    look shared); reported so that the figure can be read."""
    count = 0
    for proc in psutil.process_iter():
        if proc.pid in ours:
            continue
        try:
            if blob in Path(f"/proc/{proc.pid}/maps").read_text():
                count += 1
        except OSError:
            continue
    return count


def measure_memory(base_url: str, blob: str, deadline: Deadline, res: Results) -> None:
    """Two replicas on this node: mapped weights (Ember) vs copied weights."""
    for key, base in (("ember", _Served), ("copy", _CopyLoaded)):
        name = {"ember": "MiniLMMem", "copy": "MiniLMCopy"}[key]
        cls = ember_variant(name, base=base, pid_route=True, warm_floor=2, max_replicas=2)
        app = ember.App([cls], name=f"cs-mem-{key}", warm_pool=0)
        print(f"memory: {name} with two replicas", flush=True)
        try:
            deploy_ember(app, deadline)
            wait_for(lambda a=app.name, n=name: replica_states(a, n).get("RUNNING", 0) == 2,
                     f"two {name} replicas", deadline)
            pids = replica_pids(base_url, app.name, deadline)
            time.sleep(1.0)  # let the replicas settle after answering
            replicas = [process_memory(pid, blob) for pid in pids]
            res.memory[key] = {"replicas": replicas,
                               "other_processes_mapping_weights": other_mappers(blob, set(pids))}
            second = replicas[-1]
            print(f"  replica 2 pid {second['pid']}: uss={mb(second['uss'])} "
                  f"pss={mb(second['pss'])} rss={mb(second['rss'])} MB; weights mapping "
                  f"{ {k: mb(v) for k, v in second['weights_mapping'].items()} } MB; other "
                  f"processes mapping the weights: "
                  f"{res.memory[key]['other_processes_mapping_weights']}", flush=True)
        finally:
            serve.delete(app.name)


# --- reporting ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def mb(n: float) -> float:
    return round(n / 1e6, 1)


def cold_median(res: Results, key: str) -> float | None:
    return median_or_none([s.total_s for s in res.cold.get(key, [])])


def ratio(peer: float | None, base: float | None) -> float | None:
    return None if peer is None or base is None or base <= 0 else peer / base


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("pass" if ok else "FAIL")


def summarize(res: Results, weight_bytes: int) -> list[dict[str, Any]]:
    """Rows: metric, value (text), target, pass/fail."""
    rows: list[dict[str, Any]] = []

    def add(metric: str, value: float | None, fmt: str, target: str = "-",
            ok: bool | None = None) -> None:
        text = "-" if value is None else format(value, fmt)
        rows.append({"metric": metric, "value": value, "shown": text, "target": target,
                     "result": verdict(None if value is None else ok)})

    a = cold_median(res, "a")
    for key in ("a", "b", "c", "d", "e"):
        value = cold_median(res, key)
        target, ok = ("< 0.5 s", value is not None and value < 0.5) if key == "a" else ("-", None)
        add(f"cold start ({key}) {LABELS[key]}, median [s]", value, ".3f", target, ok)
    d, e = cold_median(res, "d"), cold_median(res, "e")
    r = ratio(d, a)
    add("ratio Ray default (d) / Ember (a)", r, ".1f", ">= 20", r is not None and r >= 20)
    r = ratio(e, a)
    add("ratio Ray shrunk (e) / Ember (a)", r, ".1f", ">= 5", r is not None and r >= 5)
    for key in ("b", "c"):
        add(f"ratio Ray default (d) / Ember ({key})", ratio(d, cold_median(res, key)), ".1f")
        add(f"ratio Ray shrunk (e) / Ember ({key})", ratio(e, cold_median(res, key)), ".1f")
    for key in ("a", "c"):
        b = res.bursts.get(key)
        add(f"burst {BURST} at zero ({key}): non-200", None if b is None else b.non_200, "d",
            "0", b is not None and b.non_200 == 0)
        add(f"burst {BURST} at zero ({key}): p50 [s]",
            None if b is None else percentile(b.latencies_s, 50), ".3f")
        add(f"burst {BURST} at zero ({key}): max [s]",
            None if b is None else max(b.latencies_s), ".3f")
    ember_mem, copy_mem = res.memory.get("ember"), res.memory.get("copy")
    if ember_mem is not None:
        second = ember_mem["replicas"][-1]
        mapping = second["weights_mapping"]
        added = mapping["private"] + mapping["anonymous"]
        share = 100.0 * added / weight_bytes
        add("replica 2 weights private+anon / weight bytes [%]", share, ".2f", "< 10%",
            share < 10.0)
        add("replica 2 weights mapping resident (shared) [MB]", mb(mapping["rss"]), ".1f")
        add("replica 2 whole-process USS [MB]", mb(second["uss"]), ".1f")
        add("replica 2 whole-process PSS [MB]", mb(second["pss"]), ".1f")
        add("replica 2 whole-process RSS [MB]", mb(second["rss"]), ".1f")
    if copy_mem is not None:
        add("copy-loading replica 2 whole-process USS [MB]",
            mb(copy_mem["replicas"][-1]["uss"]), ".1f")
        if ember_mem is not None:
            saved = copy_mem["replicas"][-1]["uss"] - ember_mem["replicas"][-1]["uss"]
            add("USS copy-loading - USS Ember, replica 2 [% of weights]",
                100.0 * saved / weight_bytes, ".1f")
    add("weights file [MB]", mb(weight_bytes), ".1f")
    return rows


def phase_table(res: Results) -> dict[str, dict[str, float | None]]:
    """Median seconds per phase: Ember's header phases, plain replicas' marks."""
    table: dict[str, dict[str, float | None]] = {}
    for key in ("a", "b", "c"):
        samples = res.cold.get(key, [])
        row = {p: median_or_none([s.phases_s.get(p, 0.0) for s in samples])
               for p in (*PHASES, "total")}
        row["client"] = median_or_none([s.total_s for s in samples])
        table[key] = row
    for key in ("d", "e"):
        samples = res.cold.get(key, [])
        row = {m: median_or_none([s.marks_s[m] for s in samples if m in s.marks_s])
               for m in MARKS}
        row["client"] = median_or_none([s.total_s for s in samples])
        table[key] = row
    return table


def print_rows(lines: list[list[str]]) -> None:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for i, line in enumerate(lines):
        print(" | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def print_report(rows: list[dict[str, Any]], phases: dict[str, dict[str, float | None]],
                 res: Results) -> None:
    print()
    print_rows([["metric", "value", "target", "pass/fail"],
                *[[r["metric"], r["shown"], r["target"], r["result"]] for r in rows]])
    print()
    print("Where the cold start goes, medians in seconds. Ember (X-Ember-Cold-Start, from "
          "the ingress's arrival):")
    lines = [["variant", *PHASES, "ingress total", "client total", "paths"]]
    for key in ("a", "b", "c"):
        row = phases[key]
        paths: dict[str, int] = {}
        for s in res.cold.get(key, []):
            paths[str(s.path)] = paths.get(str(s.path), 0) + 1
        lines.append([f"({key}) {LABELS[key]}", *[fmt_s(row[p]) for p in PHASES],
                      fmt_s(row["total"]), fmt_s(row["client"]), str(paths)])
    print_rows(lines)
    print()
    print("Plain Ray Serve (replica marks, seconds after the send; a negative process start "
          "means Ray reused an idle worker):")
    lines = [["variant", "process started", "init began (imports done)",
              "setup+warmup done", "client total"]]
    for key in ("d", "e"):
        row = phases[key]
        lines.append([f"({key}) {LABELS[key]}", *[fmt_s(row[m]) for m in MARKS],
                      fmt_s(row["client"])])
    print_rows(lines)


def fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def same_model_check(res: Results) -> dict[str, float]:
    """Max abs difference of each variant's first vector from (a)'s (same text)."""
    base = res.vectors.get("a")
    if base is None:
        return {}
    return {key: max(abs(x - y) for x, y in zip(base, vec, strict=True))
            for key, vec in res.vectors.items() if key != "a"}


def write_json(args: argparse.Namespace, res: Results, rows: list[dict[str, Any]],
               phases: dict[str, Any], weight_bytes: int, runtime_s: float) -> None:
    doc = {
        "benchmark": "coldstart",
        "model": "all-MiniLM-L6-v2 (ember.deployments.embeddings.MiniLM)",
        "complete": not res.errors,
        "errors": res.errors,
        "runtime_s": round(runtime_s, 1),
        "config": {
            "trials": args.trials,
            "burst": BURST,
            "scaledown_s": SCALEDOWN_S,
            "replica_num_cpus": REPLICA_CPUS,
            "quiet_s_before_cold_request": QUIET_S,
            "shipped_options": get_spec(MiniLM).options.model_dump(mode="json"),
            "ember_variants": [asdict(v) for v in EMBER_VARIANTS],
            "plain_default_autoscaling": plain_autoscaling(False),
            "plain_shrunk_autoscaling": plain_autoscaling(True),
            "logging": LOGGING,
        },
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "load_avg_at_end": list(os.getloadavg()),
                 "cuda": torch.cuda.is_available()},
        "weights_bytes": weight_bytes,
        "summary": [{k: r[k] for k in ("metric", "value", "target", "result")} for r in rows],
        "phases_median_s": phases,
        "same_model_max_abs_diff_vs_a": same_model_check(res),
        "raw": {
            "cold": {LABELS[k]: [asdict(s) for s in v] for k, v in res.cold.items()},
            "bursts": {LABELS[k]: asdict(b) for k, b in res.bursts.items()},
            "memory": res.memory,
        },
    }
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(doc, indent=2) + "\n")


# --- main -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def prepare_weights() -> str:
    """Fill the node cache and the page cache once, outside any timed request; the blob."""
    blob = os.path.realpath(loaders.resolve(weights_url()).paths[0])
    with open(blob, "rb") as f:  # read, not mapped: this process must not share the pages
        while f.read(1 << 22):
            pass
    return blob


def start(port: int) -> str:
    """Start Ray through Ember, Serve on ``port``, and both plain peers; the base URL."""
    start_ray()
    serve.start(http_options=HTTPOptions(host=HOST, port=port), proxy_location="HeadOnly",
                logging_config=LOGGING)
    for v in PLAIN_VARIANTS:
        bound = PlainMiniLM.options(
            name=v.deployment,
            autoscaling_config=plain_autoscaling(v.shrunk),
            ray_actor_options={"num_cpus": REPLICA_CPUS},
        ).bind()
        serve.run(bound, name=v.app, route_prefix=v.prefix, blocking=False,
                  logging_config=LOGGING)
    return f"http://{HOST}:{port}"


def section(name: str, res: Results, fn: Callable[[], None]) -> None:
    """Run one part; a failure is recorded and the next part still runs (not past the
    deadline)."""
    try:
        fn()
    except DeadlineExceeded:
        raise
    except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as exc:
        error = f"{name}: {type(exc).__name__}: {exc}"
        res.errors.append(error)
        print(f"  error in {error}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trials", type=int, default=5, help="cold starts per variant")
    parser.add_argument("--deadline-s", type=float, default=1200.0, help="global time budget")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.deadline_s <= 0:
        parser.error("--trials and --deadline-s must be positive")
    return args


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise DeadlineExceeded("hard deadline: a call blocked past the global deadline")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    for name in OVERRIDES:  # the bench fixes these itself; an operator's setting would skew it
        os.environ.pop(name, None)
    deadline = Deadline(args.deadline_s)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(int(args.deadline_s) + 60)  # backstop for a call that ignores timeouts
    res = Results()
    blob = prepare_weights()
    weight_bytes = os.path.getsize(blob)
    try:
        base_url = start(args.port or free_port())
        print(f"serving at {base_url}; weights {blob} ({mb(weight_bytes)} MB)", flush=True)
        for v in EMBER_VARIANTS:
            section(f"({v.key}) {v.label}", res,
                    lambda v=v: run_ember(v, base_url, args.trials, deadline, res))
        section("plain Ray Serve", res, lambda: run_plain(base_url, args.trials, deadline, res))
        section("memory", res, lambda: measure_memory(base_url, blob, deadline, res))
    except DeadlineExceeded as exc:
        res.errors.append(f"DeadlineExceeded: {exc}")
        print(f"benchmark stopped early: {exc}", file=sys.stderr)
    finally:
        signal.alarm(0)
        ember.shutdown()
        shutil.rmtree(MARKS_DIR, ignore_errors=True)
    rows = summarize(res, weight_bytes)
    phases = phase_table(res)
    print_report(rows, phases, res)
    diffs = same_model_check(res)
    if any(d > 1e-4 for d in diffs.values()):
        print(f"warning: variants disagree with (a) on the same text: {diffs}")
    runtime = time.monotonic() - began
    write_json(args, res, rows, phases, weight_bytes, runtime)
    print(f"runtime {runtime:.0f}s; wrote {RESULTS_PATH.relative_to(ROOT)}")
    if res.errors:
        print("errors: " + "; ".join(res.errors), file=sys.stderr)
    return 0 if not res.errors else 1


if __name__ == "__main__":
    sys.exit(main())
