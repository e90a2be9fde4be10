"""The committed diagrams, table and README diagram are exactly what the code generates now.

Scenario: someone changes the lifecycle table (or a diagram's code) and forgets
the docs. These tests regenerate everything in memory and fail with the one
command that fixes it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlife import diagrams

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "docs" / "generated"
FIX = "python -m kvlife.diagrams --write docs/generated --readme README.md"


@pytest.mark.parametrize("name", sorted(diagrams.generated_files()))
def test_committed_generated_file_matches_code(name: str) -> None:
    path = GENERATED / name
    assert path.is_file(), f"docs/generated/{name} is missing; run: {FIX}"
    committed = path.read_text(encoding="utf-8")
    assert committed == diagrams.generated_files()[name], (
        f"docs/generated/{name} differs from what the code generates; run: {FIX}"
    )


def test_no_stale_files_in_generated() -> None:
    stale = {p.name for p in GENERATED.iterdir()} - set(diagrams.generated_files())
    assert not stale, f"docs/generated holds files nothing generates: {sorted(stale)}"


def test_readme_diagram_matches_code() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert diagrams.readme_with_diagram(readme) == readme, (
        f"README.md's lifecycle diagram differs from the code; run: {FIX}"
    )


def test_docs_pages_draw_nothing_by_hand() -> None:
    """Every mermaid fence in docs/*.md only includes a generated file."""
    fence = re.compile(r"```mermaid\n(.*?)```", re.DOTALL)
    for page in sorted((ROOT / "docs").glob("*.md")):
        for body in fence.findall(page.read_text(encoding="utf-8")):
            lines = [line for line in body.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("--8<--"), (
                f"{page.name} draws a mermaid diagram by hand; include docs/generated/ instead"
            )
            included = lines[0].split('"')[1]
            assert included in diagrams.generated_files(), f"{page.name} includes {included}"


def test_readme_quickstart_runs() -> None:
    """The README's python quickstart block runs as written."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    assert blocks, "README.md has no python quickstart"
    for block in blocks:
        exec(compile(block, "README.md quickstart", "exec"), {"__name__": "quickstart"})
