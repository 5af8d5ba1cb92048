"""``make test``'s lanes hold every test module exactly once, so none is silently left out."""

from __future__ import annotations

import fnmatch
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_lanes() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lanes", ROOT / "tests" / "lanes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lanes"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def sessions_holding(lanes: ModuleType, test_id: str) -> list[str]:
    """The sessions whose arguments select ``test_id`` (a module path or a node id)."""
    holders = []
    for session in (s for lane in lanes.lanes() for s in lane):
        args = list(session.args)
        ignored = [a.split("=", 1)[1] for a in args if a.startswith("--ignore-glob=")]
        deselected = {args[i + 1] for i, a in enumerate(args) if a == "--deselect"}
        paths = [a for a in args if not a.startswith("-") and a not in deselected]
        chosen = any(test_id == p or test_id.startswith(p.rstrip("/") + "/")
                     or (test_id.startswith(p + "::")) for p in paths)
        if chosen and not any(fnmatch.fnmatch(test_id.split("::")[0], g) for g in ignored) \
                and test_id not in deselected:
            holders.append(session.name)
    return holders


def test_every_test_module_runs_in_exactly_one_session() -> None:
    lanes = load_lanes()
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    assert len(modules) > 50
    held = {module: sessions_holding(lanes, module) for module in modules}
    loadtest_module = lanes.LOADTEST.split("::")[0]
    # The load test's module is split: its short run in a session of its own, the rest with
    # the integration tests.
    assert sorted(held.pop(loadtest_module)) == ["integration"]
    assert sessions_holding(lanes, lanes.LOADTEST) == ["loadtest"]
    assert {module: names for module, names in held.items() if len(names) != 1} == {}


def test_the_deselected_load_test_exists() -> None:
    lanes = load_lanes()
    module, name = lanes.LOADTEST.split("::")
    assert f"def {name}(" in (ROOT / module).read_text()
