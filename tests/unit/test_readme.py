"""README's Python example is executed, so it cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import ember

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quickstart_has_exactly_two_command_lines() -> None:
    text = README.read_text()
    block = text.split("## Quickstart", 1)[1].split("```", 2)[1]
    lines = [line for line in block.splitlines()[1:] if line.strip()]
    assert lines == ["make run", "make test"]


def test_api_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    app = namespace["app"]
    assert isinstance(app, ember.App)
    assert [r.path for r in app.routes()] == ["/embed", "/embed/info", "/lengths"]
    assert [r.kind for r in app.routes()] == ["model", "none", "batch"]
