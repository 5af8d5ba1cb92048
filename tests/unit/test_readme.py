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


#: Pages other changes write; the README links them ahead of their arrival.
PAGES_TO_COME = {"docs/benchmarks.md", "docs/coldstart-sizes.md", "docs/operations.md",
                 "docs/operator-state.md", "docs/generation.md", "docs/testing.md",
                 "docs/ray-compat.md"}


def test_the_readme_is_short_and_the_rest_is_in_docs() -> None:
    text = README.read_text()
    assert text.count("\n") < 300
    for heading in ("## Quickstart", "## What Ember does", "## API", "## CLI",
                    "## Headline figures", "## Limits"):
        assert heading in text


def test_every_link_of_the_readme_and_docs_leads_to_a_file() -> None:
    root = README.parent
    for page in [README, *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith("http"):
                continue
            path = (page.parent / target).resolve()
            assert path.exists() or str(path.relative_to(root)) in PAGES_TO_COME, (page, target)


def test_every_headline_figure_names_its_command_and_a_committed_result() -> None:
    # Each headline table is marked with its committed results file (whose cells
    # test_readme_figures.py checks) and preceded by the command that reproduces it.
    section = README.read_text().split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"<!--\s*figures:\s*(\S+)\s*-->", section)
    results, preambles = parts[1::2], parts[0::2][:-1]
    assert len(results) >= 3
    for result, preamble in zip(results, preambles, strict=True):
        assert (README.parent / result).is_file(), result
        intro = preamble.rsplit("\n|", 1)[-1]  # the text since the previous table
        scripts = re.findall(r"`[^`]*?((?:bench|tests)/[\w/]+\.py)[^`]*`", intro)
        assert scripts, f"no command before the table of {result}"
        assert all((README.parent / script).is_file() for script in scripts), scripts

