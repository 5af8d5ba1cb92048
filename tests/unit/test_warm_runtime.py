"""What a warm-runtime worker preloads (the live path is tested under `ember run`, in e2e)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from ember.control.warm_env import modules_to_import
from ember.control.warm_runtime import preload_modules, system_config, worker_env

SRC = Path(__file__).resolve().parents[2] / "src"


def test_every_worker_preloads_serves_replica_and_the_apps_modules_once() -> None:
    assert system_config() == {"preload_python_modules": ["ember.control.warm_imports"]}
    env = worker_env(["apps.core", "__main__", "torch", "apps.core"])
    assert modules_to_import(env) == [
        "ray.serve._private.replica", "ember.control.replica", "apps.core", "torch",
        "ember.control.torch_warm", "ember.control.s3_warm", "ember.control.settle_heap"]
    assert modules_to_import({**env, "_EMBER_LIGHT_WORKER": "1"}) == []


_GATE = """
import json, sys
import ember.control.warm_imports as gate
print(json.dumps({"imported": gate.IMPORTED, "colorsys": "colorsys" in sys.modules,
                  "torch": "torch" in sys.modules}))
"""


@pytest.mark.parametrize(("light", "expected"), [
    ("", {"imported": ["colorsys", "wave"], "colorsys": True, "torch": False}),
    ("1", {"imported": [], "colorsys": False, "torch": False}),
])
def test_the_preloaded_gate_imports_the_list_unless_the_worker_is_light(
        light: str, expected: dict[str, Any]) -> None:
    """A module that fails to import is skipped, as in Ray's own preload."""
    env = {**os.environ, "_EMBER_WARM_IMPORTS": "colorsys,no_such_module_here,wave",
           "_EMBER_LIGHT_WORKER": light}
    assert _run_json(_GATE, env) == expected


def test_the_heap_is_frozen_after_every_other_preload_even_if_an_app_names_it() -> None:
    modules = preload_modules(["ember.control.settle_heap", "ember.control.s3_warm", "apps.core"])
    assert modules[-4:] == ["apps.core", "ember.control.torch_warm", "ember.control.s3_warm",
                            "ember.control.settle_heap"]


_TORCH_PROBE = """
import json, sys
import ember.control.warm_imports as gate
import ember.control.torch_warm as warm
print(json.dumps({"torch": "torch" in sys.modules, "exercised": warm._torch is not None}))
"""


@pytest.mark.parametrize(("app_modules", "torch"), [(["colorsys"], False),
                                                    (["safetensors.torch"], True)])
def test_idle_workers_hold_torch_only_when_the_apps_modules_import_it(
        app_modules: list[str], torch: bool) -> None:
    # In a fresh interpreter, as a worker the raylet starts: an app that uses no torch keeps
    # its idle workers free of it (a second of CPU and about 170 MB each).
    env = {**os.environ, **worker_env(app_modules)}
    assert _run_json(_TORCH_PROBE, env) == {"torch": torch, "exercised": torch}


_PROBE = """
import json, sys
{before}
import ember.control.s3_warm as warm
from ember.loaders import _source_s3
print(json.dumps({{"warmed": bool(warm.WARMED), "botocore": "botocore" in sys.modules,
                   "session": _source_s3._botocore_session is not None}}))
"""


def _run_json(code: str, env: dict[str, str] | None = None) -> Any:
    """Run ``code`` in a fresh interpreter on this checkout's ``src``; its last line, parsed."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _probe(before: str) -> dict[str, bool]:
    return dict(_run_json(_PROBE.format(before=before)))


@pytest.mark.parametrize(("before", "expected"), [
    ("import botocore.session", {"warmed": True, "botocore": True, "session": True}),
    ("", {"warmed": False, "botocore": False, "session": False}),
])
def test_a_worker_warms_the_s3_client_only_when_its_imports_brought_botocore(
    before: str, expected: dict[str, bool]
) -> None:
    assert _probe(before) == expected


def test_an_app_names_modules_its_setup_imports_and_the_workers_preload_them() -> None:
    from ember.app.app import App
    from ember.app.decorator import deployment
    from ember.cluster.runtime import app_modules

    @deployment(route="/ping")
    class Ping:
        def __call__(self) -> str:
            return "pong"

    app = App([Ping], preload_modules=("transformers.modeling_utils",))
    assert app_modules(app) == [Ping.__module__, "transformers.modeling_utils"]
    assert "transformers.modeling_utils" in preload_modules(app_modules(app))


@pytest.mark.parametrize("names", ["peft", ["peft", "torch,numpy"], ["../x"], [3]])
def test_preload_modules_must_be_a_list_of_module_names(names: Any) -> None:
    """A lone string would read as one module per letter; Ray splits the list on commas."""
    from ember.app.app import App
    from ember.app.decorator import deployment
    from ember.errors import ConfigError

    @deployment(route="/ping")
    class Ping:
        def __call__(self) -> str:
            return "pong"

    with pytest.raises(ConfigError, match="preload_modules"):
        App([Ping], preload_modules=names)


_SETUP_IMPORTS = """
import json, sys
import {module}
before = set(sys.modules)
{call}
print(json.dumps(sorted(set(sys.modules) - before)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("module,call", [
    # Only the architecture's own module (transformers.models.llama.*) is left for setup().
    ("ember.deployments.causal_lm",
     "ember.deployments.causal_lm.build_on_meta({'model_type': 'llama', 'hidden_size': 64, "
     "'intermediate_size': 128, 'num_hidden_layers': 1, 'num_attention_heads': 2, "
     "'num_key_value_heads': 2, 'vocab_size': 128})"),
    ("ember.deployments._textgen_hf",
     "from transformers import AutoModelForCausalLM, LlamaConfig\n"
     "AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=64, intermediate_size=128, "
     "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=128))"),
])
def test_a_transformers_deployment_module_leaves_its_setup_only_the_architecture(
    module: str, call: str
) -> None:
    """transformers' names are lazy: without the eager imports (``_hf_preload``) a first
    model build imports hundreds of modules, seconds of CPU on a cold replica's path."""
    imported = _run_json(_SETUP_IMPORTS.format(module=module, call=call))
    assert all(m.startswith("transformers.models.llama") for m in imported), imported


@pytest.mark.slow
@pytest.mark.parametrize("served,preloaded", [
    ({}, []),
    ({"EMBER_TEXTGEN_MODEL": "/models/qwen2-0.5b"}, ["ember.deployments._textgen_hf"]),
    ({"EMBER_TEXTGEN_MODEL": "/models/qwen2-0.5b", "EMBER_TEXTGEN_ADAPTERS": "a=file:///a"},
     ["ember.deployments._textgen_hf", "peft"]),
])
def test_the_textgen_app_preloads_the_transformers_backend_only_when_it_serves_one(
    served: dict[str, str], preloaded: list[str]
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_TEXTGEN_")}
    probe = ("import json\nfrom ember.deployments.textgen import app\n"
             "from ember.cluster.runtime import app_modules\n"
             "print(json.dumps(app_modules(app)))")
    modules = _run_json(probe, {**env, **served})
    assert modules == sorted(["ember.deployments.textgen", *preloaded]), modules


class _Clock:
    """Time that moves only when the refiller waits (its ``_stop.wait``)."""

    def __init__(self, waits: int) -> None:
        self.now, self.waits = 0.0, waits

    def monotonic(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.now += seconds
        self.waits -= 1
        return self.waits == 0  # True: stop


class _Worker:
    """A fake worker process whose CPU time is ``share(t)`` of a core, summed to now."""

    def __init__(self, pid: int, clock: _Clock, share: Callable[[float], float]) -> None:
        self.pid, self._clock, self._share = pid, clock, share

    def cpu_times(self) -> Any:
        from types import SimpleNamespace

        steps = int(self._clock.now * 100)
        return SimpleNamespace(user=sum(self._share(k / 100) for k in range(steps)) / 100,
                               system=0.0)


def _refill_times(monkeypatch: pytest.MonkeyPatch, counts: Sequence[int | list[int]],
                  busy: Callable[[float], float], taken: Callable[[float], float] = lambda t: 0.0,
                  ) -> list[tuple[int, float]]:
    """Run a refiller keeping 2 idle workers on a fake clock over ``counts`` (one a count:
    how many idle, or which of the workers 1, 2 and 3 are); ``busy(t)`` is the node's busy
    share at time ``t``, ``taken(t)`` the share of a core worker 2 uses at ``t`` (it is the
    one a count of 1 finds taken). Returns (workers, t) per prestart."""
    from types import SimpleNamespace

    from ember.control import warm_runtime

    left = iter(counts)
    clock, prestarted = _Clock(waits=len(counts)), []
    used = {"t": 0.0, "busy_s": 0.0}
    workers = [_Worker(1, clock, lambda t: 0.0), _Worker(2, clock, taken),
               _Worker(3, clock, lambda t: 0.0)]

    def idle() -> list[_Worker]:
        count = next(left)
        return workers[:count] if isinstance(count, int) else [workers[i - 1] for i in count]

    def cpu_seconds() -> tuple[float, float]:  # two cores: 2 s of CPU time a second
        # The share since the last call is the one at that call's time.
        used["busy_s"] += busy(used["t"]) * 2 * (clock.now - used["t"])
        used["t"] = clock.now
        return used["busy_s"], 2 * clock.now

    monkeypatch.setattr(warm_runtime, "idle_worker_processes", idle)
    monkeypatch.setattr(warm_runtime, "prestart", lambda n: prestarted.append((n, clock.now)))
    monkeypatch.setattr(warm_runtime, "time", SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(warm_runtime, "cpu_seconds", cpu_seconds)
    refiller = warm_runtime.Refiller(idle=2)
    monkeypatch.setattr(refiller, "_stop", SimpleNamespace(wait=clock.wait))
    refiller._run()
    return prestarted


def test_a_worker_taken_while_the_count_backs_off_is_refilled_no_later_than_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The grace before a refill runs from the last count that still saw the worker, so a
    count backed off to 4 s does not add its period to the refill."""
    # One worker taken between t=7 s and t=11 s, on an idle node.
    prestarted = _refill_times(monkeypatch, [2, 2, 2, 2, 1, 1, 2], busy=lambda t: 0.1)
    # Counted at 0, 1, 3, 7 (backing off), then 11: missing since at most t=7, so the 3 s
    # grace is over; the cores are judged over the second after the count that found it
    # missing (the 4 s before say little of now), so it is started at t=12, not at t=14.
    assert prestarted == [(1, 12.0)]


def test_a_refill_judges_the_cores_after_the_worker_went_not_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The backed-off count spans 4 idle seconds; the cold start that took the worker began
    just before the count that finds it missing. Its busy cores defer the refill."""
    prestarted = _refill_times(monkeypatch, [2, 2, 2, 2, 1, 1, 1, 1, 2, 2],
                               busy=lambda t: 0.95 if 10.5 <= t < 13 else 0.1)
    # The share over (7, 11] is mostly idle, but (11, 12] and (12, 13] are busy.
    assert prestarted == [(1, 14.0)]


def test_a_refill_waits_while_the_cold_start_that_took_the_worker_keeps_the_cores_busy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the grace, a node whose cores are busy (a replica still loading its weights)
    gets its new worker only once they quieten; and at most 20 s after it went missing."""
    # Taken between t=7 and t=11; the cores are busy until t=15, then idle.
    prestarted = _refill_times(monkeypatch, [2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 2, 2],
                               busy=lambda t: 0.95 if t < 15 else 0.1)
    # Counted at 11, 12, 13, 14, 15 (busy throughout), 16: the share since t=15 is idle.
    assert prestarted == [(1, 16.0)]
    # A node that stays busy gets it 20 s after the last count that saw the worker (t=7).
    prestarted = _refill_times(monkeypatch, [2, 2, 2, 2, *[1] * 17, 2, 2], busy=lambda t: 0.95)
    assert prestarted == [(1, 27.0)]


def test_a_refill_waits_while_the_worker_taken_is_busy_though_the_node_is_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica reading its weights from disk (cores idle in iowait) and then running a
    single-threaded first forward (one core of many) leaves the node's share low; the
    worker it took says its cold start is not over."""
    # Taken between t=7 and t=11; it uses 0.5 of a core until t=17, then 1%.
    prestarted = _refill_times(monkeypatch, [2, 2, 2, 2, *[1] * 9, 2, 2],
                               busy=lambda t: 0.3, taken=lambda t: 0.5 if t < 17 else 0.01)
    # Counted at 11..17 with the worker busy; the count at 18 sees it quiet since 17.
    assert prestarted == [(1, 18.0)]
    # Without the taken worker's share the node's 0.3 lets it in at t=12.
    prestarted = _refill_times(monkeypatch, [2, 2, 2, 2, 1, 1, 2, 2], busy=lambda t: 0.3)
    assert prestarted == [(1, 12.0)]
    # A worker that stays busy (a replica under steady traffic) gets its refill at the cap.
    prestarted = _refill_times(monkeypatch, [2, 2, 2, 2, *[1] * 17, 2, 2],
                               busy=lambda t: 0.3, taken=lambda t: 0.5)
    assert prestarted == [(1, 27.0)]


def test_a_worker_taken_while_the_node_kept_its_count_never_defers_a_later_refill(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 2 leaves while a worker Ray started itself (3) keeps the count at 2: no refill
    waits on worker 2 (a replica busy with traffic), so the next one is not held to the cap."""
    prestarted = _refill_times(monkeypatch, [[1, 2], [1, 2], [1, 3], [1, 3], [3], [3], [3],
                                             [3], [1, 3]],
                               busy=lambda t: 0.3, taken=lambda t: 0.9)
    # Counted at 0, 1, 3 (worker 2 gone, the count still full), 7, then 11: worker 1 taken
    # since t=7 and quiet, so its refill comes at the next count, t=12, not at the cap (27).
    assert prestarted == [(1, 12.0)]
