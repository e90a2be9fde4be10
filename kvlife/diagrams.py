"""The lifecycle drawn from :data:`kvlife._lifecycle.TABLE`: what ``kvlife diagram`` prints.

Nothing here is drawn by hand: mermaid by ``transitions``' ``GraphMachine``, dot written from
the table, svg and png that dot run through Graphviz's ``dot``. The docs' copies
(``docs/generated``) are made from these by ``tests/docs_gen.py``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable

from kvlife._lifecycle import TABLE, State, Transition
from kvlife.errors import ConfigError, KVLifeError, MissingDependency

__all__ = [
    "DIAGRAMS",
    "GRAPHVIZ_HELP",
    "IMAGE_FORMATS",
    "lifecycle_dot",
    "lifecycle_mermaid",
    "render",
    "row_label",
    "table_markdown",
]

GRAPHVIZ_HELP = (
    "svg and png need the Graphviz 'dot' program: install it with "
    "`apt-get install graphviz` (or `brew install graphviz`); mermaid, dot and markdown "
    "output need nothing"
)

TITLE = "kvlife Lifecycle"


def _terminal() -> list[State]:
    """States no row leaves."""
    sources = {row.source for row in TABLE}
    return [s for s in State if s not in sources]


def lifecycle_mermaid() -> str:
    """The lifecycle state diagram (mermaid), rendered by ``transitions`` from the table."""
    from transitions.extensions import GraphMachine

    machine = GraphMachine(  # its own model
        states=[s.name for s in State],
        transitions=[
            {
                "trigger": row.event.value,
                "source": row.source.name,
                "dest": row.dest.name,
                "conditions": [row.guard] if row.guard else [],
            }
            for row in TABLE
        ],
        initial=State.IDLE.name,
        auto_transitions=False,
        show_conditions=True,
        title=TITLE,
        graph_engine="mermaid",
    )
    graph = machine.model_graphs[id(machine)]
    graph.reset_styling()  # a reference diagram: no state is "current"
    # transitions writes the title as the body of mermaid's front matter: make it YAML.
    source = str(getattr(graph.get_graph(title=f"title: {TITLE}"), "source"))  # noqa: B009
    lines = source.rstrip("\n").split("\n")
    lines += [f"  {state.name} --> [*]" for state in _terminal()]
    return "\n".join(lines) + "\n"


def row_label(row: Transition) -> str:
    """A row as the diagrams draw it: ``event`` or ``event [guard]``."""
    return row.event.value + (f" [{row.guard}]" if row.guard else "")


#: States whose self-loop is drawn on their west side: top to bottom, OFFLOADING's east
#: side takes the arc from LOADING (submit), which would cross the loop's label there.
_WEST_LOOPS = frozenset({State.OFFLOADING})


def lifecycle_dot() -> str:
    """The lifecycle state diagram as Graphviz dot source, written from the table.

    Drawn to be read at a docs page's width: top to bottom (five states side by side are
    too wide), and one arc per (source, dest) pair, so a state's self-loop carries one
    label that lists its rows, one per line, instead of a loop and a label per row.
    """
    terminal = _terminal()
    lines = [
        f'digraph "{TITLE}" {{',
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fillcolor=white, fontname=Helvetica];',
        "  edge [fontname=Helvetica, fontsize=11];",
        '  __start [shape=point, label=""];',
    ]
    lines += [f"  {s.name}" + (" [peripheries=2];" if s in terminal else ";") for s in State]
    lines.append(f"  __start -> {State.IDLE.name};")
    arcs: dict[tuple[State, State], list[str]] = {}
    for row in TABLE:
        arcs.setdefault((row.source, row.dest), []).append(row_label(row))
    for (source, dest), labels in arcs.items():
        # Several rows: one line each, left-justified (dot's "\l" ends a line).
        label = labels[0] if len(labels) == 1 else "".join(f"{lab}\\l" for lab in labels)
        ports = "tailport=w, headport=w, " if source is dest and source in _WEST_LOOPS else ""
        lines.append(f'  {source.name} -> {dest.name} [{ports}label="{label}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def table_markdown() -> str:
    """The transition table as a markdown table (source, event, guard, dest, effect)."""
    lines = ["| source | event | guard | dest | effect |", "|---|---|---|---|---|"]
    for row in TABLE:
        guard = f"`{row.guard}`" if row.guard else ""
        lines.append(
            f"| `{row.source.name}` | `{row.event.value}` | {guard} | `{row.dest.name}` "
            f"| {row.effect} |"
        )
    return "\n".join(lines) + "\n"


#: Every diagram, by the name ``kvlife diagram --which`` takes: its text formats.
DIAGRAMS: dict[str, dict[str, Callable[[], str]]] = {
    "lifecycle": {"mermaid": lifecycle_mermaid, "dot": lifecycle_dot},
    "table": {"markdown": table_markdown},
}

IMAGE_FORMATS = ("svg", "png")


def render(which: str, fmt: str) -> bytes:
    """Diagram ``which`` in format ``fmt`` (mermaid, dot, markdown, svg, png), as bytes."""
    renderers = DIAGRAMS.get(which)
    if renderers is None:
        raise ConfigError(f"no diagram {which!r}; choose one of {', '.join(DIAGRAMS)}")
    if fmt in IMAGE_FORMATS:
        if "dot" not in renderers:
            raise ConfigError(
                f"{which} has no Graphviz form ({fmt} is drawn from dot); "
                f"use --format {' or '.join(renderers)}"
            )
        return dot_to_image(renderers["dot"](), fmt)
    if fmt not in renderers:
        raise ConfigError(f"{which} comes as {' or '.join(renderers)}, not {fmt}")
    return renderers[fmt]().encode()


def dot_to_image(dot_source: str, fmt: str) -> bytes:
    """``dot_source`` run through Graphviz's ``dot -T<fmt>``."""
    dot = shutil.which("dot")
    if dot is None:
        raise MissingDependency(f"cannot make {fmt}: {GRAPHVIZ_HELP}")
    done = subprocess.run(
        [dot, f"-T{fmt}"], input=dot_source.encode(), capture_output=True, check=False
    )
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip()
        if "not recognized" in why:  # this Graphviz build has no renderer for the format
            raise MissingDependency(
                f"Graphviz's dot cannot draw {fmt} (install its renderer): {why}"
            )
        raise KVLifeError(f"Graphviz's dot failed to draw {fmt}: {why}")
    return done.stdout
