"""Dynamic batching through Ember over HTTP: per-item cost curves, throughput, stage hops.

Everything runs in one process against one local Ray cluster (2 logical CPUs here) and one
LitServe server, all on 127.0.0.1. One Ember app (``warm_pool=0``, so a deployment's own
replica serves every request) holds:

* ``SeedMLP`` from ``examples/mlp_app.py`` as shipped (256 -> 512 -> 16, batched tensor
  handler ``forward``, ``ember.Batch(max_size=512, max_wait_ms=2)``), over Open Inference v2
  at ``POST /v2/models/mlp/infer`` (the app's own OIP protocol object).
* ``MiniLMBatched`` (``POST /embed``): ``ember.deployments.embeddings.MiniLM`` with the
  flagship's ``@ember.deployment`` options (``ember.Batch(max_size=64, max_wait_ms=5)``...),
  changed only in ``warm_floor=1``, ``max_replicas=1`` and ``num_cpus=0.25`` (Ray
  accounting, so that every variant fits on two logical CPUs at once). It also counts its
  handler calls and their texts (``GET /embed/stats``), to report texts per forward pass.
* ``MiniLMUnbatched`` (``POST /embed-unbatched``): the same class and options with
  ``batch=None`` and ``max_ongoing_requests=64``: each request runs its own forward pass.
  Its sync handler runs in the replica's worker threads, so up to a few requests compute
  at the same time (torch uses one thread in each; all of them share the 2 cores).
* ``embed-pipeline`` (``POST /embed-pipeline``): the three stages of
  ``ember.deployments.embeddings.pipeline_app`` (``Tokenize -> Encode -> Pool``, the same
  classes), each one replica with ``warm_floor=1``, ``max_replicas=1`` and a fractional
  ``num_cpus``; only the route differs from ``pipeline_app`` (``/embed`` is taken above).

Every replica and the LitServe worker call ``torch.set_num_threads(1)``. LitServe (batching
on: ``max_batch_size=64``, ``batch_timeout=0.005``, one worker, one API server) serves the
same model, built by the same code (``find_model_files``, ``Tokenizer``, ``build_model`` on
``safetensors`` ``load_file``, ``embed``), at ``POST /predict`` with ``{"text": ...}``; it
runs as a subprocess of this script (``--litserve-port``), is started beside Ray and is
killed by PID at the end. Ray Serve and LitServe both log at WARNING without access logs.

0. The model alone (with the throughput part, before any server starts): CPU time per text
   of MiniLM's forward in this process, one torch thread, at b = 1, 4, 16, 64. Their ratio
   t(1)/t(64) is the most batching can buy on this CPU with zero serving cost, so it bounds
   the batched/unbatched target from above.
1. Cost curve t(b) = o/b + c. For b = 1, 2, 4 ... 512, requests each carrying b items are
   sent one after another (``--sweep-warmup`` untimed, then ``--sweep-reps`` timed; T(b) is
   their median). t(b) = T(b)/b. o and c are fitted by least squares on t(b) against 1/b
   (so T(b) = o + c*b); R^2 is given for t(b) and for T(b). Models: the seed MLP over OIP
   (shape [b, 256], FP32), and MiniLM at ``/embed`` (flagship, batched) and at
   ``/embed-unbatched``, b short texts. A request below the batch size also waits the
   partial-batch timer (2 ms MLP, 5 ms MiniLM ``/embed``); MiniLM runs at most 64 texts per
   forward pass (``embed(batch_size=64)``, and ``/embed`` cuts requests into 64-item
   chunks). MiniLM stops early when the next size would take over ``SWEEP_STEP_CAP_S``.
2. Throughput and p50/p99 at concurrency 1 and 32 (asyncio + httpx, closed loop: each of
   the c clients sends its next request when the last one answered, one text each), for
   Ember batched, Ember unbatched and LitServe batched; ``--rounds`` rounds of
   ``--duration-s`` each, servers interleaved within a round, after ``--warmup-s`` of untimed
   load per server and concurrency. Targets: batched >= 4x unbatched and Ember batched >=
   LitServe batched, at concurrency 32. Where the CPU goes: CPU seconds of each process
   group (this load client, Ray Serve's proxy, Ember's ingress, each replica, the rest of
   Ray, LitServe's processes, and everything else on the host) over the timed runs, per
   request; idle servers are not stopped, so each one's background cost shows in the
   others' columns.
3. Stage hop overhead: warm latency at concurrency 1 (sequential requests, one short text)
   of the pipeline vs the single-deployment unbatched variant (the same work with no batch
   timer on either side), interleaved by round. Per-hop overhead = (pipeline - single) / 2
   hops, on p50 and on the mean. The batched flagship is shown as well; at concurrency 1 it
   also waits its 5 ms batch timer.

All vectors must agree across servers (max abs diff <= 1e-4). Everything is bounded by
``--deadline-s``. Output: tables on stdout and ``bench/results/batching.json``. Absolute
figures on a shared 2-core machine move from run to run; the ratios are the point.

Usage:
    .venv/bin/python bench/batching_bench.py [--duration-s 10] [--rounds 2] [--deadline-s 1200]
        [--only sweep throughput hops]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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
import litserve  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from mlp_app import IN_FEATURES, OUT_FEATURES, SeedMLP, ensure_weights, weights_path  # noqa: E402
from mlp_app import app as mlp_app  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import ember  # noqa: E402
from ember.deployments._minilm import (  # noqa: E402
    MiniLMConfig,
    Tokenizer,
    build_model,
    embed,
    find_model_files,
)
from ember.deployments.embeddings import (  # noqa: E402
    DIMENSIONS,
    Embedding,
    Encode,
    MiniLM,
    Pool,
    Tokenize,
)
from ember.platform.decorator import get_spec  # noqa: E402

RESULTS_PATH = ROOT / "bench" / "results" / "batching.json"
HOST = "127.0.0.1"
APP_NAME = "bench-batching"
LOGGING = {"log_level": "WARNING", "enable_access_log": False}
OVERRIDES = ("EMBER_SCALEDOWN_AFTER_S", "EMBER_WARM_POOL", "EMBER_API_KEYS",
             "EMBER_API_KEYS_FILE", "EMBER_RATE_LIMIT_RPS", "EMBER_RATE_LIMIT_BURST")
MODEL_CPUS = 0.25  # Ray accounting per MiniLM replica; compute is torch's one thread
STAGE_CPUS = 0.1  # tokenize and pool stages
MLP_SIZES = tuple(2**i for i in range(10))  # 1 .. 512
CONCURRENCY = (1, 32)
PARTS = ("sweep", "throughput", "hops")
LIT_MAX_BATCH = 64
LIT_BATCH_TIMEOUT_S = 0.005
SWEEP_STEP_CAP_S = 60.0
MAX_ABS_DIFF = 1e-4
JSON_HEADERS = {"content-type": "application/json"}
WORDS = ("ember", "serves", "small", "models", "fast", "while", "the", "quick", "brown", "fox",
         "jumps", "over", "a", "lazy", "dog", "near", "quiet", "rivers", "under", "bright",
         "morning", "light")
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


def short_text(i: int) -> str:
    """A distinct short sentence (about 8-14 tokens) for item ``i``."""
    n = len(WORDS)
    return " ".join(WORDS[(i * 7 + j * 3) % n] for j in range(6 + i % 6)) + f" {i}"


TEXTS = [short_text(i) for i in range(512)]


# --- the deployments ------------------------------------------------------------------------


def resolved_hints(fn: F) -> F:
    """Replace string annotations (``from __future__``) by the objects they name.

    Ray pickles this script's classes by value; unpickling one here puts copies of its
    methods, whose globals hold only the names their code uses, onto the class, after which
    string annotations could not be resolved any more.
    """
    fn.__annotations__ = typing.get_type_hints(fn)
    return fn


def shipped_options(cls: type, **changes: Any) -> dict[str, Any]:
    """The ``@ember.deployment`` options ``cls`` ships with, with ``changes``."""
    shipped = get_spec(cls).options
    options = {key: getattr(shipped, key) for key in type(shipped).model_fields}
    options.update(changes)
    return options


# One replica each, always up; Ray CPU accounting shrunk so that all fit on 2 logical CPUs.
ONE_REPLICA = {"warm_floor": 1, "max_replicas": 1}


class _OneThread(MiniLM):
    def setup(self) -> None:
        torch.set_num_threads(1)
        super().setup()


@ember.deployment(**shipped_options(MiniLM, name="MiniLMBatched", route="/embed",
                                    num_cpus=MODEL_CPUS, **ONE_REPLICA))
class MiniLMBatched(_OneThread):
    """The flagship: items of concurrent requests share forward passes.

    It also counts its handler calls and their items (``GET /embed/stats``), so that the
    bench can report how many texts a forward pass held under load.
    """

    calls = 0
    items = 0

    @resolved_hints
    def __call__(self, texts: list[str]) -> list[Embedding]:
        self.calls += 1
        self.items += len(texts)
        return super().__call__(texts)

    @ember.route("/embed/stats", method="GET")
    @resolved_hints
    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "items": self.items}


@ember.deployment(**shipped_options(MiniLM, name="MiniLMUnbatched", route="/embed-unbatched",
                                    num_cpus=MODEL_CPUS, batch=None, max_ongoing_requests=64,
                                    **ONE_REPLICA))
class MiniLMUnbatched(_OneThread):
    """No ``ember.Batch``: every request runs its own forward pass."""

    @resolved_hints
    def __call__(self, texts: list[str]) -> list[Embedding]:
        return super().__call__(texts)


@ember.deployment(**shipped_options(Tokenize, num_cpus=STAGE_CPUS, **ONE_REPLICA))
class BenchTokenize(Tokenize):
    @resolved_hints
    def __call__(self, texts: list[str]) -> dict[str, Any]:
        return super().__call__(texts)


@ember.deployment(**shipped_options(Encode, num_cpus=MODEL_CPUS, **ONE_REPLICA))
class BenchEncode(Encode):
    def setup(self) -> None:
        torch.set_num_threads(1)
        super().setup()

    @resolved_hints
    def __call__(self, value: dict[str, Any]) -> dict[str, Any]:
        return super().__call__(value)


@ember.deployment(**shipped_options(Pool, num_cpus=STAGE_CPUS, **ONE_REPLICA))
class BenchPool(Pool):
    def setup(self) -> None:
        torch.set_num_threads(1)

    @resolved_hints
    def __call__(self, value: dict[str, Any]) -> list[Embedding]:
        return super().__call__(value)


def build_app() -> ember.App:
    pipe = ember.pipeline([BenchTokenize, BenchEncode, BenchPool], route="/embed-pipeline",
                          name="embed-pipeline")
    return ember.App([SeedMLP, MiniLMBatched, MiniLMUnbatched, pipe], name=APP_NAME,
                     warm_pool=0, protocols=list(mlp_app.protocols))


# --- LitServe -------------------------------------------------------------------------------


class MiniLMLitAPI(litserve.LitAPI):
    """The same model and code as the Ember deployments, batched by LitServe."""

    def setup(self, device: Any) -> None:
        torch.set_num_threads(1)
        files = find_model_files()
        config = MiniLMConfig.from_file(files.config)
        self.model = build_model(load_file(str(files.weights), device="cpu"), config)
        self.tokenizer = Tokenizer(files.tokenizer)
        self.predict(["warm up the kernels before the server reports ready"])

    # LitServe types its endpoint from these two signatures: left unannotated, the body is
    # read as JSON and the reply is sent as returned.
    def decode_request(self, request, **kwargs):  # type: ignore[no-untyped-def]
        return str(request["text"])

    def batch(self, inputs: Any) -> list[str]:
        return list(inputs)

    def predict(self, x: Any, **kwargs: Any) -> list[tuple[list[float], int]]:
        vectors = embed(self.model, self.tokenizer, x, batch_size=64)
        counts = self.tokenizer.token_counts(x)
        return list(zip(vectors.tolist(), counts, strict=True))

    def unbatch(self, output: Any) -> list[Any]:
        return list(output)

    def encode_response(self, output, **kwargs):  # type: ignore[no-untyped-def]
        return {"embedding": output[0], "tokens": output[1]}


def serve_litserve(port: int) -> None:
    """Subprocess mode: run LitServe until terminated."""
    api = MiniLMLitAPI(max_batch_size=LIT_MAX_BATCH, batch_timeout=LIT_BATCH_TIMEOUT_S)
    server = litserve.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1,
                                timeout=120)
    server.run(host=HOST, port=port, num_api_servers=1, log_level="warning",
               generate_client_file=False)


class LitServeProcess:
    """The LitServe subprocess: started, waited for, and stopped by PID."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://{HOST}:{port}"
        fd, log = tempfile.mkstemp(prefix="litserve-", suffix=".log")
        self.log = Path(log)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--litserve-port", str(port)],
                stdout=fd, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir(),
                start_new_session=True)
        finally:
            os.close(fd)

    def wait_ready(self, deadline: Deadline) -> None:
        with httpx.Client() as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"LitServe exited with {self.proc.returncode}: "
                                       f"{self.log_tail()}")
                try:
                    if client.get(self.url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                deadline.left()
                time.sleep(0.5)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-1500:]

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def idle_cpu_percent(self, window_s: float = 2.0) -> float:
        """CPU used by the whole LitServe process tree while no request is sent."""
        procs = self.tree()
        for p in procs:
            p.cpu_percent(None)
        time.sleep(window_s)
        total = 0.0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.cpu_percent(None)
        return total

    def stop(self) -> None:
        procs = self.tree()
        for p in procs:  # the server first, then whatever it started, each by its own PID
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
        self.log.unlink(missing_ok=True)


# --- Ember ----------------------------------------------------------------------------------


def start_ember(port: int) -> str:
    """``ember.serve`` of the bench app, with the bench's logging; the base URL."""
    from ray import serve
    from ray.serve.config import HTTPOptions

    from ember.platform.runtime import build_application, start_ray

    start_ray()
    serve.start(http_options=HTTPOptions(host=HOST, port=port), proxy_location="HeadOnly",
                logging_config=LOGGING)
    serve.run(build_application(build_app()), name=APP_NAME, route_prefix="/", blocking=False,
              logging_config=LOGGING)
    return f"http://{HOST}:{port}"


def wait_http(url: str, deadline: Deadline) -> None:
    with httpx.Client() as client:
        while True:
            try:
                if client.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            deadline.left()
            time.sleep(0.5)


# --- requests -------------------------------------------------------------------------------


def mlp_body(b: int) -> bytes:
    data = [round(((i * 37) % 101) / 101.0, 4) for i in range(b * IN_FEATURES)]
    body = {"inputs": [{"name": "INPUT", "shape": [b, IN_FEATURES], "datatype": "FP32",
                        "data": data}]}
    return json.dumps(body).encode()


def check_mlp(reply: Any, b: int) -> None:
    shape = reply["outputs"][0]["shape"]
    if shape != [b, OUT_FEATURES]:
        raise RuntimeError(f"MLP reply shape {shape}, expected {[b, OUT_FEATURES]}")


def minilm_body(b: int, start: int = 0) -> bytes:
    return json.dumps([TEXTS[(start + i) % len(TEXTS)] for i in range(b)]).encode()


def check_minilm(reply: Any, b: int) -> None:
    if len(reply) != b or len(reply[0]["embedding"]) != DIMENSIONS:
        raise RuntimeError(f"MiniLM reply of {len(reply)} items, expected {b}")


def post(client: httpx.Client, url: str, body: bytes, deadline: Deadline) -> Any:
    reply = client.post(url, content=body, headers=JSON_HEADERS, timeout=deadline.timeout())
    if reply.status_code != 200:
        raise RuntimeError(f"POST {url} -> {reply.status_code}: {reply.text[:300]}")
    return reply.json()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


# --- 1. cost curves -------------------------------------------------------------------------


@dataclass
class Sweep:
    label: str
    url: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    fit: dict[str, float] = field(default_factory=dict)
    note: str = ""


def fit_cost(sizes: list[int], totals_ms: list[float]) -> dict[str, float]:
    """Least squares of t(b) = o/b + c (t = T/b) on x = 1/b; R^2 in t and in T."""
    xs = [1.0 / b for b in sizes]
    ts = [t / b for t, b in zip(totals_ms, sizes, strict=True)]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    sxx = sum((x - mx) ** 2 for x in xs)
    o = sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True)) / sxx
    c = mt - o * mx

    def r2(actual: list[float], predicted: list[float]) -> float:
        mean = statistics.fmean(actual)
        ss_tot = sum((a - mean) ** 2 for a in actual)
        ss_res = sum((a - p) ** 2 for a, p in zip(actual, predicted, strict=True))
        return 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0

    r2_t = r2(ts, [o / b + c for b in sizes])
    r2_total = r2(totals_ms, [o + c * b for b in sizes])
    return {"o_ms": o, "c_ms_per_item": c, "r2_t": r2_t, "r2_T": r2_total,
            "items_per_s_limit": 1000.0 / c if c > 0 else float("inf")}


def run_sweep(sweep: Sweep, sizes: tuple[int, ...], make: Callable[[int], bytes],
              check: Callable[[Any, int], None], args: argparse.Namespace,
              deadline: Deadline, step_cap_s: float | None) -> None:
    print(f"sweep {sweep.label}", flush=True)
    with httpx.Client() as client:
        for b in sizes:
            if step_cap_s is not None and sweep.rows:
                expected = 2 * sweep.rows[-1]["T_ms"] / 1000.0 * (args.sweep_reps
                                                                 + args.sweep_warmup)
                if expected > step_cap_s:
                    sweep.note = f"stopped before b={b}: about {expected:.0f}s expected"
                    print(f"  {sweep.note}", flush=True)
                    break
            body = make(b)
            for _ in range(args.sweep_warmup):
                check(post(client, sweep.url, body, deadline), b)
            samples = []
            for _ in range(args.sweep_reps):
                sent = time.perf_counter()
                reply = post(client, sweep.url, body, deadline)
                samples.append((time.perf_counter() - sent) * 1000.0)
                check(reply, b)
            total = statistics.median(samples)
            sweep.rows.append({"b": b, "T_ms": total, "t_ms_per_item": total / b,
                               "items_per_s": b / total * 1000.0, "samples_ms": samples})
            print(f"  b={b:<4} T={total:9.2f} ms  t={total / b:8.3f} ms/item", flush=True)
    if len(sweep.rows) >= 2:
        sweep.fit = fit_cost([r["b"] for r in sweep.rows], [r["T_ms"] for r in sweep.rows])


# --- 2. throughput --------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadTarget:
    label: str
    key: str
    url: str
    body: Callable[[int], bytes]
    stats_url: str | None = None  # handler calls and items so far, where the server says


@dataclass
class LoadResult:
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed_s: float = 0.0
    first_error: str | None = None
    handler_calls: int = 0
    handler_items: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)  # by process group, measured runs

    def summary(self) -> dict[str, Any]:
        lat = self.latencies_ms
        return {
            "requests": len(lat),
            "errors": self.errors,
            "elapsed_s": self.elapsed_s,
            "throughput_rps": len(lat) / self.elapsed_s if self.elapsed_s > 0 else None,
            "p50_ms": percentile(lat, 50) if lat else None,
            "p99_ms": percentile(lat, 99) if lat else None,
            "mean_ms": statistics.fmean(lat) if lat else None,
            "first_error": self.first_error,
            "items_per_forward_call": (self.handler_items / self.handler_calls
                                       if self.handler_calls else None),
            "cpu_ms_per_request": {k: v * 1000.0 / len(lat) for k, v in self.cpu_s.items()}
            if lat else {},
            "cores_busy": {k: v / self.elapsed_s for k, v in self.cpu_s.items()}
            if self.elapsed_s > 0 else {},
        }


def ember_text_body(i: int) -> bytes:
    return json.dumps([TEXTS[i % len(TEXTS)]]).encode()


def lit_text_body(i: int) -> bytes:
    return json.dumps({"text": TEXTS[i % len(TEXTS)]}).encode()


def closed_loop(target: LoadTarget, concurrency: int, duration_s: float, deadline: Deadline,
                into: LoadResult | None = None) -> LoadResult:
    """``concurrency`` clients, each sending its next request once the last one answered,
    for ``duration_s``; elapsed runs until the last answer."""
    out = into if into is not None else LoadResult()
    budget = duration_s + deadline.timeout(180.0)
    counter = itertools.count()

    async def run() -> None:
        limits = httpx.Limits(max_connections=concurrency,
                              max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=deadline.timeout(120.0)) as client:
            stop_at = time.perf_counter() + duration_s

            async def client_loop() -> None:
                while time.perf_counter() < stop_at:
                    body = target.body(next(counter))
                    sent = time.perf_counter()
                    try:
                        reply = await client.post(target.url, content=body,
                                                  headers=JSON_HEADERS)
                        error = None if reply.status_code == 200 else (
                            f"{reply.status_code}: {reply.text[:200]}")
                    except httpx.HTTPError as exc:
                        error = f"{type(exc).__name__}: {exc}"
                    if error is None:
                        out.latencies_ms.append((time.perf_counter() - sent) * 1000.0)
                    else:
                        out.errors += 1
                        out.first_error = out.first_error or error

            started = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*(client_loop() for _ in range(concurrency))),
                                   timeout=budget)
            out.elapsed_s += time.perf_counter() - started

    try:
        asyncio.run(run())
    except TimeoutError:
        deadline.left()
        raise RuntimeError(f"{target.label} at c={concurrency} did not finish in time") from None
    return out


HOST_OTHERS = "host: everything else"


def process_group(cmdline: str) -> str:
    """Which part of the serving stack a process of this bench's Ray cluster is."""
    if "ProxyActor" in cmdline:
        return "Ray Serve HTTP proxy"
    if f"{APP_NAME}:" in cmdline or f"{APP_NAME}#" in cmdline:
        name = cmdline.split(f"{APP_NAME}", 1)[1][1:].split()[0]
        return f"Ember {name.split('#')[0].split('.')[0]}"
    return "Ray core and Serve controller"


def cpu_snapshot(lit_pids: set[int]) -> dict[str, float]:
    """CPU seconds so far of this process, its descendants by group, and the whole host."""
    def busy(t: Any) -> float:
        return float(t.user + t.system)

    me = psutil.Process()
    out = {"load client (this process)": busy(me.cpu_times())}
    for proc in me.children(recursive=True):
        try:
            group = ("LitServe (all its processes)" if proc.pid in lit_pids
                     else process_group(" ".join(proc.cmdline())))
            out[group] = out.get(group, 0.0) + busy(proc.cpu_times())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    host = psutil.cpu_times()
    out[HOST_OTHERS] = float(host.user + host.nice + host.system + getattr(host, "irq", 0.0)
                             + getattr(host, "softirq", 0.0)) - sum(out.values())
    return out


def handler_counts(url: str | None, deadline: Deadline) -> tuple[int, int]:
    if url is None:
        return 0, 0
    reply = httpx.get(url, timeout=deadline.timeout(30.0))
    reply.raise_for_status()
    return int(reply.json()["calls"]), int(reply.json()["items"])


def run_throughput(targets: list[LoadTarget], args: argparse.Namespace, deadline: Deadline,
                   lit_pids: set[int]) -> dict[str, dict[int, LoadResult]]:
    results = {t.key: {c: LoadResult() for c in CONCURRENCY} for t in targets}
    for c in CONCURRENCY:
        for target in targets:
            closed_loop(target, c, args.warmup_s, deadline)
        for rnd in range(1, args.rounds + 1):
            for target in targets:
                calls, items = handler_counts(target.stats_url, deadline)
                cpu = cpu_snapshot(lit_pids)
                res = closed_loop(target, c, args.duration_s, deadline, results[target.key][c])
                cpu_after = cpu_snapshot(lit_pids)
                calls_after, items_after = handler_counts(target.stats_url, deadline)
                res.handler_calls += calls_after - calls
                res.handler_items += items_after - items
                for group, seconds in cpu_after.items():
                    res.cpu_s[group] = res.cpu_s.get(group, 0.0) + seconds - cpu.get(group, 0.0)
                print(f"  c={c:<3} round {rnd}/{args.rounds} {target.label:<22} "
                      f"{len(res.latencies_ms):6d} ok {res.errors} errors", flush=True)
    for target in targets:
        for c in CONCURRENCY:
            res = results[target.key][c]
            if not res.latencies_ms:
                raise RuntimeError(f"{target.label} at c={c}: no request succeeded "
                                   f"({res.first_error})")
    return results


# --- 3. pipeline hops -----------------------------------------------------------------------


def run_hops(targets: list[LoadTarget], args: argparse.Namespace,
             deadline: Deadline) -> dict[str, list[float]]:
    latencies: dict[str, list[float]] = {t.key: [] for t in targets}
    with httpx.Client() as client:
        for target in targets:
            for i in range(20):
                check_minilm(post(client, target.url, target.body(i), deadline), 1)
        for rnd in range(args.hop_rounds):
            for target in targets:
                for i in range(args.hop_requests):
                    body = target.body(rnd * args.hop_requests + i)
                    sent = time.perf_counter()
                    post(client, target.url, body, deadline)
                    latencies[target.key].append((time.perf_counter() - sent) * 1000.0)
            print(f"  hop round {rnd + 1}/{args.hop_rounds} done", flush=True)
    return latencies


# --- 0. the model alone ---------------------------------------------------------------------


def model_ceiling(batch_sizes: tuple[int, ...] = (1, 4, 16, 64)) -> dict[str, Any]:
    """CPU time per text of MiniLM's forward alone (this process, one torch thread).

    No server is involved: this is what batching can save at most on this CPU. With zero
    serving cost, batched / unbatched throughput is at most t(1) / t(64) when each forward
    gets the same cores; the bench's batched replica runs one forward at a time on one torch
    thread while the unbatched one runs several at once, so there the bound is
    t(1) / (t(64) * cores).
    """
    torch.set_num_threads(1)
    files = find_model_files()
    model = build_model(load_file(str(files.weights), device="cpu"),
                        MiniLMConfig.from_file(files.config))
    tokenizer = Tokenizer(files.tokenizer)
    per_item_ms: dict[str, float] = {}
    for b in batch_sizes:
        embed(model, tokenizer, TEXTS[:b], batch_size=64)  # untimed: first call allocates
        reps = max(4, 256 // b)
        started = time.process_time()
        for i in range(reps):
            first = (i * b) % (len(TEXTS) - b)
            embed(model, tokenizer, TEXTS[first:first + b], batch_size=64)
        per_item_ms[str(b)] = (time.process_time() - started) / (reps * b) * 1000.0
    gain = per_item_ms[str(batch_sizes[0])] / per_item_ms[str(batch_sizes[-1])]
    cores = os.cpu_count() or 1
    return {"per_item_cpu_ms": per_item_ms, "batching_gain": gain, "cores": cores,
            "bound_batched_over_unbatched_bench_layout": gain / cores}


def print_ceiling(ceiling: dict[str, Any]) -> None:
    print("\nMiniLM forward alone (no server, one torch thread): CPU ms per text")
    per_item = ceiling["per_item_cpu_ms"]
    print_rows([["batch", *per_item], ["ms/text", *(fmt(v) for v in per_item.values())]])
    print(f"batching gain t(1)/t(64) = {ceiling['batching_gain']:.2f}x: the most batched / "
          f"unbatched throughput can reach with zero serving cost on this CPU; "
          f"{ceiling['bound_batched_over_unbatched_bench_layout']:.2f}x in this bench's "
          f"layout (one batched forward at a time vs unbatched forwards on "
          f"{ceiling['cores']} cores)")


# --- same model everywhere ------------------------------------------------------------------


def same_model(base_url: str, lit_url: str, deadline: Deadline) -> dict[str, float]:
    """Max abs difference of each server's vector for one text vs ``/embed``."""
    text = TEXTS[3]
    with httpx.Client() as client:
        body = json.dumps([text]).encode()
        ref = post(client, base_url + "/embed", body, deadline)[0]["embedding"]
        others = {
            "/embed-unbatched": post(client, base_url + "/embed-unbatched", body,
                                     deadline)[0]["embedding"],
            "/embed-pipeline": post(client, base_url + "/embed-pipeline", body,
                                    deadline)[0]["embedding"],
            "litserve /predict": post(client, lit_url + "/predict",
                                      json.dumps({"text": text}).encode(),
                                      deadline)["embedding"],
        }
    return {k: max(abs(a - b) for a, b in zip(ref, v, strict=True)) for k, v in others.items()}


# --- report ---------------------------------------------------------------------------------


def print_rows(lines: list[list[str]]) -> None:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for i, line in enumerate(lines):
        print(" | ".join(cell.rjust(w) if i and j else cell.ljust(w)
                         for j, (cell, w) in enumerate(zip(line, widths, strict=True))))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_sweep(sweep: Sweep) -> None:
    print(f"\n{sweep.label}   (POST {sweep.url.split('/', 3)[-1]})")
    fit = sweep.fit
    lines = [["b", "T(b) ms", "t(b) ms/item", "items/s", "fit t(b) ms/item"]]
    for r in sweep.rows:
        fitted = fit["o_ms"] / r["b"] + fit["c_ms_per_item"] if fit else None
        lines.append([str(r["b"]), fmt(r["T_ms"]), fmt(r["t_ms_per_item"], ".3f"),
                      fmt(r["items_per_s"], ".1f"), fmt(fitted, ".3f")])
    print_rows(lines)
    if fit:
        print(f"fit t(b) = o/b + c: o = {fit['o_ms']:.3f} ms, c = {fit['c_ms_per_item']:.4f} "
              f"ms/item (1/c = {fit['items_per_s_limit']:.0f} items/s); "
              f"R^2 (t) = {fit['r2_t']:.4f}, R^2 (T = o + c*b) = {fit['r2_T']:.4f}")
    if sweep.note:
        print(f"note: {sweep.note}")


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "FAIL")


def ratios(tp: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    def rps(key: str) -> float | None:
        row = tp.get(key, {}).get("32")
        return None if row is None else row["throughput_rps"]

    out = []
    for name, num, den, target in (
        ("Ember batched / Ember unbatched, c=32", "batched", "unbatched", 4.0),
        ("Ember batched / LitServe batched, c=32", "batched", "litserve", 1.0),
    ):
        a, b = rps(num), rps(den)
        value = a / b if a is not None and b else None
        out.append({"ratio": name, "value": value, "target": f">= {target:g}x",
                    "result": verdict(None if value is None else value >= target)})
    return out


def print_throughput(targets: list[LoadTarget], tp: dict[str, dict[str, Any]],
                     ratio_rows: list[dict[str, Any]]) -> None:
    print("\nMiniLM, one text per request: throughput and latency")
    lines = [["server", "c", "requests", "errors", "req/s", "p50 ms", "p99 ms", "mean ms",
              "texts/forward"]]
    for c in CONCURRENCY:
        for t in targets:
            row = tp.get(t.key, {}).get(str(c))
            if row is None:
                continue
            lines.append([t.label, str(c), str(row["requests"]), str(row["errors"]),
                          fmt(row["throughput_rps"], ".1f"), fmt(row["p50_ms"]),
                          fmt(row["p99_ms"]), fmt(row["mean_ms"]),
                          fmt(row.get("items_per_forward_call"), ".1f")])
    print_rows(lines)
    for c in CONCURRENCY:
        print(f"\nCPU per request [ms] by process, c={c} (and cores busy on the host)")
        rows = [tp.get(t.key, {}).get(str(c), {}) for t in targets]
        groups = sorted({g for row in rows for g in row.get("cpu_ms_per_request", {})},
                        key=lambda g: (g == HOST_OTHERS, g))
        lines = [["process", *(t.label for t in targets)]]
        for group in groups:
            lines.append([group, *(fmt(row.get("cpu_ms_per_request", {}).get(group))
                                   for row in rows)])
        lines.append(["cores busy, this bench", *(
            fmt(sum(v for k, v in row.get("cores_busy", {}).items() if k != HOST_OTHERS))
            for row in rows)])
        lines.append(["cores busy, everything else", *(
            fmt(row.get("cores_busy", {}).get(HOST_OTHERS)) for row in rows)])
        print_rows(lines)
    print()
    print_rows([["ratio", "value", "target", "result"]] + [
        [r["ratio"], fmt(r["value"]) + ("x" if r["value"] is not None else ""), r["target"],
         r["result"]] for r in ratio_rows])


def hop_summary(targets: list[LoadTarget], lat: dict[str, list[float]]) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for t in targets:
        if lat[t.key]:
            rows[t.key] = {"label": t.label, "requests": len(lat[t.key]),
                           "p50_ms": percentile(lat[t.key], 50),
                           "p99_ms": percentile(lat[t.key], 99),
                           "mean_ms": statistics.fmean(lat[t.key])}
    out: dict[str, Any] = {"latency": rows, "hops": 2}
    pipe = rows.get("pipeline")
    for ref in ("unbatched", "batched"):
        single = rows.get(ref)
        if pipe and single:
            out[f"per_hop_vs_{ref}"] = {
                "p50_ms": (pipe["p50_ms"] - single["p50_ms"]) / 2,
                "mean_ms": (pipe["mean_ms"] - single["mean_ms"]) / 2,
            }
    return out


def print_hops(hops: dict[str, Any]) -> None:
    print("\nPipeline (Tokenize -> Encode -> Pool) vs single deployment, c=1, one short text")
    lines = [["server", "requests", "p50 ms", "p99 ms", "mean ms"]]
    for row in hops["latency"].values():
        lines.append([row["label"], str(row["requests"]), fmt(row["p50_ms"]),
                      fmt(row["p99_ms"]), fmt(row["mean_ms"])])
    print_rows(lines)
    for ref, what in (("unbatched", "single unbatched (primary)"),
                      ("batched", "single batched flagship, incl. its 5 ms batch timer")):
        per = hops.get(f"per_hop_vs_{ref}")
        if per:
            print(f"per-hop overhead vs {what}: p50 {per['p50_ms']:.2f} ms, "
                  f"mean {per['mean_ms']:.2f} ms  ((pipeline - single) / 2 hops)")


# --- main -----------------------------------------------------------------------------------


@dataclass
class Report:
    ceiling: dict[str, Any] = field(default_factory=dict)
    sweeps: list[Sweep] = field(default_factory=list)
    throughput: dict[str, dict[str, Any]] = field(default_factory=dict)
    hops: dict[str, Any] = field(default_factory=dict)
    same_model: dict[str, float] = field(default_factory=dict)
    litserve_idle_cpu_percent: float | None = None
    load_avg_at_start: list[float] = field(default_factory=lambda: list(os.getloadavg()))
    errors: list[str] = field(default_factory=list)


def section(name: str, report: Report, fn: Callable[[], None]) -> None:
    """Run one part; a failure is recorded and the next part still runs."""
    try:
        fn()
    except DeadlineExceeded:
        raise
    except (RuntimeError, httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
        error = f"{name}: {type(exc).__name__}: {exc}"
        report.errors.append(error)
        print(f"  error in {error}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def run_all(args: argparse.Namespace, deadline: Deadline, report: Report,
            lit: LitServeProcess) -> None:
    if "throughput" in args.only:  # measured before any server starts, on a quiet host
        section("model ceiling", report,
                lambda: report.ceiling.update(model_ceiling()))
    base_url = start_ember(args.port or free_port())
    print(f"Ember at {base_url}, LitServe at {lit.url}; waiting for replicas", flush=True)
    wait_http(base_url + "/healthz", deadline)
    with httpx.Client() as client:  # each deployment answers once (its replica is up)
        check_mlp(post(client, base_url + "/v2/models/mlp/infer", mlp_body(1), deadline), 1)
        for path in ("/embed", "/embed-unbatched", "/embed-pipeline"):
            check_minilm(post(client, base_url + path, minilm_body(1), deadline), 1)
    lit.wait_ready(deadline)
    report.same_model = same_model(base_url, lit.url, deadline)
    bad = {k: v for k, v in report.same_model.items() if v > MAX_ABS_DIFF}
    if bad:
        raise RuntimeError(f"servers disagree with /embed on the same text: {bad}")
    report.litserve_idle_cpu_percent = lit.idle_cpu_percent()
    print(f"same model everywhere (max abs diff {max(report.same_model.values()):.2e}); "
          f"idle LitServe tree uses {report.litserve_idle_cpu_percent:.0f}% CPU", flush=True)

    minilm_sizes = tuple(b for b in MLP_SIZES if b <= args.minilm_max_batch)
    sweeps = [
        (Sweep("seed MLP 256->512->16, Ember OIP", base_url + "/v2/models/mlp/infer"),
         MLP_SIZES, mlp_body, check_mlp, None),
        (Sweep("MiniLM, Ember batched flagship", base_url + "/embed"),
         minilm_sizes, minilm_body, check_minilm, SWEEP_STEP_CAP_S),
        (Sweep("MiniLM, Ember unbatched", base_url + "/embed-unbatched"),
         minilm_sizes, minilm_body, check_minilm, SWEEP_STEP_CAP_S),
    ]
    for sweep, sizes, make, check, cap in sweeps:
        if "sweep" not in args.only:
            break
        report.sweeps.append(sweep)
        section(f"sweep {sweep.label}", report,
                functools.partial(run_sweep, sweep, sizes, make, check, args, deadline, cap))

    targets = [
        LoadTarget("Ember batched", "batched", base_url + "/embed", ember_text_body,
                   base_url + "/embed/stats"),
        LoadTarget("Ember unbatched", "unbatched", base_url + "/embed-unbatched",
                   ember_text_body),
        LoadTarget("LitServe batched", "litserve", lit.url + "/predict", lit_text_body),
    ]

    def throughput() -> None:
        print("throughput", flush=True)
        results = run_throughput(targets, args, deadline, {p.pid for p in lit.tree()})
        report.throughput = {k: {str(c): r.summary() for c, r in per.items()}
                             for k, per in results.items()}

    if "throughput" in args.only:
        section("throughput", report, throughput)

    hop_targets = [
        LoadTarget("Ember pipeline, 3 stages", "pipeline", base_url + "/embed-pipeline",
                   ember_text_body),
        LoadTarget("Ember single, unbatched", "unbatched", base_url + "/embed-unbatched",
                   ember_text_body),
        LoadTarget("Ember single, batched", "batched", base_url + "/embed", ember_text_body),
    ]

    def hops() -> None:
        print("pipeline hops", flush=True)
        report.hops = hop_summary(hop_targets, run_hops(hop_targets, args, deadline))

    if "hops" in args.only:
        section("pipeline hops", report, hops)


def write_json(args: argparse.Namespace, report: Report, ratio_rows: list[dict[str, Any]],
               runtime_s: float) -> None:
    doc = {
        "benchmark": "batching",
        "complete": not report.errors,
        "errors": report.errors,
        "runtime_s": round(runtime_s, 1),
        "config": {
            "args": {k: v for k, v in vars(args).items() if k != "litserve_port"},
            "concurrency": list(CONCURRENCY),
            "minilm_variant_num_cpus": MODEL_CPUS,
            "stage_num_cpus": STAGE_CPUS,
            "torch_threads": 1,
            "flagship_options": get_spec(MiniLM).options.model_dump(mode="json"),
            "batched_options": get_spec(MiniLMBatched).options.model_dump(mode="json"),
            "unbatched_options": get_spec(MiniLMUnbatched).options.model_dump(mode="json"),
            "seed_mlp_options": get_spec(SeedMLP).options.model_dump(mode="json"),
            "litserve": {"version": litserve.__version__, "max_batch_size": LIT_MAX_BATCH,
                         "batch_timeout_s": LIT_BATCH_TIMEOUT_S, "workers": 1,
                         "api_servers": 1},
            "logging": LOGGING,
            "texts_example": TEXTS[:3],
        },
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": torch.__version__, "load_avg_at_start": report.load_avg_at_start,
                 "load_avg_at_end": list(os.getloadavg())},
        "same_model_max_abs_diff_vs_embed": report.same_model,
        "litserve_idle_cpu_percent": report.litserve_idle_cpu_percent,
        "model_ceiling": report.ceiling,
        "cost_curves": [asdict(s) for s in report.sweeps],
        "throughput": report.throughput,
        "ratios": ratio_rows,
        "pipeline_hops": report.hops,
    }
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(doc, indent=2) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--deadline-s", type=float, default=1200.0, help="global time budget")
    parser.add_argument("--port", type=int, default=0, help="Ember HTTP port (default: free)")
    parser.add_argument("--sweep-reps", type=int, default=5, help="timed requests per b")
    parser.add_argument("--sweep-warmup", type=int, default=2, help="untimed requests per b")
    parser.add_argument("--minilm-max-batch", type=int, default=512, help="largest MiniLM b")
    parser.add_argument("--duration-s", type=float, default=10.0,
                        help="seconds per server, concurrency and round")
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds")
    parser.add_argument("--warmup-s", type=float, default=3.0,
                        help="untimed load per server and concurrency")
    parser.add_argument("--hop-requests", type=int, default=100,
                        help="sequential requests per server and hop round")
    parser.add_argument("--hop-rounds", type=int, default=3, help="hop rounds")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS),
                        help="run only these parts (default: all)")
    parser.add_argument("--litserve-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    positive = ("deadline_s", "sweep_reps", "minilm_max_batch", "duration_s", "rounds",
                "hop_requests", "hop_rounds")
    if any(getattr(args, name) <= 0 for name in positive) or args.sweep_warmup < 0 \
            or args.warmup_s < 0:
        parser.error("counts and durations must be positive")
    return args


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise DeadlineExceeded("hard deadline: a call blocked past the global deadline")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.litserve_port:
        serve_litserve(args.litserve_port)
        return 0
    began = time.monotonic()
    for name in OVERRIDES:  # the bench fixes these itself; an operator's setting would skew it
        os.environ.pop(name, None)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ensure_weights(weights_path())
    deadline = Deadline(args.deadline_s)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(int(args.deadline_s) + 60)  # backstop for a call that ignores timeouts
    report = Report()
    lit = LitServeProcess(free_port())
    try:
        run_all(args, deadline, report, lit)
    except (DeadlineExceeded, RuntimeError, httpx.HTTPError) as exc:
        report.errors.append(f"{type(exc).__name__}: {exc}")
        print(f"benchmark stopped early: {exc}", file=sys.stderr)
    finally:
        signal.alarm(0)
        lit.stop()
        ember.shutdown()
    for sweep in report.sweeps:
        if sweep.rows:
            print_sweep(sweep)
    ratio_rows = ratios(report.throughput)
    targets = [LoadTarget("Ember batched", "batched", "", ember_text_body),
               LoadTarget("Ember unbatched", "unbatched", "", ember_text_body),
               LoadTarget("LitServe batched", "litserve", "", lit_text_body)]
    if report.ceiling:
        print_ceiling(report.ceiling)
    if report.throughput:
        print_throughput(targets, report.throughput, ratio_rows)
    if report.hops:
        print_hops(report.hops)
    runtime = time.monotonic() - began
    write_json(args, report, ratio_rows, runtime)
    print(f"\nruntime {runtime:.0f}s; wrote {RESULTS_PATH.relative_to(ROOT)}")
    if report.errors:
        print("errors: " + "; ".join(report.errors), file=sys.stderr)
    return 0 if not report.errors else 1


if __name__ == "__main__":
    sys.exit(main())
