"""The ``kvlife`` command: each subcommand is one ``register`` function in :data:`COMMANDS`
that adds its parser and sets ``handler`` (``args -> exit status``). Exit status: 0 done, 2
refused (bad usage, a :class:`~kvlife.errors.KVLifeError`, an ``OSError``), the reason on one
line of stderr and no traceback; 128 + the signal's number when a stop signal
(:data:`STOP_SIGNALS`) ended it, after all it started was ended and removed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TypeAlias

from kvlife.errors import ConfigError, KVLifeError

__all__ = [
    "COMMANDS",
    "STOP_SIGNALS",
    "Stopped",
    "build_parser",
    "child_of_a_command",
    "main",
    "stop_signals_raise",
]

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


#: The signals that stop a ``kvlife`` command the way Ctrl-C does: each is raised as
#: :class:`Stopped` in the main thread, so every ``finally`` runs (ranks and workers
#: ended by PID, temporary directories removed) before the command exits.
STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


class Stopped(BaseException):  # a BaseException, like KeyboardInterrupt, which it generalizes
    """A stop signal arrived; raised in the main thread (not an error of the command)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Within the block, each of :data:`STOP_SIGNALS` raises :class:`Stopped` in the main
    thread; a second one while the first unwinds is ignored, so cleanup is not cut
    short. The previous handlers come back after the block. Off the main thread (where
    Python takes no handlers) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        if not stopping:
            stopping.append(signum)
            raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def child_of_a_command(parent: int) -> None:
    """Set up a worker process of a command (forked or spawned): the stop signals back to
    their defaults (a forked worker inherits :func:`stop_signals_raise`'s handler; the
    command ends its workers by PID), Ctrl-C left to the command, which receives it too.
    The kernel SIGKILLs the worker when ``parent`` dies, however it dies (Linux
    ``PR_SET_PDEATHSIG``), so it never outlives a parent killed by SIGKILL, which no
    handler can see; it exits at once if ``parent`` is gone already."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN if sig == signal.SIGINT else signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


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
        with stop_signals_raise():
            status: int = args.handler(args)
    except (KVLifeError, OSError) as exc:  # a refusal, or a file or directory we cannot use
        print(f"kvlife {args.command}: {exc}", file=sys.stderr)
        return 2
    except Stopped as exc:  # everything it started is ended and removed by now
        print(f"kvlife {args.command}: {exc}", file=sys.stderr)
        return 128 + exc.signum
    return status
