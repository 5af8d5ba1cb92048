"""The benchmarks' Ember apps build with the options the flagship ships with.

A benchmark is run rarely and by hand; an option check added to ``@ember.deployment`` once
made ``bench/_ember_minilm.py`` refuse to load, and only the next benchmark run found it.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

import ember
from ember.app.decorator import get_spec
from ember.deployments.embeddings import Embedding, MiniLM

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py``, imported as the benchmarks import it (``bench/`` on the path).

    A bench module may set variables for the servers it starts (``_serving`` opens the admin
    routes to loopback): this process's environment is put back after the import, so no
    later test runs with them."""
    sys.path.insert(0, str(BENCH))
    saved = dict(os.environ)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
        os.environ.clear()
        os.environ.update(saved)


def test_the_throughput_contender_builds_with_the_shipped_options() -> None:
    module = bench_module("_ember_minilm")
    options = get_spec(module.MiniLMCounted).options
    assert options.max_replicas == 1 and options.warm_floor == 1
    assert options.route == get_spec(MiniLM).options.route
    assert isinstance(module.app, ember.App)


def test_shipped_options_rebuild_a_deployment() -> None:
    serving = bench_module("_serving")

    @ember.deployment(**serving.shipped_options(MiniLM, max_replicas=2))
    class Again(MiniLM):
        def __call__(self, texts: list[str]) -> list[Embedding]:
            return super().__call__(texts)

    assert get_spec(Again).options.max_replicas == 2


def test_fresh_process_replicas_wraps_the_options_builder_as_the_runtime_calls_it() -> None:
    """The cold-start bench's fresh-process variant (d) once failed every trial: the runtime
    had begun to pass ``placement``, which the bench's wrapper did not take."""
    from ember.cluster import runtime

    serving = bench_module("_serving")
    options = get_spec(MiniLM).options.with_env_overrides()
    with serving.fresh_process_replicas():
        # The name runtime imported and calls, which the bench replaces.
        build = vars(runtime)["to_ray_options"]
        built = build(options, name="MiniLM", placement={"resources": {}})
    assert built["ray_actor_options"]["runtime_env"] == serving.FRESH_PROCESS_ENV
    assert built["ray_actor_options"]["resources"] == {}


def test_the_benchmarks_and_load_tests_pick_ports_below_the_ephemeral_range() -> None:
    # A port the kernel can hand to a process binding 0 (as Ray's servers do) may be taken
    # before the server bound to it binds: an edge's start failed on it.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    free_port = bench_module("_harness").free_port
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports), sorted(ports)
    assert len(ports) > 1  # chosen, not one fixed port
