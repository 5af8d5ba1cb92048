"""A replica says when its constructor and setup() imported many modules: on a cold path."""

from __future__ import annotations

import asyncio
import logging
import re
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


@pytest.mark.parametrize(("modules", "prewarmed", "told"), [
    (2, False, False),
    (SETUP_IMPORTS_TOLD + 5, False, True),
    # A pool process builds several deployments at once: its counts would mix them.
    (SETUP_IMPORTS_TOLD + 5, True, False),
])
def test_a_setup_that_imports_many_modules_is_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    modules: int, prewarmed: bool, told: bool,
) -> None:
    name = f"lazy_lib_{modules}_{prewarmed}"
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
            asyncio.run(instantiate(get_spec(Lazy), prewarmed=prewarmed))
    finally:
        for module in [m for m in sys.modules if m.partition(".")[0] == name]:
            del sys.modules[module]
    warned = [r.getMessage() for r in caplog.records if "imported" in r.getMessage()]
    assert bool(warned) is told, warned
    if told:
        counted = int(re.findall(r"imported (\d+) modules", warned[0])[0])
        # The package and its modules, and whatever a first call in a thread imports.
        assert modules + 1 <= counted <= modules + 5, warned[0]
        assert f"mostly {name}" in warned[0] and "App(preload_modules=" in warned[0]
