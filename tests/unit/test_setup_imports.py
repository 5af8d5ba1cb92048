"""A replica counts what its constructor and setup() imported, and says so past a few."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

from ember.app.decorator import deployment, get_spec
from ember.control.replica import SETUP_IMPORTS_TOLD, instantiate


def _package(root: Path, name: str, modules: int) -> None:
    """A package whose import brings ``modules`` submodules along."""
    folder = root / name
    folder.mkdir()
    (folder / "__init__.py").write_text(
        "".join(f"from {name} import m{i}\n" for i in range(modules)))
    for i in range(modules):
        (folder / f"m{i}.py").write_text("VALUE = 1\n")


@pytest.mark.parametrize(("modules", "told"), [(2, False), (SETUP_IMPORTS_TOLD + 5, True)])
def test_setup_imports_are_counted_and_many_are_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    modules: int, told: bool,
) -> None:
    name = f"lazy_lib_{modules}"
    _package(tmp_path, name, modules)
    monkeypatch.syspath_prepend(str(tmp_path))

    @deployment(route="/lazy")
    class Lazy:
        def setup(self) -> None:
            __import__(name)  # as transformers loads its model code in the first call

        def __call__(self) -> str:
            return "ok"

    try:
        with caplog.at_level(logging.WARNING, logger="ember.replica"):
            core = asyncio.run(instantiate(get_spec(Lazy)))
    finally:
        for module in [m for m in sys.modules if m.partition(".")[0] == name]:
            del sys.modules[module]
    # The package and its modules, and whatever the first call in a thread imports.
    assert core.timeline is not None
    assert modules + 1 <= core.timeline.setup_imports <= modules + 5, core.timeline
    warned = [r.getMessage() for r in caplog.records if "imported" in r.getMessage()]
    assert bool(warned) is told, warned
    if told:
        assert f"mostly {name}" in warned[0] and "App(preload=" in warned[0]
