"""The docs' generated files (``docs/generated``), made from the code: ``python tests/docs_gen.py``.

Docs tooling, not shipped. The docs site shows pictures that need no network
(no mermaid.js from a CDN), so every diagram is an SVG made here:

* ``lifecycle.svg`` -- :func:`kvlife.diagrams.lifecycle_dot` (written from the
  table) through Graphviz's ``dot``, stamped with the SHA-256 of that dot source
  so ``tests/test_docs_sync.py`` can tell a stale picture without Graphviz;
* ``table.md`` -- the transition table (:func:`kvlife.diagrams.table_markdown`);
* ``guards.md`` -- each guard of the table, by what it holds for: every guard
  evaluated on the nine in-flight classes the table is compiled over
  (:func:`guards_markdown`), so the docs cannot describe a guard the code lacks;
* ``race.svg`` -- the reused-rid race, *run*: once against the rid-keyed straw
  man (:class:`rid_keyed_manager.RidKeyedBook`), once against real
  :class:`~kvlife.Lifecycle` objects; every note shows a value observed in that
  run, and the sequence diagram is drawn by :func:`sequence_svg` (plain Python).

The README keeps the lifecycle as a mermaid block (GitHub draws it); it is
regenerated here too.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from html import escape
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rid_keyed_manager import RidKeyedBook

from kvlife import FinishReason, Lifecycle, LifecycleError
from kvlife._lifecycle import GUARDS, INFLIGHT_CLASSES, TABLE
from kvlife.diagrams import dot_to_image, lifecycle_dot, lifecycle_mermaid, table_markdown

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "docs" / "generated"
FIX = "python tests/docs_gen.py"

# ------------------------------------------------------------------ the reused-rid race

#: A step of a sequence diagram: ("msg", src, dst, text, arrow) with arrow "->>" (call),
#: "-->>" (reply) or "-)" (async); ("note", over, text) with "<br/>" between lines;
#: ("begin", rgb) and ("end",) around a shaded section.
Step = tuple[str, ...]

PARTICIPANTS = {
    "S": "Scheduler",
    "E": "Copy engine",
    "M": "state[rid] (rid-keyed runtime)",
    "A": "Lifecycle A (rid r1)",
    "B": "Lifecycle B (rid r1)",
}


def _short(key: str | None) -> str:
    return "None" if key is None else key[:8]


def _life(life: Lifecycle) -> str:
    snap = life.snapshot()
    return f"{snap.state.name}, inflight={snap.inflight}, last_hash={_short(snap.last_hash)}"


def race_steps() -> list[Step]:
    """The reused-rid race, run against the rid-keyed book and against kvlife."""
    page_size, rid = 4, "r1"
    old_tokens, new_tokens = [11, 12, 13, 14], [21, 22, 23, 24]
    steps: list[Step] = []

    def msg(src: str, dst: str, text: str, arrow: str = "->>") -> None:
        steps.append(("msg", src, dst, text, arrow))

    def note(over: str, text: str) -> None:
        steps.append(("note", over, text))

    # The rid-keyed straw man.
    book = RidKeyedBook(page_size=page_size)

    def entry() -> str:
        if rid not in book.inflight:
            return f"no state[{rid}]"
        return (
            f"inflight={book.inflight[rid]}, last_hash={_short(book.last_hash[rid])}, "
            f"finished={book.finished[rid]}"
        )

    def freed_by(call: str) -> str:
        return f"{call}: del state[{rid}], device pages freed"

    steps.append(("begin", "255, 236, 236"))
    note("S,M", "A runtime that keys offload state by rid")
    book.begin(rid)
    job_1 = book.submit(rid, old_tokens)
    msg("S", "M", f"request 1 ({rid}) submits chunk 0")
    msg("S", "E", f"copy chunk 0, key {_short(job_1[1][0])}")
    note("M", entry())
    book.finish(rid)
    msg("S", "M", "request 1 aborted while its copy is in flight")
    note("M", f"{entry()}<br/>waits for its ack")
    book.begin(rid)
    msg("S", "M", f"request 2 reuses rid {rid}: state[{rid}] is overwritten")
    job_2 = book.submit(rid, new_tokens)
    msg("S", "M", "request 2 submits chunk 0")
    msg("S", "E", f"copy chunk 0, key {_short(job_2[1][0])}")
    note("M", entry())
    book.ack(job_1)
    msg("E", "M", f"late ack of request 1, looked up by rid {rid}", "-->>")
    note("M", f"request 2 now has {entry()}<br/>its own chunk is still in flight")
    book.finish(rid)
    msg("S", "M", "request 2 finishes")
    note("M", freed_by("inflight is 0") if rid not in book.inflight else "waits for its ack")
    note("E", "request 2's copy is still reading those device pages")
    dropped = rid not in book.inflight
    book.ack(job_2)
    msg("E", "M", f"ack of request 2, looked up by rid {rid}", "-->>")
    note("M", f"no state for {rid}: ack dropped" if dropped else entry())
    steps.append(("end",))

    # kvlife.
    released: list[str] = []
    steps.append(("begin", "232, 248, 236"))
    note("S,B", "kvlife: each ack carries its Lifecycle")
    life_a = Lifecycle(rid, page_size=page_size, on_release=lambda _: released.append("A"))
    ticket_a = life_a.submit(old_tokens)
    msg("S", "A", f"A = Lifecycle({rid}), ticket tA = A.submit(chunk 0)")
    msg("S", "E", f"copy tA, key {_short(ticket_a[2][0])}")
    note("A", _life(life_a))
    life_a.finish(FinishReason.ABORTED)
    msg("S", "A", "A.finish(ABORTED)")
    note("A", _life(life_a))
    life_b = Lifecycle(rid, page_size=page_size, on_release=lambda _: released.append("B"))
    ticket_b = life_b.submit(new_tokens)
    msg("S", "B", f"B = Lifecycle({rid}), a new object, tB = B.submit(chunk 0)")
    msg("S", "E", f"copy tB, key {_short(ticket_b[2][0])}")
    note("B", _life(life_b))
    ticket_a[0].ack(ticket_a)
    msg("E", "A", "late ack of tA, applied to tA's Lifecycle, which is A", "-->>")
    note("A", f"{_life(life_a)}<br/>release callback ran for {', '.join(released)}")
    note("B", f"untouched: {_life(life_b)}")
    before_b = life_b.snapshot()
    try:
        life_b.ack(ticket_a)
        refusal = "accepted (a bug)"
    except LifecycleError as exc:
        same = "unchanged" if life_b.snapshot() == before_b else "CHANGED (a bug)"
        refusal = f"refused: {type(exc).__name__}, B {same}"
    msg("S", "B", "B.ack(tA), a stray misrouted ack", "-)")
    note("B", f"{refusal}<br/>{_life(life_b)}")
    life_b.finish()
    msg("S", "B", "B.finish()")
    note("B", f"{_life(life_b)}<br/>release waits for tB's ack")
    ticket_b[0].ack(ticket_b)
    msg("E", "B", "ack of tB, applied to B", "-->>")
    note("B", f"{_life(life_b)}<br/>release callbacks ran for {', '.join(released)}")
    steps.append(("end",))
    return steps


# ------------------------------------------------------------------ a sequence diagram in SVG

_COL, _MARGIN, _CHAR, _LINE = 230, 20, 6.6, 16  # column width, margin, glyph width, line height
_FONT = 'font-family="Helvetica, Arial, sans-serif" font-size="12"'


def _text(x: float, y: float, text: str, anchor: str = "middle") -> str:
    return f'<text x="{x:.0f}" y="{y:.0f}" text-anchor="{anchor}">{escape(text)}</text>'


def sequence_svg(participants: dict[str, str], steps: list[Step]) -> str:
    """``steps`` as a sequence diagram: a column per participant, a row per step."""
    xs = {p: _MARGIN + _COL * i + _COL / 2 for i, p in enumerate(participants)}
    width = _MARGIN * 2 + _COL * len(participants)
    back: list[str] = []
    front: list[str] = []
    y, section_top = 70.0, 0.0
    for step in steps:
        if step[0] == "begin":
            section_top, shade = y, step[1]
            y += 8
        elif step[0] == "end":
            back.append(
                f'<rect x="4" y="{section_top:.0f}" width="{width - 8}" '
                f'height="{y + 8 - section_top:.0f}" fill="rgb({shade})"/>'
            )
            y += 16
        elif step[0] == "msg":
            _, src, dst, text, arrow = step
            y += 34
            dash = ' stroke-dasharray="6,4"' if arrow == "-->>" else ""
            head = "open" if arrow == "-)" else "solid"
            front.append(
                f'<line x1="{xs[src]:.0f}" y1="{y:.0f}" x2="{xs[dst]:.0f}" y2="{y:.0f}" '
                f'stroke="black"{dash} marker-end="url(#{head})"/>'
            )
            front.append(_text((xs[src] + xs[dst]) / 2, y - 6, text))
        else:
            _, over, text = step
            lines = text.split("<br/>")
            cols = [xs[p] for p in over.split(",")]
            w = max(max(cols) - min(cols) + 120, max(len(s) for s in lines) * _CHAR + 20)
            h = _LINE * len(lines) + 10
            x = min(max((min(cols) + max(cols) - w) / 2, 8), width - w - 8)
            y += 12
            front.append(
                f'<rect x="{x:.0f}" y="{y:.0f}" width="{w:.0f}" height="{h}" '
                'fill="#fff8c4" stroke="#b0a060"/>'
            )
            for i, line in enumerate(lines):
                front.append(_text(x + w / 2, y + _LINE * (i + 1), line))
            y += h
    height = y + 30
    for p, title in participants.items():
        x = xs[p]
        back.append(
            f'<line x1="{x:.0f}" y1="50" x2="{x:.0f}" y2="{height - 10:.0f}" '
            'stroke="#888" stroke-dasharray="3,3"/>'
        )
        front.append(
            f'<rect x="{x - _COL / 2 + 8:.0f}" y="14" width="{_COL - 16}" height="36" '
            'rx="4" fill="#eef" stroke="black"/>'
        )
        front.append(_text(x, 37, title))
    defs = (
        "<defs>"
        '<marker id="solid" markerWidth="10" markerHeight="8" refX="9" refY="4" orient="auto">'
        '<path d="M0,0 L10,4 L0,8 z"/></marker>'
        '<marker id="open" markerWidth="10" markerHeight="8" refX="9" refY="4" orient="auto">'
        '<path d="M0,0 L10,4 L0,8" fill="none" stroke="black"/></marker>'
        "</defs>"
    )
    return (
        "\n".join(
            [
                f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" '
                f'viewBox="0 0 {width} {height:.0f}" {_FONT}>',
                defs,
                f'<rect width="{width}" height="{height:.0f}" fill="white"/>',
                *back,
                *front,
                "</svg>",
            ]
        )
        + "\n"
    )


# ------------------------------------------------------------------ the guards

_COUNT = {0: "0", 1: "1", 2: "2 or more"}


def _counts(values: set[int]) -> str:
    """A set of in-flight classes (0, 1, 2 = "2 or more") in words."""
    if values == {0, 1, 2}:
        return "any"
    if values == {1, 2}:
        return "1 or more"
    if values == {0, 1}:
        return "0 or 1"
    return " or ".join(_COUNT[v] for v in sorted(values))


def guards_markdown() -> str:
    """Each guard, by the (stores, loads) in flight it holds for, and the rows that use it.

    Evaluated, not written: each guard of :data:`kvlife._lifecycle.GUARDS` is run on the
    in-flight classes the table is compiled over.
    """
    lines = ["| guard | stores in flight | loads in flight | rows |", "|---|---|---|---|"]
    for name, guard in GUARDS.items():
        holds = [c for c in INFLIGHT_CLASSES if guard(*c)]
        stores, loads = {s for s, _ in holds}, {n for _, n in holds}
        if set(holds) == {(s, n) for s in stores for n in loads}:
            where = f"{_counts(stores)} | {_counts(loads)}"
        else:  # not a product of the two counts: list the pairs
            pairs = ", ".join(f"({s}, {n})" for s, n in holds)
            where = f"(stores, loads) in {pairs} | (paired with stores)"
        rows = ", ".join(
            f"`{r.source.name}` `{r.event.value}` → `{r.dest.name}`"
            for r in TABLE
            if r.guard == name
        )
        lines.append(f"| `{name}` | {where} | {rows or 'none'} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the lifecycle picture


def dot_sha256() -> str:
    """SHA-256 of the lifecycle's dot source as the code writes it now."""
    return hashlib.sha256(lifecycle_dot().encode()).hexdigest()


def lifecycle_svg() -> str:
    """The lifecycle through Graphviz's ``dot -Tsvg``, stamped with its dot source's hash."""
    svg = dot_to_image(lifecycle_dot(), "svg").decode()
    at = svg.index("<svg")
    return f"{svg[:at]}<!-- kvlife: dot source sha256 {dot_sha256()} -->\n{svg[at:]}"


def svg_stamp(svg: str) -> str | None:
    """The dot source hash a committed ``lifecycle.svg`` was made from."""
    found = re.search(r"<!-- kvlife: dot source sha256 ([0-9a-f]{64}) -->", svg)
    return found.group(1) if found else None


def graphviz_version(text: str) -> str | None:
    """The Graphviz version in ``dot -V`` output or in an SVG dot wrote."""
    found = re.search(r"graphviz version (\S+)", text)
    return found.group(1) if found else None


def installed_graphviz_version() -> str | None:
    try:
        done = subprocess.run(["dot", "-V"], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return graphviz_version(done.stderr + done.stdout)


# ------------------------------------------------------------------ the files

_README = f"""\
# Generated files: do not edit

Made from the definitions the code runs (kvlife/_lifecycle.py, kvlife/diagrams.py) by
tests/docs_gen.py; lifecycle.svg needs Graphviz's `dot`. Regenerate with:

    {FIX}

tests/test_docs_sync.py fails when these copies drift from the code.
"""


def generated_files() -> dict[str, str]:
    """The generated files that need no Graphviz, by name, as the code makes them now."""
    return {
        "README.md": _README,
        "table.md": table_markdown(),
        "guards.md": guards_markdown(),
        "race.svg": sequence_svg(PARTICIPANTS, race_steps()),
    }


#: Every file in docs/generated: the ones above and the Graphviz-drawn lifecycle.
ALL_FILES = ("README.md", "table.md", "guards.md", "race.svg", "lifecycle.svg")

README_BEGIN = "<!-- generated: kvlife diagram (tests/docs_gen.py) -->"
README_END = "<!-- end generated -->"


def readme_with_diagram(readme: str) -> str:
    """``readme`` with the block between the generated markers replaced by the lifecycle."""
    start = readme.find(README_BEGIN)
    end = readme.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"README has no {README_BEGIN} ... {README_END} block")
    block = f"{README_BEGIN}\n```mermaid\n{lifecycle_mermaid()}```\n"
    return readme[:start] + block + readme[end:]


def main() -> int:
    GENERATED.mkdir(parents=True, exist_ok=True)
    files = {**generated_files(), "lifecycle.svg": lifecycle_svg()}
    for name, text in files.items():
        (GENERATED / name).write_text(text, encoding="utf-8")
        print(GENERATED.relative_to(ROOT) / name)
    readme = ROOT / "README.md"
    readme.write_text(readme_with_diagram(readme.read_text(encoding="utf-8")), encoding="utf-8")
    print(readme.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
