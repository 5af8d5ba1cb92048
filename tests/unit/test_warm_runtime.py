"""What a warm-runtime worker preloads (the live path is tested under `ember run`, in e2e)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember.control.warm_runtime import system_config

SRC = Path(__file__).resolve().parents[2] / "src"


def test_every_worker_preloads_torch_serves_replica_and_the_apps_modules_once() -> None:
    config = system_config(["apps.core", "__main__", "torch", "apps.core"])
    assert config == {"preload_python_modules": [
        "torch", "ember.control.torch_warm", "ray.serve._private.replica",
        "ember.control.replica", "apps.core", "ember.control.s3_warm",
        "ember.control.settle_heap"]}


def test_the_heap_is_frozen_after_every_other_preload_even_if_an_app_names_it() -> None:
    modules = system_config(["ember.control.settle_heap", "ember.control.s3_warm", "apps.core"])
    assert modules["preload_python_modules"][-3:] == [
        "apps.core", "ember.control.s3_warm", "ember.control.settle_heap"]


_PROBE = """
import json, sys
{before}
import ember.control.s3_warm as warm
from ember.loaders import _source_s3
print(json.dumps({{"warmed": bool(warm.WARMED), "botocore": "botocore" in sys.modules,
                   "session": _source_s3._botocore_session is not None}}))
"""


def _probe(before: str) -> dict[str, bool]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", _PROBE.format(before=before)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(("before", "expected"), [
    ("import botocore.session", {"warmed": True, "botocore": True, "session": True}),
    ("", {"warmed": False, "botocore": False, "session": False}),
])
def test_a_worker_warms_the_s3_client_only_when_its_imports_brought_botocore(
    before: str, expected: dict[str, bool]
) -> None:
    assert _probe(before) == expected
