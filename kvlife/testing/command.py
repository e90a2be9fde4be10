"""``kvlife check``: run every interleaving of a small configuration on a runtime.

By default the runtime is kvlife's own manager; ``--runtime module:factory`` names a
zero-argument callable that returns a :class:`~kvlife.testing.RuntimeAdapter` (yours),
imported from the current directory or the installed packages.

A runtime that cannot be loaded is refused before any interleaving runs, with one
:class:`~kvlife.errors.ConfigError` naming the problem (``kvlife check`` prints it on
one line and exits 2): a module that cannot be imported or raises while it is (a
syntax error, a relative name, ``sys.exit``), a factory that is missing, not callable,
raises, or returns something without the adapter's members, and an import or a first
factory call still running after ``--runtime-timeout`` seconds. Both run on a daemon
thread joined with that timeout: the module is imported once, in this process, and the
adapter that first call returns is the one the check starts with, so nothing is built
twice; a call that never returns is left behind on its daemon thread, which does not
keep the process alive (a subprocess probe would import the runtime twice and still
leave the second import without a deadline).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import reprlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import cast

from kvlife._lifecycle import FinishReason
from kvlife.errors import ConfigError
from kvlife.testing.adapter import RuntimeAdapter
from kvlife.testing.exhaustive import CheckConfig, CheckReport, check_exhaustively
from kvlife.testing.loading import RUNTIME_TIMEOUT_S, _one_line, _within, load_factory
from kvlife.testing.options import KitOptions

__all__ = ["RUNTIME_TIMEOUT_S", "adapter_problem", "load_factory", "load_runtime", "register"]

#: ``kvlife check`` with no bounds (issue 35 item 6): two lives on one rid, the first
#: storing up to two chunks, the second its conversation returning (a load) and storing
#: up to two more; every finish reason (a retraction), failed copies, exhaustively under
#: the reduction: 10,408 runs of the 263,700 interleavings (docs/testing-kit.md).
DEFAULT = CheckConfig(requests=1, chunks=2, returns=1, return_chunks=2)

#: What an object needs to be driven as a RuntimeAdapter: its methods, then its data.
_METHODS = tuple(sorted(n for n, v in vars(RuntimeAdapter).items() if callable(v) and n[0] != "_"))
_DATA = tuple(sorted(n for n in RuntimeAdapter.__annotations__ if n[0] != "_"))


def _reasons(text: str) -> tuple[FinishReason, ...]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    try:
        return tuple(FinishReason(n) for n in names)
    except ValueError:
        known = ",".join(r.value for r in FinishReason)
        raise argparse.ArgumentTypeError(f"reasons are a comma list of {known}") from None


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, finite, got {text!r}")
    return value


def _cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _jobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= _cores():
        raise argparse.ArgumentTypeError(
            f"expected 1 to {_cores()} (this machine's cores; more workers than cores only "
            f"share them), got {text!r}"
        )
    return value


def adapter_problem(obj: object) -> str | None:
    """Why ``obj`` cannot be driven as a :class:`RuntimeAdapter` (the members it lacks, or
    has as something that is not a method), or ``None`` if it can."""
    missing = []
    for name in (*_METHODS, *_DATA):
        try:
            member = getattr(obj, name)
        except Exception:  # AttributeError, or a property that raises
            missing.append(name)
            continue
        if name in _METHODS and not callable(member):
            missing.append(name)
    if not missing:
        return None
    return f"not a RuntimeAdapter: missing {', '.join(sorted(missing))}"


def _safe_repr(obj: object) -> str:
    try:
        return _one_line(reprlib.repr(obj), 80)
    except Exception:  # a __repr__ that raises
        return f"a {type(obj).__name__}"


def load_runtime(spec: str, *, timeout: float = RUNTIME_TIMEOUT_S) -> Callable[[], RuntimeAdapter]:
    """The factory ``spec`` names, checked: imported (:func:`load_factory`), called once
    under ``timeout`` seconds, its result checked to be a :class:`RuntimeAdapter`.

    The returned factory hands out that first adapter, then calls the factory. Each
    problem is one :class:`~kvlife.errors.ConfigError` naming it; nothing has run yet.
    """
    factory = load_factory(spec, timeout=timeout)
    what = f"--runtime {spec}: {spec.partition(':')[2]}()"
    first = _within(timeout, factory, what)
    problem = adapter_problem(first)
    if problem is not None:
        raise ConfigError(f"{what} returned {_safe_repr(first)}, {problem}")
    made = [cast(RuntimeAdapter, first)]

    def first_then_factory() -> RuntimeAdapter:
        return made.pop() if made else cast(RuntimeAdapter, factory())

    return first_then_factory


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``check`` to the ``kvlife`` command."""
    d = DEFAULT
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
        "--returns",
        type=int,
        default=d.returns,
        help="lives that are the first life's conversation returning on its rid, its prefix "
        "restored by a load (runtimes with restore; default: 0)",
    )
    p.add_argument(
        "--return-chunks",
        type=int,
        default=None,
        help="most chunks a returning life offloads after its load (default: "
        f"{d.return_chunks}, or --chunks if fewer)",
    )
    p.add_argument(
        "--runtime",
        metavar="MODULE:FACTORY",
        help="a zero-argument callable returning your RuntimeAdapter (default: kvlife's manager)",
    )
    p.add_argument(
        "--runtime-timeout",
        type=_timeout,
        default=RUNTIME_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds the --runtime import, then its factory's first call, may each take "
        f"(default: {RUNTIME_TIMEOUT_S:g})",
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
        type=_timeout,
        default=o.stuck_after,
        metavar="SECONDS",
        help=f"report a call blocked this long as stuck-copy (default: {o.stuck_after})",
    )
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per page")
    p.add_argument(
        "--reduction",
        action=argparse.BooleanOptionalAction,
        default=d.reduction,
        help="partial-order reduction: run one interleaving of each class that differs only "
        "in the order of independent events (default: on; --no-reduction: the full walk)",
    )
    p.add_argument(
        "--jobs",
        type=_jobs,
        default=_cores(),
        help=f"worker processes splitting the walk, 1 to this machine's {_cores()} cores "
        "(more do not help: each is one busy core) (default: all of them)",
    )
    p.add_argument(
        "--vllm-manager",
        metavar="MODULE:FACTORY",
        help="instead, run the property-based kit on a vLLM 0.32 OffloadingManager: "
        "FACTORY(chunks) returns one with a tier of CHUNKS blocks (kvlife.testing.vllm; "
        "needs vLLM; --no-failures: no failed stores)",
    )
    p.add_argument(
        "--replay",
        metavar="FILE",
        help="re-run one replay file (a counterexample this command or a kit wrote) exactly "
        "on its runtime (or --runtime; a vLLM manager's: on its manager, or --vllm-manager); "
        "exit 1 if it still fails, 0 if it passes now, 2 if it is refused",
    )
    p.add_argument(
        "--replay-dir",
        metavar="DIR",
        help="where each violation's replay file is written (default: kvlife-replays in "
        "the temporary directory)",
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
    return CheckConfig(
        args.requests,
        args.chunks,
        args.page_size,
        options,
        returns=args.returns,
        return_chunks=(
            min(DEFAULT.return_chunks, args.chunks)
            if args.return_chunks is None
            else args.return_chunks
        ),
        reduction=args.reduction,
    )


def _vllm_kit(what: str) -> ModuleType:
    """kvlife.testing.vllm, imported only where asked for (it imports vLLM)."""
    try:
        from kvlife.testing import vllm as manager_kit
    except ImportError as exc:
        raise ConfigError(f"{what} needs vLLM installed ({exc})") from None
    return manager_kit


def _check_vllm_manager(args: argparse.Namespace) -> int:
    """``--vllm-manager``: the vLLM manager kit; each failure written as a replay file."""
    return cast(
        int,
        _vllm_kit("--vllm-manager").check_command(
            args.vllm_manager,
            failures=args.failures,
            json_out=args.json,
            timeout=args.runtime_timeout,
            stuck_after=args.stuck_after,
            replay_dir=args.replay_dir,
        ),
    )


def _replay(args: argparse.Namespace) -> int:
    """``--replay FILE``: run it exactly, say whether it still fails. A vLLM manager's
    replay re-runs on its manager (``--vllm-manager`` overrides it), a kit replay on its
    runtime (``--runtime`` overrides it); the other flag is refused (ReplayKindError)."""
    from kvlife.testing import replay as replays
    from kvlife.testing.exhaustive import default_factory

    kind = replays.kind_of(args.replay)
    if kind == "vllm-manager":
        if args.runtime:
            raise replays.ReplayKindError(args.replay, kind, "kit", " (--runtime)")
        manager_kit = _vllm_kit("--replay of a vllm-manager replay")
        return cast(
            int,
            manager_kit.replay_command(
                args.replay,
                spec=args.vllm_manager,
                json_out=args.json,
                timeout=args.runtime_timeout,
            ),
        )
    if args.vllm_manager:
        raise replays.ReplayKindError(args.replay, kind, "vllm-manager", " (--vllm-manager)")
    replay = replays.load(args.replay)
    spec = args.runtime or replay.runtime
    if spec:
        factory = load_runtime(spec, timeout=args.runtime_timeout)
    elif replay.config is not None:
        try:
            config = CheckConfig.from_dict(replay.config, replay.options)
        except (KeyError, TypeError, ValueError) as exc:
            raise replays.ReplayFileError(args.replay, f"a malformed config: {exc!r}") from None
        factory = default_factory(config)
    else:
        raise replays.ReplayFileError(args.replay, "names no runtime; give --runtime")
    found = replays.rerun(replay, factory)
    on = spec or "kvlife OffloadManager"
    return replays.print_rerun(args.replay, replay, on, found, json_out=args.json)


def _save_replays(
    report: CheckReport,
    factory: Callable[[], RuntimeAdapter] | None,
    args: argparse.Namespace,
) -> list[str]:
    """Each violation as a shrunk replay file; their paths."""
    from kvlife.testing import replay as replays
    from kvlife.testing.exhaustive import default_factory

    made = factory or default_factory(report.config)
    paths = []
    for violation in report.violations:
        replay = replays.Replay(
            list(violation.events),
            report.config.options,
            violation.rule,
            violation.message,
            runtime=args.runtime,
            config=report.config.as_dict(),
            source="check",
        )
        paths.append(str(replays.save(replay, made, directory=args.replay_dir)))
    return paths


def _check(args: argparse.Namespace) -> int:
    if args.replay:
        return _replay(args)
    if args.vllm_manager:
        return _check_vllm_manager(args)
    cfg = _config(args)
    factory = load_runtime(args.runtime, timeout=args.runtime_timeout) if args.runtime else None
    jobs = args.jobs
    if args.json or not sys.stderr.isatty():
        report = check_exhaustively(cfg, factory, jobs=jobs)
    else:  # long walks show how far they are (on stderr: stdout stays the summary)
        report = _with_progress_bar(cfg, factory, jobs)
    paths = _save_replays(report, factory, args)
    if args.json:
        print(json.dumps({**report.as_dict(), "replays": paths}))
    else:
        _print_summary(report, args.runtime)
        for path in paths:
            print(f"replay file: {path} (kvlife check --replay {path})")
    return 0 if report.ok else 1


def _with_progress_bar(
    cfg: CheckConfig, factory: Callable[[], RuntimeAdapter] | None, jobs: int
) -> CheckReport:
    """:func:`check_exhaustively` under a progress bar: interleavings done of the total,
    the rate and the time so far."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        Task,
        TimeElapsedColumn,
    )
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Task) -> Text:
            return Text(f"{task.speed or 0:,.0f}/s")

    columns = (BarColumn(), MofNCompleteColumn(), Rate(), TimeElapsedColumn())
    with Progress("interleavings", *columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("check", total=None)
        return check_exhaustively(
            cfg,
            factory,
            jobs=jobs,
            progress=lambda n: bar.advance(task, n),
            on_total=lambda n: bar.update(task, total=n),
        )


def _print_summary(report: CheckReport, runtime: str | None) -> None:
    cfg = report.config
    o = cfg.options
    reasons = ",".join(r.value for r in o.reasons)
    switches = "".join(
        f", {name}" for name, on in (("failures", o.failures), ("resumes", o.resumes)) if on
    )
    print(
        f"kvlife check: {runtime or 'kvlife OffloadManager'} ({report.progress} progress), "
        f"{cfg.lives} lives sharing a rid, "
        + (
            f"{cfg.requests} started and up to {cfg.chunks} chunks each, "
            f"{cfg.returns} returning (a load, then up to {cfg.return_chunks} chunks), "
            if cfg.returns
            else f"up to {cfg.chunks} chunks each, "
        )
        + f"reasons {reasons}{switches}"
    )
    reduced = (
        f" under partial-order reduction ({report.blocked} of them prefixes it blocked, "
        f"run closed; the full walk has {report.full})"
        if cfg.reduction
        else " (the full walk)"
    )
    print(
        f"  {report.interleavings} interleavings run (of {report.total}){reduced} in "
        f"{report.elapsed_s:.1f} s; {report.violating} broke a rule"
        + (f"; {report.deferred} deferred a chunk (host pool full)" if report.deferred else "")
    )
    cov = report.coverage.as_dict(rows=bool(report.coverage.rows))
    for kind in ("rows", "refusals", "rules"):
        if kind in cov:
            reached, never = cov[kind]["reached"], cov[kind]["never"]
            name = {"rows": "table rows", "refusals": "refusal kinds", "rules": "oracle rules"}
            print(
                f"  coverage, {name[kind]}: {len(reached)} of {len(reached) + len(never)} "
                f"reached" + (f"; never: {', '.join(never)}" if never else "")
            )
    for violation in report.violations:
        print(f"violation {violation}")
    print("OK: every interleaving kept every rule" if report.ok else "FAILED")
