"""The MiniLM flagship served the ways the cold-start benchmarks compare.

Every variant runs the same class, ``ember.deployments.embeddings.MiniLM``
(all-MiniLM-L6-v2, weights mapped from the node cache, ``warmup()`` before ready). The Ember
variants are subclasses that copy the shipped ``@ember.deployment`` options and change only
what their row names, plus ``num_cpus=0.5`` and ``scaledown_after_s=2`` (so that a 2-core
node holds them and they return to zero between trials):

* (a) ``pool+preload (warm hit)``: the flagship as shipped: warm pool of 1,
  ``preload=True``. The request finds a process that already built the model: a warm hit in
  a shared process, not a cold start; reported beside the real paths.
* (b) ``pool, on demand``: warm pool of 1, ``preload=False``: the pool constructs the model
  on the first request (redeployed before every trial, so each is a first request).
* (c) ``own replica, warm runtime``: ``warm_pool=0``: the deployment's own replica starts in
  a pre-started worker that already imported torch and the app (``control/warm_runtime.py``).
* (d) ``own replica, fresh process``: as (c), but the replica gets a runtime environment of
  its own, so Ray starts a fresh worker for it, as on plain Ray Serve.
* (e) ``Ray Serve default``: the same class behind a plain FastAPI ``@serve.ingress``
  deployment from zero, Ray's default up-path timers (``POST /plain/embed``), in a fresh
  worker (the runtime environment of (d)).
* (f) ``Ray Serve shrunk``: (e) with every timer at its fastest (``POST /shrunk/embed``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Annotated, Any

import _harness as h
import _serving
import httpx
import torch
from fastapi import Body, FastAPI
from ray import serve
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

TEXT = "Ember measures how long a sentence embedding takes from zero replicas."
QUIET_S = 1.0  # idle time at zero before each cold request


class _Served(MiniLM):
    """The flagship class; a variant's ``__call__`` must be its own to be served."""

    @_serving.resolved_hints
    def __call__(self, texts: list[str]) -> list[Embedding]:
        return super().__call__(texts)


class CopyLoaded(_Served):
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


@_serving.resolved_hints
def _report_pid(self: Any) -> dict[str, int]:
    return {"pid": os.getpid()}


def ember_variant(name: str, *, base: type = _Served, pid_route: bool = False,
                  **overrides: Any) -> type:
    """``MiniLM`` under ``name``: shipped options, bench CPUs and timers, ``overrides``."""
    options = _serving.shipped_options(MiniLM, name=name, num_cpus=_serving.REPLICA_CPUS,
                                       scaledown_after_s=_serving.SCALEDOWN_S)
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
    fresh_process: bool = False

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


POOL_PRELOAD = EmberVariant("pool+preload (warm hit)", "a", "cs-pool-preload",
                            "MiniLMPreload", 1, True)
POOL_LAZY = EmberVariant("pool, on demand", "b", "cs-pool-lazy", "MiniLMLazy", 1, False,
                         redeploy_each_trial=True)
WARM_RUNTIME = EmberVariant("own replica, warm runtime", "c", "cs-warm-runtime",
                            "MiniLMWarmRuntime", 0, True)
FRESH_PROCESS = EmberVariant("own replica, fresh process", "d", "cs-fresh", "MiniLMFresh", 0,
                             True, fresh_process=True)
PLAIN_DEFAULT = PlainVariant("Ray Serve default", "e", "cs-plain", "PlainDefault", "/plain",
                             False)
PLAIN_SHRUNK = PlainVariant("Ray Serve shrunk", "f", "cs-shrunk", "PlainShrunk", "/shrunk",
                            True)
EMBER_VARIANTS = (POOL_PRELOAD, POOL_LAZY, WARM_RUNTIME, FRESH_PROCESS)
PLAIN_VARIANTS = (PLAIN_DEFAULT, PLAIN_SHRUNK)
LABELS = {v.key: v.label for v in (*EMBER_VARIANTS, *PLAIN_VARIANTS)}

plain_api = FastAPI()


@serve.deployment
@serve.ingress(plain_api)
class PlainMiniLM:
    """The same class behind a plain Ray Serve FastAPI ingress: setup and warmup in
    ``__init__``, as Ember runs them before its replica reports ready."""

    def __init__(self) -> None:
        started = time.time()
        self.model = MiniLM()
        self.model.setup()
        self.model.warmup()
        _serving.write_mark(serve.get_replica_context().deployment, started)

    @plain_api.post("/embed")
    @_serving.resolved_hints
    def embed(self, texts: Annotated[list[str], Body()]) -> list[Embedding]:
        return self.model(texts)


def start(port: int, plain: tuple[PlainVariant, ...] = PLAIN_VARIANTS) -> str:
    """Ray, Serve on ``port`` and the ``plain`` peers (idle at zero); the base URL."""
    base_url = _serving.start_serve(port, preload=(__name__,))
    for v in plain:
        bound = PlainMiniLM.options(  # type: ignore[attr-defined]  # a Serve Deployment
            name=v.deployment, autoscaling_config=_serving.plain_autoscaling(v.shrunk),
            ray_actor_options={"num_cpus": _serving.REPLICA_CPUS,
                               "runtime_env": _serving.FRESH_PROCESS_ENV})
        _serving.deploy_plain(bound.bind(), v.app, v.prefix)
    return base_url


def prepare_weights() -> str:
    """Fill the node cache and the page cache once, outside any timed request; the blob."""
    blob = os.path.realpath(loaders.resolve(weights_url()).paths[0])
    with open(blob, "rb") as f:  # read, not mapped: this process must not share the pages
        while f.read(1 << 22):
            pass
    return blob


def plain_at_zero(plain: tuple[PlainVariant, ...] = PLAIN_VARIANTS) -> bool:
    return not any(_serving.replicas(p.app, p.deployment) for p in plain)


def wait_ember_zero(v: EmberVariant, base_url: str, deadline: h.Deadline) -> None:
    """Until ``v`` has no replica (Serve and the ingress agree) and no peer has one."""
    h.wait_until(lambda: _serving.replicas(v.app, v.deployment) == 0 and plain_at_zero(),
                 f"{v.deployment} at zero", deadline)
    h.wait_until(lambda: _serving.ingress_view(base_url, v.deployment) == 0,
                 f"the ingress to see {v.deployment} at zero", deadline)
    time.sleep(QUIET_S)


def wait_plain_zero(deadline: h.Deadline) -> None:
    h.wait_until(plain_at_zero, "plain deployments at zero", deadline)
    time.sleep(QUIET_S)


def check_reply(reply: httpx.Response, url: str) -> list[float]:
    """The embedding of a 200 with one item, or an error naming what came back."""
    if reply.status_code != 200:
        raise RuntimeError(f"POST {url} -> {reply.status_code}: {reply.text[:300]}")
    items = reply.json()
    if len(items) != 1 or len(items[0]["embedding"]) != DIMENSIONS:
        raise RuntimeError(f"POST {url}: unexpected reply shape")
    vector: list[float] = items[0]["embedding"]
    return vector


def cold_request(url: str, deadline: h.Deadline) -> tuple[httpx.Response, float, float]:
    """One POST of ``TEXT``: the checked reply, seconds to the 200, wall clock at the send."""
    with httpx.Client() as client:
        sent_wall, sent = time.time(), time.perf_counter()
        reply = client.post(url, json=[TEXT], timeout=deadline.timeout())
        took = time.perf_counter() - sent
    check_reply(reply, url)
    return reply, took, sent_wall
