"""What a warm-runtime worker preloads (the live path is tested under `ember run`, in e2e)."""

from __future__ import annotations

from ember.platform.control.warm_runtime import preload_modules, system_config


def test_every_worker_preloads_torch_serves_replica_and_the_apps_modules_once() -> None:
    modules = preload_modules(["apps.core", "__main__", "torch", "apps.core"])
    assert modules[0] == "torch" and "ray.serve._private.replica" in modules
    assert modules[-1] == "apps.core" and modules.count("apps.core") == 1
    assert "__main__" not in modules and modules.count("torch") == 1
    assert system_config(["apps.core"]) == {"preload_python_modules": modules_of("apps.core")}


def modules_of(app_module: str) -> list[str]:
    return preload_modules([app_module])
