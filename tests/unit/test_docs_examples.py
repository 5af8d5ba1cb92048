"""Every ``python`` block of README.md and docs/*.md runs, so the examples cannot rot.

A block that needs a running server starts with a ``# needs: ...`` comment saying what; it is
skipped here with that reason shown (``-ra``). Every other block (declaring deployments and
apps, configuration) runs in a fresh namespace and must not raise.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_NEEDS = re.compile(r"^# needs: (.+)$", re.M)


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for index, block in enumerate(_BLOCK.findall(page.read_text())):
            found.append((f"{page.relative_to(ROOT)}#{index + 1}", block))
    return found


BLOCKS = _blocks()


def test_the_pages_hold_examples() -> None:
    # A change to the fence syntax must not turn this file into a silent no-op.
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_the_example_runs(where: str, code: str) -> None:
    needs = _NEEDS.search(code)
    if needs:
        pytest.skip(f"{where} needs {needs.group(1)}")
    exec(compile(code, where, "exec"), {"__name__": f"docs_example_{len(where)}"})
