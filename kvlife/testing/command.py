"""``kvlife check``: run every interleaving of a small configuration on a runtime.

By default the runtime is kvlife's own manager; ``--runtime module:factory`` names a
zero-argument callable that returns a :class:`~kvlife.testing.RuntimeAdapter` (yours),
imported from the current directory or the installed packages.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import cast

from kvlife._lifecycle import FinishReason
from kvlife.errors import ConfigError
from kvlife.testing.adapter import RuntimeAdapter
from kvlife.testing.exhaustive import CheckConfig, CheckReport, check_exhaustively
from kvlife.testing.options import KitOptions

__all__ = ["load_factory", "register"]


def _reasons(text: str) -> tuple[FinishReason, ...]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    try:
        return tuple(FinishReason(n) for n in names)
    except ValueError:
        known = ",".join(r.value for r in FinishReason)
        raise argparse.ArgumentTypeError(f"reasons are a comma list of {known}") from None


def load_factory(spec: str) -> Callable[[], RuntimeAdapter]:
    """``"module:factory"`` (``factory`` may be dotted: ``module:Class.method``) -> callable.

    The current directory is searched first, as ``python -m`` does. Refused with
    :class:`~kvlife.testing.exhaustive.ConfigError` if it cannot be imported or called.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--runtime wants module:factory, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--runtime {spec}: cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"--runtime {spec}: {module_name} has no {attr!r}") from None
    if not callable(target):
        raise ConfigError(f"--runtime {spec}: {attr!r} is not callable")
    return cast(Callable[[], RuntimeAdapter], target)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``check`` to the ``kvlife`` command."""
    d = CheckConfig()
    o = d.options
    p = subparsers.add_parser(
        "check",
        help="run every interleaving of a small configuration and check the lifecycle rules",
        description=(
            "Enumerate every interleaving (not a sample) of REQUESTS lives sharing one rid, "
            "each offloading up to CHUNKS one-page chunks, finishing with any reason at any "
            "point (a retracted life's successor may be its resume), with every copy "
            "completed in any order (or, for a runtime whose poll drains, a poll between any "
            "two events); run each on the runtime (kvlife's manager with the scripted copy "
            "engine, or --runtime) and check the rules after every event. Exit 1 on a "
            "violation, with its shortest trace."
        ),
    )
    p.add_argument("--requests", type=int, default=d.requests, help="lives sharing one rid")
    p.add_argument("--chunks", type=int, default=d.chunks, help="most chunks per life")
    p.add_argument(
        "--runtime",
        metavar="MODULE:FACTORY",
        help="a zero-argument callable returning your RuntimeAdapter (default: kvlife's manager)",
    )
    p.add_argument(
        "--reasons",
        type=_reasons,
        default=None,
        metavar="LIST",
        help="finish reasons to try, comma separated (default: finished,aborted,retracted)",
    )
    p.add_argument(
        "--failures",
        action=argparse.BooleanOptionalAction,
        default=o.failures,
        help="also try every copy as a failure (default: on; --no-failures for a runtime "
        "with no per-copy failure path)",
    )
    p.add_argument(
        "--resumes",
        action=argparse.BooleanOptionalAction,
        default=o.resumes,
        help="a retracted life may be resumed (default: on)",
    )
    p.add_argument(
        "--stuck-after",
        type=float,
        default=o.stuck_after,
        metavar="SECONDS",
        help=f"report a call blocked this long as stuck-copy (default: {o.stuck_after})",
    )
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per page")
    p.add_argument(
        "--jobs", type=int, default=1, help=f"worker processes (this machine: {os.cpu_count()})"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    p.set_defaults(handler=_check)


def _config(args: argparse.Namespace) -> CheckConfig:
    reasons = args.reasons or tuple(FinishReason)
    if FinishReason.FINISHED not in reasons:
        raise ConfigError("--reasons must include finished")
    options = KitOptions(
        failures=args.failures,
        aborts=FinishReason.ABORTED in reasons,
        retractions=FinishReason.RETRACTED in reasons,
        resumes=args.resumes,
        stuck_after=args.stuck_after,
    )
    return CheckConfig(args.requests, args.chunks, args.page_size, options)


def _check(args: argparse.Namespace) -> int:
    cfg = _config(args)
    factory = load_factory(args.runtime) if args.runtime else None
    report = check_exhaustively(cfg, factory, jobs=max(1, args.jobs))
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        _print_summary(report, args.runtime)
    return 0 if report.ok else 1


def _print_summary(report: CheckReport, runtime: str | None) -> None:
    cfg = report.config
    o = cfg.options
    reasons = ",".join(r.value for r in o.reasons)
    switches = "".join(
        f", {name}" for name, on in (("failures", o.failures), ("resumes", o.resumes)) if on
    )
    print(
        f"kvlife check: {runtime or 'kvlife OffloadManager'} ({report.progress} progress), "
        f"{cfg.requests} lives sharing a rid, up to {cfg.chunks} chunks each, "
        f"reasons {reasons}{switches}"
    )
    print(
        f"  {report.interleavings} interleavings run (of {report.total}) in "
        f"{report.elapsed_s:.1f} s; {report.violating} broke a rule"
        + (f"; {report.deferred} deferred a chunk (host pool full)" if report.deferred else "")
    )
    for violation in report.violations:
        print(f"violation {violation}")
    print("OK: every interleaving kept every rule" if report.ok else "FAILED")
