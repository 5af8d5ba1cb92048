"""Packaging guards: the stdlib ``platform`` is not shadowed; the public surface is small."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ember

ROOT = Path(__file__).resolve().parents[2]


def test_stdlib_platform_imports_from_repository_root() -> None:
    code = "import platform, uuid; print(platform.system())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "Linux"


def test_public_surface_is_listed() -> None:
    assert set(ember.__all__) >= {"App", "deployment", "route", "serve", "errors"}
    for name in ember.__all__:
        assert hasattr(ember, name), name
