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
    CHUNK_TABLE,
    GRAPHVIZ_HELP,
    ChunkState,
    chunk_mermaid,
    lifecycle_dot,
    lifecycle_mermaid,
    race_mermaid,
    table_markdown,
)

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
    for row in TABLE:
        assert f"{row.source.name} -> {row.dest.name}" in text
    for state in State:
        assert state.name in text


def test_chunk_table_every_path_ends_with_host_pages_freed() -> None:
    sources = {row.source for row in CHUNK_TABLE}
    assert set(ChunkState) - sources == {ChunkState.HOST_FREED}, "one terminal: host freed"
    failures = [row for row in CHUNK_TABLE if row.event.value.endswith("_failed")]
    assert {row.source for row in failures} == {ChunkState.IN_FLIGHT, ChunkState.ON_HOST}
    assert all(row.dest is ChunkState.HOST_FREED for row in failures)
    text = chunk_mermaid()
    for row in CHUNK_TABLE:
        assert f"{row.source.name} --> {row.dest.name}: {row.event.value}" in text


def test_race_notes_are_observed_values() -> None:
    """The rid-keyed half shows the new request corrupted; the kvlife half shows it untouched."""
    text = race_mermaid()
    assert text.startswith("sequenceDiagram\n")
    rid_half, kvlife_half = text.split("  end\n")[:2]
    assert "request 2 now has inflight=0, last_hash=" in rid_half
    assert "its own chunk is still in flight" in rid_half
    assert "device pages freed" in rid_half and "ack dropped" in rid_half
    assert "untouched: OFFLOADING, inflight=1, last_hash=None" in kvlife_half
    assert "refused: ForeignAck, B unchanged" in kvlife_half
    assert "release callbacks ran for A, B" in kvlife_half


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
        ["--which", "race", "--format", "dot"],
        ["--which", "table", "--format", "mermaid"],
        ["--which", "race", "--format", "svg"],
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
    assert "apt-get install graphviz" in err and "pip install graphviz" in err
    assert GRAPHVIZ_HELP in err
    assert not (tmp_path / "x.svg").exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed")
@pytest.mark.parametrize(("fmt", "magic"), [("svg", b"<svg"), ("png", b"\x89PNG")])
def test_images_with_graphviz(tmp_path: Path, fmt: str, magic: bytes) -> None:
    out = tmp_path / f"life.{fmt}"
    assert main(["diagram", "--format", fmt, "--out", str(out)]) == 0
    assert magic in out.read_bytes()[:400]


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
