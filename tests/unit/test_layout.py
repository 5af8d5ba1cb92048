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


def test_imports_run_one_way() -> None:
    # import-linter's contracts live in pyproject.toml: cli -> offline -> platform -> loaders
    # -> settings -> errors, and ember.control never imports ember.edge.
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


def test_a_module_that_breaks_the_direction_is_caught(tmp_path: Path) -> None:
    # The contract can fail: the same configuration over a copy of the package in which the
    # error tree imports the CLI is reported broken.
    import shutil

    shutil.copytree(ROOT / "src" / "ember", tmp_path / "ember")
    bad = tmp_path / "ember" / "errors" / "_base.py"
    bad.write_text(bad.read_text() + "\nimport ember.cli  # noqa\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, capture_output=True,
                         text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "ember.errors._base -> ember.cli" in out.stdout


def test_underscore_modules_are_imported_only_inside_their_package() -> None:
    # An underscore means private and nothing else: no module outside a package (tests
    # aside) imports that package's underscore modules.
    import ast

    src = ROOT / "src"
    offenders = []
    for path in src.rglob("*.py"):
        module = ".".join(path.relative_to(src).with_suffix("").parts)
        package = module.removesuffix(".__init__").rsplit(".", 1)[0]
        if path.name == "__init__.py":
            package = module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if not name.startswith("ember."):
                    continue
                parts = name.split(".")
                private = [i for i, p in enumerate(parts) if p.startswith("_")]
                if private and not package.startswith(".".join(parts[: private[0]])):
                    offenders.append(f"{module} imports {name}")
    assert offenders == []
