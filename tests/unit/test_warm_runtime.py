"""What a warm-runtime worker preloads (the live path is tested under `ember run`, in e2e)."""

from __future__ import annotations

from ember.control.warm_runtime import system_config


def test_every_worker_preloads_torch_serves_replica_and_the_apps_modules_once() -> None:
    config = system_config(["apps.core", "__main__", "torch", "apps.core"])
    assert config == {"preload_python_modules": [
        "torch", "ember.control.torch_warm", "ray.serve._private.replica",
        "ember.control.replica", "apps.core", "ember.control.settle_heap"]}


def test_the_heap_is_frozen_after_every_other_preload_even_if_an_app_names_it() -> None:
    modules = system_config(["ember.control.settle_heap", "apps.core"])
    assert modules["preload_python_modules"][-2:] == [
        "apps.core", "ember.control.settle_heap"]
