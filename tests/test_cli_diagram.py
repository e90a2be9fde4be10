"""``kvlife diagram``: every diagram comes from the table the code runs; refusals exit 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvlife import TABLE, State
from kvlife.cli import COMMANDS, build_parser, main
from kvlife.diagrams import (
    GRAPHVIZ_HELP,
    dot_to_image,
    lifecycle_dot,
    lifecycle_mermaid,
    row_label,
    table_markdown,
)
from kvlife.errors import KVLifeError, MissingDependency

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *args: str) -> tuple[int, str]:
    out = tmp_path / "out"
    status = main(["diagram", *args, "--out", str(out)])
    return status, out.read_text(encoding="utf-8") if out.exists() else ""


def test_lifecycle_mermaid_has_every_row_and_nothing_else(tmp_path: Path) -> None:
    status, text = _run(tmp_path, "--which", "lifecycle", "--format", "mermaid")
    assert status == 0
    assert text == lifecycle_mermaid()
    edges = [line.strip() for line in text.splitlines() if "-->" in line]
    for row in TABLE:
        label = row.event.value + (f" [{row.guard}]" if row.guard else "")
        assert any(
            e.startswith(f"{row.source.name} --> {row.dest.name}:") and label in e for e in edges
        ), f"row {row} is not drawn"
    pairs = {(r.source.name, r.dest.name) for r in TABLE}
    drawn = {tuple(e.split(":")[0].split(" --> ")) for e in edges}
    assert drawn == pairs | {("[*]", "IDLE"), ("RELEASED", "[*]")}
    styled = [line.split() for line in text.splitlines() if line.strip().startswith("Class ")]
    assert styled and all(style == "s_default" for _, _, style in styled), "none looks current"


def test_lifecycle_dot_has_every_row() -> None:
    text = lifecycle_dot()
    assert text.lstrip().startswith("digraph")
    arcs = {line.split(" [", 1)[0].strip(): line for line in text.splitlines() if " -> " in line}
    for row in TABLE:
        arc = arcs[f"{row.source.name} -> {row.dest.name}"]  # one arc per pair of states
        lines = arc.split('label="', 1)[1].split('"', 1)[0].split("\\l")
        assert row_label(row) in lines, f"row {row} is not on its arc's label"
    for state in State:
        assert state.name in text


def test_table_markdown_lists_every_row(tmp_path: Path) -> None:
    status, text = _run(tmp_path, "--which", "table")
    assert status == 0 and text == table_markdown()
    rows = [line for line in text.splitlines()[2:] if line.startswith("|")]
    assert len(rows) == len(TABLE)


def test_format_from_out_suffix(tmp_path: Path) -> None:
    out = tmp_path / "life.dot"
    assert main(["diagram", "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == lifecycle_dot()


@pytest.mark.parametrize(
    "args",
    [
        ["--which", "table", "--format", "dot"],
        ["--which", "table", "--format", "mermaid"],
        ["--which", "table", "--format", "svg"],
        ["--which", "race"],  # docs only (tests/docs_gen.py): no rid-keyed runtime ships
        ["--which", "nonsense"],
        ["--format", "jpeg"],
    ],
)
def test_refusals_exit_2_and_write_nothing(tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "out"
    assert main(["diagram", *args, "--out", str(out)]) == 2
    assert not out.exists()


def _cli(args: list[str], path_dirs: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PATH": path_dirs, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvlife", "diagram", *args], env=env, capture_output=True
    )


def test_svg_without_graphviz_says_how_to_get_it(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()  # a PATH with no dot on it: the real missing-binary case
    done = _cli(["--format", "svg", "--out", str(tmp_path / "x.svg")], str(empty))
    assert done.returncode == 2
    err = done.stderr.decode()
    assert "apt-get install graphviz" in err
    assert GRAPHVIZ_HELP in err
    assert not (tmp_path / "x.svg").exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed")
@pytest.mark.parametrize(("fmt", "magic"), [("svg", b"<svg"), ("png", b"\x89PNG")])
def test_images_with_graphviz(tmp_path: Path, fmt: str, magic: bytes) -> None:
    out = tmp_path / f"life.{fmt}"
    assert main(["diagram", "--format", fmt, "--out", str(out)]) == 0
    assert magic in out.read_bytes()[:400]


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed")
def test_dot_failures_say_whether_a_renderer_is_missing() -> None:
    """A format this Graphviz cannot draw asks for a renderer; any other failure of dot
    (here, broken dot text) is reported as dot's failure, not as something to install."""
    with pytest.raises(MissingDependency, match="install its renderer"):
        dot_to_image(lifecycle_dot(), "no-such-format")
    with pytest.raises(KVLifeError, match="dot failed to draw svg") as err:
        dot_to_image("digraph {", "svg")
    assert not isinstance(err.value, MissingDependency)


def test_stdout_mermaid_by_default() -> None:
    done = _cli([], os.environ.get("PATH", ""))
    assert done.returncode == 0
    assert done.stdout.decode() == lifecycle_mermaid()


def test_every_command_is_registered_and_help_exits_0() -> None:
    parser = build_parser()
    assert "diagram" in dict(COMMANDS)
    assert main(["--help"]) == 0
    assert main([]) == 2
    assert parser.parse_args(["diagram"]).command == "diagram"
