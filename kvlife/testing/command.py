"""``kvlife check``: run every interleaving of a small configuration on kvlife's manager."""

from __future__ import annotations

import argparse
import json
import os

from kvlife._lifecycle import FinishReason
from kvlife.testing.exhaustive import CheckConfig, CheckReport, check_exhaustively

__all__ = ["register"]


def _reasons(text: str) -> tuple[FinishReason, ...]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    try:
        return tuple(FinishReason(n) for n in names)
    except ValueError:
        known = ",".join(r.value for r in FinishReason)
        raise argparse.ArgumentTypeError(f"reasons are a comma list of {known}") from None


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``check`` to the ``kvlife`` command."""
    d = CheckConfig()
    p = subparsers.add_parser(
        "check",
        help="run every interleaving of a small configuration and check the lifecycle rules",
        description=(
            "Enumerate every interleaving (not a sample) of REQUESTS lives sharing one rid, "
            "each offloading up to CHUNKS one-page chunks, finishing with any of REASONS at "
            "any point, with every copy completed in any order; run each on kvlife's manager "
            "with the scripted copy engine and check the rules after every event. Exit 1 on "
            "a violation, with its shortest trace."
        ),
    )
    p.add_argument("--requests", type=int, default=d.requests, help="lives sharing one rid")
    p.add_argument("--chunks", type=int, default=d.chunks, help="most chunks per life")
    p.add_argument(
        "--reasons",
        type=_reasons,
        default=d.reasons,
        metavar="LIST",
        help="finish reasons to try, comma separated (default: finished,aborted,retracted)",
    )
    p.add_argument("--failures", action="store_true", help="also try every copy as a failure")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per page")
    p.add_argument(
        "--jobs", type=int, default=1, help=f"worker processes (this machine: {os.cpu_count()})"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    p.set_defaults(handler=_check)


def _check(args: argparse.Namespace) -> int:
    cfg = CheckConfig(args.requests, args.chunks, args.reasons, args.failures, args.page_size)
    report = check_exhaustively(cfg, jobs=max(1, args.jobs))
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        _print_summary(report)
    return 0 if report.ok else 1


def _print_summary(report: CheckReport) -> None:
    cfg = report.config
    reasons = ",".join(r.value for r in cfg.reasons)
    print(
        f"kvlife check: {cfg.requests} lives sharing a rid, up to {cfg.chunks} chunks each, "
        f"reasons {reasons}{', failures' if cfg.failures else ''}"
    )
    print(
        f"  {report.interleavings} interleavings run (of {report.total}) in "
        f"{report.elapsed_s:.1f} s; {report.violating} broke a rule"
    )
    for violation in report.violations:
        print(f"violation [{violation.rule}]: {violation.message}")
        for i, step in enumerate(violation.trace, 1):
            print(f"  {i:2d}. {step}")
    print("OK: every interleaving kept every rule" if report.ok else "FAILED")
