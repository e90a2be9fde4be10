"""The committed diagrams, table and README diagram are exactly what the code generates now,
and the docs site shows them as pictures without a network.

Scenario: someone changes the lifecycle table (or a diagram's code) and forgets
the docs. These tests regenerate everything in memory and fail with the one
command that fixes it (``python tests/docs_gen.py``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import docs_gen

from kvlife import TABLE, State

ROOT = docs_gen.ROOT
GENERATED = docs_gen.GENERATED
FIX = docs_gen.FIX


@pytest.mark.parametrize("name", sorted(docs_gen.generated_files()))
def test_committed_generated_file_matches_code(name: str) -> None:
    path = GENERATED / name
    assert path.is_file(), f"docs/generated/{name} is missing; run: {FIX}"
    committed = path.read_text(encoding="utf-8")
    assert committed == docs_gen.generated_files()[name], (
        f"docs/generated/{name} differs from what the code generates; run: {FIX}"
    )


def test_lifecycle_svg_is_drawn_from_the_table_the_code_runs() -> None:
    """The committed picture was made from today's dot source; it names every state and arc."""
    svg = (GENERATED / "lifecycle.svg").read_text(encoding="utf-8")
    assert docs_gen.svg_stamp(svg) == docs_gen.dot_sha256(), (
        f"docs/generated/lifecycle.svg was drawn from another table; run: {FIX}"
    )
    for state in State:
        assert f">{state.name}</text>" in svg
    for row in TABLE:
        label = row.event.value + (f" [{row.guard}]" if row.guard else "")
        assert f">{label}</text>" in svg, label
    drawn_by = docs_gen.graphviz_version(svg)
    if drawn_by is not None and drawn_by == docs_gen.installed_graphviz_version():
        assert svg == docs_gen.lifecycle_svg(), f"run: {FIX}"


def test_no_stale_files_in_generated() -> None:
    present = {p.name for p in GENERATED.iterdir()}
    assert present == set(docs_gen.ALL_FILES), f"docs/generated differs; run: {FIX}"


def test_readme_diagram_matches_code() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert docs_gen.readme_with_diagram(readme) == readme, (
        f"README.md's lifecycle diagram differs from the code; run: {FIX}"
    )


def test_docs_pages_draw_nothing_by_hand() -> None:
    """No page holds a mermaid block (shown as raw source offline); every picture is generated."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        assert "```mermaid" not in text, f"{page.name}: use a generated SVG, not mermaid"
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
            assert image.startswith("generated/"), f"{page.name} shows {image}"
            assert image.removeprefix("generated/") in docs_gen.ALL_FILES, image


def test_race_notes_are_observed_values() -> None:
    """The rid-keyed half shows the new request corrupted; the kvlife half shows it untouched."""
    steps = docs_gen.race_steps()
    ends = [i for i, step in enumerate(steps) if step[0] == "end"]
    notes = [
        "\n".join(s[2] for s in steps[a:b] if s[0] == "note")
        for a, b in ((0, ends[0]), (ends[0], ends[1]))
    ]
    rid_half, kvlife_half = notes
    assert "request 2 now has inflight=0, last_hash=" in rid_half
    assert "its own chunk is still in flight" in rid_half
    assert "device pages freed" in rid_half and "ack dropped" in rid_half
    assert "untouched: OFFLOADING, inflight=1, last_hash=None" in kvlife_half
    assert "refused: ForeignAck, B unchanged" in kvlife_half
    assert "release callbacks ran for A, B" in kvlife_half


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="needs the docs extra")
def test_site_shows_the_diagrams_without_a_network(tmp_path: Path) -> None:
    """``mkdocs build --strict``: the pages show the generated SVGs, and no page needs mermaid."""
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    shown: dict[str, set[str]] = {}
    for page in ("lifecycle/index.html", "index.html"):
        html = (site / page).read_text(encoding="utf-8")
        assert 'class="mermaid"' not in html and "mermaid.min.js" not in html, page
        for src in re.findall(r'<img[^>]*\bsrc="([^"]+\.svg)"', html):
            target = (site / page).parent / src
            assert target.is_file(), f"{page} shows {src}, which the site lacks"
            assert "<svg" in target.read_text(encoding="utf-8")
            shown.setdefault(page, set()).add(target.name)
    assert shown == {"lifecycle/index.html": {"lifecycle.svg"}, "index.html": {"race.svg"}}


def test_readme_quickstart_runs() -> None:
    """The README's python quickstart block runs as written."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    assert blocks, "README.md has no python quickstart"
    for block in blocks:
        exec(compile(block, "README.md quickstart", "exec"), {"__name__": "quickstart"})


def test_generator_writes_what_the_tests_compare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python tests/docs_gen.py`` writes every file the checks above compare."""
    if shutil.which("dot") is None:
        pytest.skip("lifecycle.svg needs Graphviz dot")
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    monkeypatch.setattr(docs_gen, "ROOT", tmp_path)
    monkeypatch.setattr(docs_gen, "GENERATED", tmp_path / "docs" / "generated")
    assert docs_gen.main() == 0
    assert {p.name for p in (tmp_path / "docs" / "generated").iterdir()} == set(docs_gen.ALL_FILES)
    assert readme.read_text(encoding="utf-8") == (ROOT / "README.md").read_text(encoding="utf-8")
