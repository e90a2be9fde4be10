"""The ``kvlife`` command.

Each subcommand is one ``register`` function in :data:`COMMANDS`: it adds its
parser to the subparsers and sets ``handler`` (``args -> exit status``). A new
subcommand is one more function and one more entry. Exit status: 0 done,
2 refused (bad usage, a :class:`~kvlife.errors.KVLifeError` such as a missing
Graphviz, or an ``OSError`` such as an ``--out`` that cannot be written), with
the reason on one line of stderr and no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

from kvlife.errors import ConfigError, KVLifeError

__all__ = ["COMMANDS", "build_parser", "main"]

_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


#: Format implied by an ``--out`` file's suffix when ``--format`` is not given.
_FORMAT_BY_SUFFIX = {
    ".mmd": "mermaid",
    ".mermaid": "mermaid",
    ".dot": "dot",
    ".gv": "dot",
    ".svg": "svg",
    ".png": "png",
    ".md": "markdown",
}


def _register_diagram(subparsers: _Subparsers) -> None:
    """``kvlife diagram``: draw the lifecycle, or print its transition table."""
    from kvlife.diagrams import DIAGRAMS, IMAGE_FORMATS

    parser = subparsers.add_parser(
        "diagram",
        help="draw the lifecycle from the definition the code runs",
        description=(
            "Render a diagram from the lifecycle table the code runs. mermaid (and the table's "
            "markdown) need nothing else; dot works everywhere; svg and png need Graphviz."
        ),
    )
    parser.add_argument(
        "--which",
        choices=list(DIAGRAMS),
        default="lifecycle",
        help="the lifecycle's states, or its transition table",
    )
    formats = sorted({f for r in DIAGRAMS.values() for f in r} | set(IMAGE_FORMATS))
    parser.add_argument(
        "--format",
        choices=formats,
        help="default: from --out's suffix, else mermaid (markdown for the table)",
    )
    parser.add_argument("--out", type=Path, metavar="FILE", help="write here instead of stdout")
    parser.set_defaults(handler=_diagram)


def _diagram(args: argparse.Namespace) -> int:
    from kvlife.diagrams import DIAGRAMS, IMAGE_FORMATS, render

    out: Path | None = args.out
    fmt: str | None = args.format
    if fmt is None and out is not None:
        fmt = _FORMAT_BY_SUFFIX.get(out.suffix.lower())
    if fmt is None:
        fmt = next(iter(DIAGRAMS[args.which]))
    if out is None and fmt in IMAGE_FORMATS and sys.stdout.isatty():
        raise ConfigError(f"{fmt} is binary: give --out FILE or redirect stdout")
    data = render(args.which, fmt)
    if out is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        out.write_bytes(data)
        print(f"wrote {out} ({args.which}, {fmt})", file=sys.stderr)
    return 0


def _register_from(module: str) -> Callable[[_Subparsers], None]:
    """``module.register``, imported only when the parser is built."""
    return lambda subparsers: importlib.import_module(module).register(subparsers)


#: Every subcommand: (name, register function). Add one entry per new subcommand.
COMMANDS: list[tuple[str, Callable[[_Subparsers], None]]] = [
    ("diagram", _register_diagram),
    ("simulate", _register_from("kvlife.sim.command")),  # the main job (see kvlife.sim)
    ("check", _register_from("kvlife.testing.command")),  # every interleaving (kvlife.testing)
]


def build_parser() -> argparse.ArgumentParser:
    """The ``kvlife`` parser with every subcommand in :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="kvlife",
        description="An explicit, checked lifecycle for each request's KV-cache offload.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for _name, register in COMMANDS:
        register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``kvlife`` with ``argv`` (default: the process arguments); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        status: int = args.handler(args)
    except (KVLifeError, OSError) as exc:  # a refusal, or a file or directory we cannot use
        print(f"kvlife {args.command}: {exc}", file=sys.stderr)
        return 2
    return status
