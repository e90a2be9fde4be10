"""Diagrams and tables of the lifecycle, made from the definitions the code runs.

Nothing here is drawn by hand:

* the lifecycle state diagram and the transition table come from
  :data:`kvlife._lifecycle.TABLE`, rendered by ``transitions``' ``GraphMachine``
  (mermaid needs no binary; dot uses the ``graphviz`` engine where the
  ``graphviz`` Python package is installed, else dot text written from the table);
* the chunk's own lifecycle comes from :data:`CHUNK_TABLE`, rendered the same way;
* the reused-rid race is *run* -- against a rid-keyed runtime and against real
  :class:`~kvlife.Lifecycle` objects -- and every note in the sequence diagram
  shows a value observed in that run.

``python -m kvlife.diagrams --write docs/generated`` regenerates the committed
copies the documentation includes; a test fails when they drift.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Literal, Protocol

from kvlife._lifecycle import TABLE, FinishReason, Lifecycle, State
from kvlife.errors import KVLifeError, LifecycleError
from kvlife.hashing import sglang_page_hashes

__all__ = [
    "CHUNK_TABLE",
    "DIAGRAMS",
    "GRAPHVIZ_HELP",
    "IMAGE_FORMATS",
    "README_BEGIN",
    "README_END",
    "ChunkEvent",
    "ChunkState",
    "ChunkTransition",
    "DiagramError",
    "GraphvizMissing",
    "chunk_dot",
    "chunk_mermaid",
    "chunk_table_markdown",
    "generated_files",
    "lifecycle_dot",
    "lifecycle_mermaid",
    "race_mermaid",
    "readme_with_diagram",
    "render",
    "table_markdown",
    "write_generated",
]

GRAPHVIZ_HELP = (
    "svg and png need the Graphviz 'dot' program: install it with "
    "`apt-get install graphviz` (or `brew install graphviz`), and `pip install graphviz` "
    "so transitions can use its graphviz engine; mermaid output needs neither"
)


class DiagramError(KVLifeError):
    """A diagram that cannot be made in the asked format."""


class GraphvizMissing(DiagramError):
    """The Graphviz ``dot`` program, needed for svg and png, is not installed."""


# ------------------------------------------------------------------ the chunk


class ChunkState(Enum):
    """Where one chunk's pages stand between device, host and store."""

    #: Device->host copy submitted; the copy still reads the device pages.
    IN_FLIGHT = "in_flight"
    #: Copy complete: the host pages hold the chunk; the device pages are no longer read.
    ON_HOST = "on_host"
    #: The store holds every page of the chunk under its key.
    STORED = "stored"
    #: Terminal: the chunk's host pages are back in the host pool, freed exactly once.
    HOST_FREED = "host_freed"


class ChunkEvent(Enum):
    """What happens to one chunk after it is submitted."""

    #: The copy's ack reports success.
    COPY_OK = "copy_ok"
    #: The copy's ack reports failure: nothing reaches the store.
    COPY_FAILED = "copy_failed"
    #: The store accepted every page of the chunk.
    STORE_OK = "store_ok"
    #: The backup to the store failed (reported, never silent).
    STORE_FAILED = "store_failed"
    #: The host pool takes the chunk's host pages back.
    FREE_HOST = "free_host"


@dataclass(frozen=True, slots=True)
class ChunkTransition:
    """One row of the chunk table: in ``source``, ``event`` leads to ``dest``."""

    source: ChunkState
    event: ChunkEvent
    dest: ChunkState
    effect: str
    guard: str | None = None


_C, _CE = ChunkState, ChunkEvent

#: The chunk's own lifecycle. Both failure arcs end with the host pages freed.
CHUNK_TABLE: tuple[ChunkTransition, ...] = (
    ChunkTransition(_C.IN_FLIGHT, _CE.COPY_OK, _C.ON_HOST, "ack: the Lifecycle settles the chunk"),
    ChunkTransition(
        _C.IN_FLIGHT, _CE.COPY_FAILED, _C.HOST_FREED, "ack: settled, host pages freed, not stored"
    ),
    ChunkTransition(_C.ON_HOST, _CE.STORE_OK, _C.STORED, "store holds every page under its key"),
    ChunkTransition(
        _C.ON_HOST, _CE.STORE_FAILED, _C.HOST_FREED, "failure reported, host pages freed"
    ),
    ChunkTransition(_C.STORED, _CE.FREE_HOST, _C.HOST_FREED, "host pages back to the pool, once"),
)


# ------------------------------------------------------------------ state diagrams


class _Row(Protocol):
    """A table row either table provides: source, event, dest, guard, effect."""

    @property
    def source(self) -> Enum: ...
    @property
    def event(self) -> Enum: ...
    @property
    def dest(self) -> Enum: ...
    @property
    def guard(self) -> str | None: ...
    @property
    def effect(self) -> str: ...


@dataclass(frozen=True)
class _Diagram:
    """A state table with what rendering needs: its states, its start, its title."""

    title: str
    states: tuple[Enum, ...]
    initial: Enum
    rows: tuple[_Row, ...]

    @property
    def terminal(self) -> tuple[Enum, ...]:
        """States no row leaves."""
        sources = {row.source for row in self.rows}
        return tuple(s for s in self.states if s not in sources)


_LIFECYCLE = _Diagram("kvlife Lifecycle", tuple(State), State.IDLE, TABLE)
_CHUNK = _Diagram("kvlife chunk", tuple(ChunkState), ChunkState.IN_FLIGHT, CHUNK_TABLE)


def _graphviz_installed() -> bool:
    try:
        import graphviz  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        return False
    return True


def _graph_source(diagram: _Diagram, engine: Literal["mermaid", "graphviz"]) -> str:
    """Render ``diagram`` through ``transitions``' GraphMachine with ``engine``."""
    from transitions.extensions import GraphMachine

    machine = GraphMachine(
        model=None,
        states=[s.name for s in diagram.states],
        transitions=[
            {
                "trigger": row.event.value,
                "source": row.source.name,
                "dest": row.dest.name,
                "conditions": [row.guard] if row.guard else [],
            }
            for row in diagram.rows
        ],
        initial=diagram.initial.name,
        auto_transitions=False,
        show_conditions=True,
        title=diagram.title,
        graph_engine=engine,
    )

    class _Model:
        pass

    model = _Model()
    machine.add_model(model)
    graph = machine.model_graphs[id(model)]
    graph.reset_styling()  # a reference diagram: no state is "current"
    # transitions writes the title as the body of mermaid's front matter: make it YAML.
    title = f"title: {diagram.title}" if engine == "mermaid" else diagram.title
    return str(getattr(graph.get_graph(title=title), "source"))  # noqa: B009


def _mermaid(diagram: _Diagram) -> str:
    lines = _graph_source(diagram, "mermaid").rstrip("\n").split("\n")
    lines += [f"  {state.name} --> [*]" for state in diagram.terminal]
    return "\n".join(lines) + "\n"


def _dot_text(diagram: _Diagram) -> str:
    """Dot source written from the table, for when the ``graphviz`` package is absent."""
    lines = [
        f'digraph "{diagram.title}" {{',
        "  rankdir=LR;",
        '  node [shape=box, style="rounded,filled", fillcolor=white, fontname=Helvetica];',
        "  edge [fontname=Helvetica, fontsize=10];",
        '  __start [shape=point, label=""];',
    ]
    lines += [
        f"  {s.name}" + (" [peripheries=2];" if s in diagram.terminal else ";")
        for s in diagram.states
    ]
    lines.append(f"  __start -> {diagram.initial.name};")
    for row in diagram.rows:
        label = row.event.value + (f" [{row.guard}]" if row.guard else "")
        lines.append(f'  {row.source.name} -> {row.dest.name} [label="{label}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot(diagram: _Diagram) -> str:
    if _graphviz_installed():
        return _graph_source(diagram, "graphviz")
    return _dot_text(diagram)


def lifecycle_mermaid() -> str:
    """The lifecycle state diagram (mermaid), from :data:`kvlife._lifecycle.TABLE`."""
    return _mermaid(_LIFECYCLE)


def lifecycle_dot() -> str:
    """The lifecycle state diagram as Graphviz dot source."""
    return _dot(_LIFECYCLE)


def chunk_mermaid() -> str:
    """The chunk's own lifecycle (mermaid), from :data:`CHUNK_TABLE`."""
    return _mermaid(_CHUNK)


def chunk_dot() -> str:
    """The chunk's own lifecycle as Graphviz dot source."""
    return _dot(_CHUNK)


def _markdown_table(rows: Sequence[_Row]) -> str:
    lines = ["| source | event | guard | dest | effect |", "|---|---|---|---|---|"]
    for row in rows:
        guard = f"`{row.guard}`" if row.guard else ""
        lines.append(
            f"| `{row.source.name}` | `{row.event.value}` | {guard} | `{row.dest.name}` "
            f"| {row.effect} |"
        )
    return "\n".join(lines) + "\n"


def table_markdown() -> str:
    """The lifecycle transition table as a markdown table (source, event, guard, dest, effect)."""
    return _markdown_table(TABLE)


def chunk_table_markdown() -> str:
    """The chunk table as a markdown table."""
    return _markdown_table(CHUNK_TABLE)


# ------------------------------------------------------------------ the reused-rid race


@dataclass
class _RidEntry:
    inflight: int = 0
    last_hash: str | None = None
    finished: bool = False


class _RidKeyedRuntime:
    """Offload bookkeeping keyed by rid: the pattern behind the bug class kvlife removes."""

    def __init__(self) -> None:
        self.state: dict[str, _RidEntry] = {}

    def start(self, rid: str) -> None:
        self.state[rid] = _RidEntry()

    def submit(self, rid: str) -> None:
        self.state[rid].inflight += 1

    def finish(self, rid: str) -> str:
        """Mark the request finished; release at once if its counter says nothing is in flight."""
        entry = self.state[rid]
        entry.finished = True
        if entry.inflight == 0:
            del self.state[rid]
            return f"inflight is 0: del state[{rid}], device pages freed"
        return "waits for its ack"

    def ack(self, rid: str, key: str) -> str:
        """Apply an ack found by rid; say what happened to the device pages."""
        entry = self.state.get(rid)
        if entry is None:
            return f"no state for {rid}: ack dropped"
        entry.inflight -= 1
        entry.last_hash = key
        if entry.finished and entry.inflight == 0:
            del self.state[rid]
            return f"drained: del state[{rid}], device pages freed"
        return "kept"


def _short(key: str | None) -> str:
    return "None" if key is None else key[:8]


def _life_note(life: Lifecycle) -> str:
    snap = life.snapshot()
    return f"{snap.state.name}, inflight={snap.inflight}, last_hash={_short(snap.last_hash)}"


def race_mermaid() -> str:
    """The reused-rid race as a mermaid sequence diagram: rid-keyed runtime vs kvlife.

    Both halves are run, not drawn: the notes show the values the rid-keyed
    runtime and the real Lifecycle objects hold at each step.
    """
    page_size, rid = 4, "r1"
    old_tokens, new_tokens = [11, 12, 13, 14], [21, 22, 23, 24]
    old_key = sglang_page_hashes(old_tokens, page_size, None)[0]
    new_key = sglang_page_hashes(new_tokens, page_size, None)[0]

    out = [
        "sequenceDiagram",
        "  participant S as Scheduler",
        "  participant E as Copy engine",
        "  participant M as state[rid] (rid-keyed runtime)",
        "  participant A as Lifecycle A (rid r1)",
        "  participant B as Lifecycle B (rid r1)",
    ]

    def note(over: str, text: str) -> None:
        out.append(f"    Note over {over}: {text}")

    def entry(runtime: _RidKeyedRuntime) -> str:
        e = runtime.state.get(rid)
        if e is None:
            return f"no state[{rid}]"
        return f"inflight={e.inflight}, last_hash={_short(e.last_hash)}, finished={e.finished}"

    # The rid-keyed runtime.
    rt = _RidKeyedRuntime()
    out.append("  rect rgb(255, 236, 236)")
    note("S,M", "A runtime that keys offload state by rid")
    rt.start(rid)
    rt.submit(rid)
    out.append(f"    S->>M: request 1 ({rid}) submits chunk 0")
    out.append(f"    S->>E: copy chunk 0, key {_short(old_key)}")
    note("M", entry(rt))
    outcome = rt.finish(rid)
    out.append("    S->>M: request 1 aborted while its copy is in flight")
    note("M", f"{entry(rt)}<br/>{outcome}")
    rt.start(rid)
    out.append(f"    S->>M: request 2 reuses rid {rid}: state[{rid}] is overwritten")
    rt.submit(rid)
    out.append("    S->>M: request 2 submits chunk 0")
    out.append(f"    S->>E: copy chunk 0, key {_short(new_key)}")
    note("M", entry(rt))
    rt.ack(rid, old_key)
    out.append(f"    E-->>M: late ack of request 1, looked up by rid {rid}")
    note("M", f"request 2 now has {entry(rt)}<br/>its own chunk is still in flight")
    outcome = rt.finish(rid)
    out.append("    S->>M: request 2 finishes")
    note("M", outcome)
    note("E", "request 2's copy is still reading those device pages")
    outcome = rt.ack(rid, new_key)
    out.append(f"    E-->>M: ack of request 2, looked up by rid {rid}")
    note("M", outcome)
    out.append("  end")

    # kvlife.
    released: list[str] = []
    out.append("  rect rgb(232, 248, 236)")
    note("S,B", "kvlife: each ack carries its Lifecycle")
    life_a = Lifecycle(rid, page_size=page_size, on_release=lambda _: released.append("A"))
    ticket_a = life_a.submit(old_tokens)
    out.append(f"    S->>A: A = Lifecycle({rid}), ticket tA = A.submit(chunk 0)")
    out.append(f"    S->>E: copy tA, key {_short(ticket_a.keys[0])}")
    note("A", _life_note(life_a))
    life_a.finish(FinishReason.ABORTED)
    out.append("    S->>A: A.finish(ABORTED)")
    note("A", _life_note(life_a))
    life_b = Lifecycle(rid, page_size=page_size, on_release=lambda _: released.append("B"))
    ticket_b = life_b.submit(new_tokens)
    out.append(f"    S->>B: B = Lifecycle({rid}), a new object, tB = B.submit(chunk 0)")
    out.append(f"    S->>E: copy tB, key {_short(ticket_b.keys[0])}")
    note("B", _life_note(life_b))
    ticket_a.lifecycle.ack(ticket_a)
    out.append("    E-->>A: late ack of tA, applied to tA.lifecycle, which is A")
    note("A", f"{_life_note(life_a)}<br/>release callback ran for {', '.join(released)}")
    note("B", f"untouched: {_life_note(life_b)}")
    before_b = life_b.snapshot()
    try:
        life_b.ack(ticket_a)
        refusal = "accepted (a bug)"
    except LifecycleError as exc:
        same = "unchanged" if life_b.snapshot() == before_b else "CHANGED (a bug)"
        refusal = f"refused: {type(exc).__name__}, B {same}"
    out.append("    S-)B: B.ack(tA), a stray misrouted ack")
    note("B", f"{refusal}<br/>{_life_note(life_b)}")
    life_b.finish()
    out.append("    S->>B: B.finish()")
    note("B", f"{_life_note(life_b)}<br/>release waits for tB's ack")
    ticket_b.lifecycle.ack(ticket_b)
    out.append("    E-->>B: ack of tB, applied to B")
    note("B", f"{_life_note(life_b)}<br/>release callbacks ran for {', '.join(released)}")
    out.append("  end")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ rendering


#: Every diagram, by the name ``kvlife diagram --which`` takes: (text format, renderers).
DIAGRAMS: dict[str, dict[str, Callable[[], str]]] = {
    "lifecycle": {"mermaid": lifecycle_mermaid, "dot": lifecycle_dot},
    "chunk": {"mermaid": chunk_mermaid, "dot": chunk_dot},
    "race": {"mermaid": race_mermaid},
    "table": {"markdown": table_markdown},
}

IMAGE_FORMATS = ("svg", "png")


def render(which: str, fmt: str) -> bytes:
    """Diagram ``which`` in format ``fmt`` (mermaid, dot, markdown, svg, png), as bytes."""
    renderers = DIAGRAMS.get(which)
    if renderers is None:
        raise DiagramError(f"no diagram {which!r}; choose one of {', '.join(DIAGRAMS)}")
    if fmt in IMAGE_FORMATS:
        if "dot" not in renderers:
            raise DiagramError(
                f"{which} has no Graphviz form ({fmt} is drawn from dot); "
                f"use --format {' or '.join(renderers)}"
            )
        return _dot_to_image(renderers["dot"](), fmt)
    if fmt not in renderers:
        raise DiagramError(f"{which} comes as {' or '.join(renderers)}, not {fmt}")
    return renderers[fmt]().encode()


def _dot_to_image(dot_source: str, fmt: str) -> bytes:
    dot = shutil.which("dot")
    if dot is None:
        raise GraphvizMissing(f"cannot make {fmt}: {GRAPHVIZ_HELP}")
    done = subprocess.run(
        [dot, f"-T{fmt}"], input=dot_source.encode(), capture_output=True, check=False
    )
    if done.returncode != 0:
        raise DiagramError(f"dot -T{fmt} failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


# ------------------------------------------------------------------ the committed copies

_GENERATED_README = """\
# Generated files: do not edit

Made from the definitions the code runs (kvlife/_lifecycle.py and kvlife/diagrams.py).
Regenerate with:

    python -m kvlife.diagrams --write docs/generated --readme README.md

tests/test_docs_sync.py fails when these copies drift from the code.
"""


def generated_files() -> dict[str, str]:
    """The committed generated files, by name, as the code makes them now."""
    return {
        "README.md": _GENERATED_README,
        "lifecycle.mmd": lifecycle_mermaid(),
        "chunk.mmd": chunk_mermaid(),
        "race.mmd": race_mermaid(),
        "table.md": table_markdown(),
        "chunk-table.md": chunk_table_markdown(),
    }


README_BEGIN = "<!-- generated: docs/generated/lifecycle.mmd -->"
README_END = "<!-- end generated -->"


def readme_with_diagram(readme: str) -> str:
    """``readme`` with the block between the generated markers replaced by the lifecycle diagram."""
    start = readme.find(README_BEGIN)
    end = readme.find(README_END)
    if start < 0 or end < start:
        raise DiagramError(f"README has no {README_BEGIN} ... {README_END} block")
    block = f"{README_BEGIN}\n```mermaid\n{lifecycle_mermaid()}```\n"
    return readme[:start] + block + readme[end:]


def write_generated(directory: Path, readme: Path | None = None) -> list[Path]:
    """Write every generated file into ``directory`` (and the README's diagram); return paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in generated_files().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    if readme is not None:
        readme.write_text(readme_with_diagram(readme.read_text(encoding="utf-8")), encoding="utf-8")
        written.append(readme)
    return written


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvlife.diagrams", description="Regenerate the committed diagrams."
    )
    parser.add_argument("--write", type=Path, required=True, metavar="DIR")
    parser.add_argument("--readme", type=Path, metavar="FILE")
    args = parser.parse_args(argv)
    try:
        paths = write_generated(args.write, args.readme)
    except DiagramError as exc:
        print(f"kvlife: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
