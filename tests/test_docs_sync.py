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
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import docs_gen

from kvlife import TABLE, State
from kvlife.diagrams import lifecycle_dot, row_label

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
        assert f">{row_label(row)}</text>" in svg, row_label(row)
    drawn_by = docs_gen.graphviz_version(svg)
    if drawn_by is not None and drawn_by == docs_gen.installed_graphviz_version():
        assert svg == docs_gen.lifecycle_svg(), f"run: {FIX}"


# ------------------------------------------------------------------ readable at the docs' width

#: The docs' content column, in CSS px: mkdocs-material's 61rem grid (20 px a rem) less
#: its two 12.1rem sidebars and the content's 1.2rem margins, on a desktop screen. An
#: image wider than this is scaled down to it.
DOCS_WIDTH_PX = 688
#: The smallest label size, in CSS px, the page may show (its body text is 16 px).
MIN_LABEL_PX = 12.0

_SVG = "{http://www.w3.org/2000/svg}"
#: Helvetica/Arial advance widths, in thousandths of an em, of the characters the labels
#: use that are not 556 (lowercase and digits) or about 700 (capitals).
_ADVANCE = (
    dict.fromkeys(" !'[].,:;|ftI", 278)
    | dict.fromkeys("ijl", 222)
    | dict.fromkeys("r()-", 333)
    | dict.fromkeys("ckvsxyz", 500)
    | {"m": 833, "w": 722, "M": 833, "W": 944}
)

Box = tuple[float, float, float, float]  # x0, y0, x1, y1


def _text_width(text: str, size: float) -> float:
    return size / 1000 * sum(_ADVANCE.get(c, 700 if c.isupper() else 556) for c in text)


def _points(text: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in re.findall(r"(-?[\d.]+),(-?[\d.]+)", text)]


def _curve(points: list[tuple[float, float]], steps: int = 24) -> list[tuple[float, float]]:
    """Points along a path of cubic Bezier segments (Graphviz's ``M p C p p p p p p ...``)."""
    out = points[:1]
    for i in range(1, len(points) - 2, 3):
        p0, p1, p2, p3 = points[i - 1 : i + 3]
        for k in range(1, steps + 1):
            t = k / steps
            u = 1 - t
            out.append(
                (
                    u**3 * p0[0] + 3 * u * u * t * p1[0] + 3 * u * t * t * p2[0] + t**3 * p3[0],
                    u**3 * p0[1] + 3 * u * u * t * p1[1] + 3 * u * t * t * p2[1] + t**3 * p3[1],
                )
            )
    return out


def svg_layout(
    svg: str,
) -> tuple[list[tuple[str, float, Box]], list[Box], list[list[tuple[float, float]]]]:
    """A Graphviz SVG's arc labels (text, font size, box), states (boxes) and arcs (points)."""
    root = ET.fromstring(svg[svg.index("<svg") :])
    labels: list[tuple[str, float, Box]] = []
    states: list[Box] = []
    arcs: list[list[tuple[float, float]]] = []
    for group in root.iter(f"{_SVG}g"):
        kind = group.get("class")
        if kind == "edge":
            for text in group.iter(f"{_SVG}text"):
                size, x, y = (float(text.get(a, "0")) for a in ("font-size", "x", "y"))
                width = _text_width(text.text or "", size)
                anchor = text.get("text-anchor", "start")
                x0 = {"start": x, "middle": x - width / 2, "end": x - width}[anchor]
                labels.append(
                    (text.text or "", size, (x0, y - 0.75 * size, x0 + width, y + 0.2 * size))
                )
            arcs += [_curve(_points(p.get("d", ""))) for p in group.iter(f"{_SVG}path")]
            arcs += [_points(p.get("points", "")) for p in group.iter(f"{_SVG}polygon")]
        elif kind == "node":
            for shape in [*group.iter(f"{_SVG}path"), *group.iter(f"{_SVG}polygon")]:
                if shape.get("fill") not in (None, "none"):
                    pts = _points(shape.get("d") or shape.get("points") or "")
                    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                    states.append((min(xs), min(ys), max(xs), max(ys)))
    return labels, states, arcs


def svg_overlaps(svg: str, margin: float = 1.0) -> list[str]:
    """Where an arc label of a Graphviz SVG meets another label, a state or an arc."""
    labels, states, arcs = svg_layout(svg)

    def meet(a: Box, b: Box) -> bool:
        return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]

    def inside(p: tuple[float, float], b: Box) -> bool:
        return b[0] + margin < p[0] < b[2] - margin and b[1] + margin < p[1] < b[3] - margin

    found = []
    for i, (text, _, box) in enumerate(labels):
        found += [f"{text!r} overlaps {other!r}" for other, _, o in labels[i + 1 :] if meet(box, o)]
        found += [f"{text!r} overlaps a state" for state in states if meet(box, state)]
        if any(inside(p, box) for arc in arcs for p in arc):
            found.append(f"an arc crosses {text!r}")
    return found


def smallest_label_px(svg: str, page_px: float = DOCS_WIDTH_PX) -> float:
    """The smallest arc label's size in CSS px when the SVG is shown at most ``page_px`` wide."""
    found = re.search(r'<svg width="([\d.]+)pt"', svg)
    assert found, "lifecycle.svg has no width in pt"
    natural_px = float(found.group(1)) * 4 / 3
    scale = min(1.0, page_px / natural_px)
    return min(size for _, size, _ in svg_layout(svg)[0]) * 4 / 3 * scale


def test_lifecycle_dot_draws_one_arc_and_one_label_per_pair_of_states() -> None:
    """A self-loop per row put four labels on OFFLOADING's loops; now each pair of states
    has one arc whose label lists its rows, one per line."""
    arcs = Counter(re.findall(r"^  (\w+) -> (\w+)\b", lifecycle_dot(), re.MULTILINE))
    assert arcs == Counter(
        {(r.source.name, r.dest.name): 1 for r in TABLE} | {("__start", "IDLE"): 1}
    )


def test_lifecycle_svg_is_readable_at_the_docs_width() -> None:
    """At the docs' content width, every arc label is at least 12 px and meets no other
    label, no state and no arc (boxes from Helvetica's widths; no Graphviz needed)."""
    svg = (GENERATED / "lifecycle.svg").read_text(encoding="utf-8")
    assert smallest_label_px(svg) >= MIN_LABEL_PX, f"labels too small at {DOCS_WIDTH_PX} px"
    assert svg_overlaps(svg) == []


def test_the_overlap_check_sees_an_overlap() -> None:
    """Two labels drawn on one spot, and an arc through a label, are found."""
    svg = (
        '<svg width="100pt" height="50pt" xmlns="http://www.w3.org/2000/svg"><g class="edge">'
        '<path fill="none" d="M0,-5C20,-5 40,-5 60,-5"/>'
        '<text text-anchor="middle" x="30" y="-2" font-size="11.00">load</text>'
        '<text text-anchor="middle" x="32" y="-3" font-size="11.00">submit</text></g></svg>'
    )
    assert svg_overlaps(svg) == [
        "'load' overlaps 'submit'",
        "an arc crosses 'load'",
        "an arc crosses 'submit'",
    ]
    assert smallest_label_px(svg) == pytest.approx(11 * 4 / 3)


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
