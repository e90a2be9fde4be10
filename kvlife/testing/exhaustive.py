"""Every interleaving of a small configuration, run on a real runtime and checked.

The configuration: ``requests`` request lives that share one rid, started one
after the other (a life starts once the one before it *finished*, while that
one's copies may still be in flight: the reused-rid case); each decodes up to
``chunks`` steps of one page, and each step makes exactly one chunk due;
finishes with any of ``reasons`` at any point (before its first step, between
any two, after the last); every submitted chunk is completed, successfully
(and, with ``failures``, also failed), in any order relative to everything
else. The scheduler polls after each completion. After the last event the
run is closed and checked (everything released once, no host page left).

The enumeration is a depth-first walk over a model of what may happen next;
each complete interleaving is replayed on a fresh adapter (by default a
:class:`~kvlife.testing.ManagerAdapter` over kvlife's own manager) under the
:class:`~kvlife.testing.Oracle`, which checks every rule after every event.
Nothing is sampled. A violation prunes every interleaving that shares the
prefix up to the violating event (they all break the same way), so a buggy
runtime is checked fast; the report keeps the shortest trace of each broken rule.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from kvlife._lifecycle import FinishReason
from kvlife.errors import KVLifeError
from kvlife.testing.adapter import (
    Complete,
    Finish,
    InlineStore,
    InvariantViolation,
    KitEvent,
    ManagerAdapter,
    Oracle,
    RuntimeAdapter,
    Start,
    Step,
)

__all__ = [
    "CheckConfig",
    "CheckConfigError",
    "CheckReport",
    "Violation",
    "check_exhaustively",
    "count_interleavings",
]

#: The rid every life of the configuration shares.
RID = "r"


class CheckConfigError(KVLifeError, ValueError):
    """Bounds the exhaustive checker refuses (out of range, or not finish reasons)."""


@dataclass(frozen=True)
class CheckConfig:
    """The bounds of one exhaustive check."""

    #: Request lives sharing one rid, started one after the other.
    requests: int = 2
    #: Most chunks (one-page decode steps) each life offloads.
    chunks: int = 3
    #: Finish reasons tried at each finish.
    reasons: tuple[FinishReason, ...] = tuple(FinishReason)
    #: Whether each completion is also tried as a failed copy.
    failures: bool = False
    #: Tokens per page.
    page_size: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.requests <= 4 or not 0 <= self.chunks <= 6:
            raise CheckConfigError("requests must be in [1, 4] and chunks in [0, 6]")
        if not self.reasons or not all(isinstance(r, FinishReason) for r in self.reasons):
            raise CheckConfigError(f"reasons must be FinishReasons, got {self.reasons!r}")
        if self.page_size < 1:
            raise CheckConfigError(f"page_size must be positive, got {self.page_size}")

    def as_dict(self) -> dict[str, Any]:
        """Plain dict, for JSON."""
        return {
            "requests": self.requests,
            "chunks": self.chunks,
            "reasons": [r.value for r in self.reasons],
            "failures": self.failures,
            "page_size": self.page_size,
        }


@dataclass
class Violation:
    """A broken rule and the shortest interleaving found that breaks it."""

    rule: str
    message: str
    trace: list[str]

    def as_dict(self) -> dict[str, Any]:
        """Plain dict, for JSON."""
        return {"rule": self.rule, "message": self.message, "trace": self.trace}


@dataclass
class CheckReport:
    """What one exhaustive check explored and found."""

    config: CheckConfig
    #: Distinct interleavings run (complete ones, and violating prefixes, each once).
    interleavings: int = 0
    #: Complete interleavings the configuration has (equal to ``interleavings`` when none fails).
    total: int = 0
    #: Interleavings (or prefixes) that broke a rule.
    violating: int = 0
    #: The shortest trace of each broken rule, shortest first.
    violations: list[Violation] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no interleaving broke a rule."""
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        """Plain dict, for JSON."""
        return {
            "interleavings": self.interleavings,
            "total": self.total,
            "violating": self.violating,
            "violations": [v.as_dict() for v in self.violations],
            "elapsed_s": round(self.elapsed_s, 3),
            "config": self.config.as_dict(),
        }


# Per life: (started, chunks submitted, finished, completed chunks as a bit mask).
_Life = tuple[bool, int, bool, int]
_State = tuple[_Life, ...]


def _prompt(cfg: CheckConfig) -> tuple[int, ...]:
    """One whole page and one token: every life starts with the same prompt."""
    return tuple(range(1, cfg.page_size + 2))


def _moves(cfg: CheckConfig, state: _State) -> Iterator[tuple[KitEvent, _State]]:
    """Every event that may happen next, with the state after it, in a fixed order."""
    outcomes = (True, False) if cfg.failures else (True,)
    for i, (started, k, finished, done) in enumerate(state):

        def now(life: _Life, i: int = i) -> _State:
            return (*state[:i], life, *state[i + 1 :])

        if not started:
            if i == 0 or state[i - 1][2]:
                yield Start(RID, _prompt(cfg)), now((True, 0, False, 0))
            continue
        if not finished:
            if k < cfg.chunks:
                first = 100 * (i + 1) + k * cfg.page_size
                tokens = tuple(range(first, first + cfg.page_size))
                yield Step(i, tokens), now((True, k + 1, False, done))
            for reason in cfg.reasons:
                yield Finish(i, reason), now((True, k, True, done))
        for j in range(k):
            if not done >> j & 1:
                for ok in outcomes:
                    yield Complete(i, j, ok), now((True, k, finished, done | 1 << j))


def _initial(cfg: CheckConfig) -> _State:
    return tuple((False, 0, False, 0) for _ in range(cfg.requests))


def count_interleavings(cfg: CheckConfig) -> int:
    """How many complete interleavings ``cfg`` has (counted, not run)."""

    @cache
    def count(state: _State) -> int:
        total = 0
        for _, after in _moves(cfg, state):
            total += count(after)
        return total or 1

    return count(_initial(cfg))


def _run(adapter: RuntimeAdapter, trace: Sequence[KitEvent]) -> tuple[int, str, str] | None:
    """Replay ``trace`` and close; ``(index of the breaking event, rule, message)`` or None."""
    oracle = Oracle(adapter)
    index = 0
    try:
        for index, event in enumerate(trace):  # noqa: B007 (index is read after a raise)
            oracle.apply(event)
        index = len(trace)
        oracle.close()
    except InvariantViolation as exc:
        return index, exc.rule, str(exc)
    except Exception as exc:  # the runtime raised: a double free, a refused event, ...
        return index, type(exc).__name__, f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(Exception):  # a failure here is already reported
            adapter.close()
    return None


class _Explorer:
    """A depth-first walk of one subtree: runs its leaves, keeps counts and shortest traces."""

    def __init__(self, cfg: CheckConfig, adapter_factory: Callable[[], RuntimeAdapter]) -> None:
        self.cfg = cfg
        self.adapter_factory = adapter_factory
        self.interleavings = 0
        self.violating = 0
        self.shortest: dict[str, Violation] = {}
        self.prefix: list[KitEvent] = []
        self.progress: Callable[[int], None] | None = None

    def explore(self, state: _State) -> int:
        """Walk the subtree; return the prefix length to unwind to (a large number: none)."""
        prefix = self.prefix
        moved = False
        for event, after in _moves(self.cfg, state):
            moved = True
            prefix.append(event)
            unwind = self.explore(after)
            prefix.pop()
            if unwind <= len(prefix):
                return unwind
        if moved:
            return _NO_UNWIND
        self.interleavings += 1
        if self.progress is not None:
            self.progress(1)
        found = _run(self.adapter_factory(), prefix)
        if found is None:
            return _NO_UNWIND
        index, rule, message = found
        self.violating += 1
        steps = [str(e) for e in prefix[: index + 1]]
        if index == len(prefix):
            steps.append("close")
        self.keep(Violation(rule, message, steps))
        return index + 1  # every interleaving with this prefix breaks the same way

    def keep(self, violation: Violation) -> None:
        """Keep ``violation`` if it is the shortest of its rule so far."""
        old = self.shortest.get(violation.rule)
        if old is None or len(violation.trace) < len(old.trace):
            self.shortest[violation.rule] = violation

    def subtree(
        self, task: tuple[tuple[KitEvent, ...], _State]
    ) -> tuple[int, int, list[Violation]]:
        """Explore one subtree from a frontier prefix (a worker's task)."""
        self.interleavings = self.violating = 0
        self.shortest = {}
        self.prefix = list(task[0])
        self.explore(task[1])
        return self.interleavings, self.violating, list(self.shortest.values())


_NO_UNWIND = 1 << 30
_WORKER: _Explorer | None = None


def _work(task: tuple[tuple[KitEvent, ...], _State]) -> tuple[int, int, list[Violation]]:
    assert _WORKER is not None
    return _WORKER.subtree(task)


def _frontier(cfg: CheckConfig, width: int) -> list[tuple[tuple[KitEvent, ...], _State]]:
    """Prefixes (in walk order) whose subtrees partition the whole tree, at least ``width``."""
    level: list[tuple[tuple[KitEvent, ...], _State]] = [((), _initial(cfg))]
    while len(level) < width:
        deeper: list[tuple[tuple[KitEvent, ...], _State]] = []
        for prefix, state in level:
            moves = list(_moves(cfg, state))
            if not moves:
                deeper.append((prefix, state))
            deeper.extend(((*prefix, event), after) for event, after in moves)
        if len(deeper) == len(level):
            break
        level = deeper
    return level


def _default_factory(cfg: CheckConfig) -> Callable[[], RuntimeAdapter]:
    def factory() -> RuntimeAdapter:
        return ManagerAdapter(
            page_size=cfg.page_size,
            host_pages=cfg.requests * cfg.chunks + 1,
            device_pages=cfg.requests * (cfg.chunks + 2),
            store=InlineStore(),
        )

    return factory


def check_exhaustively(
    cfg: CheckConfig | None = None,
    adapter_factory: Callable[[], RuntimeAdapter] | None = None,
    *,
    jobs: int = 1,
    progress: Callable[[int], None] | None = None,
) -> CheckReport:
    """Run every interleaving of ``cfg`` on fresh adapters; report the count and violations.

    ``jobs`` > 1 splits the walk into subtrees run by forked worker processes
    (where the platform can fork); a violation then prunes only inside its subtree.
    """
    global _WORKER
    cfg = cfg or CheckConfig()
    explorer = _Explorer(cfg, adapter_factory or _default_factory(cfg))
    report = CheckReport(cfg, total=count_interleavings(cfg))
    t0 = time.perf_counter()
    if jobs > 1 and "fork" in multiprocessing.get_all_start_methods():
        tasks = _frontier(cfg, jobs * 16)
        _WORKER = explorer
        try:
            with multiprocessing.get_context("fork").Pool(jobs, _quiet_worker) as pool:
                for runs, violating, found in pool.imap(_work, tasks):
                    report.interleavings += runs
                    report.violating += violating
                    for violation in found:
                        explorer.keep(violation)
                    if progress is not None:
                        progress(runs)
        finally:
            _WORKER = None
    else:
        explorer.progress = progress
        explorer.explore(_initial(cfg))
        report.interleavings, report.violating = explorer.interleavings, explorer.violating
    report.elapsed_s = time.perf_counter() - t0
    report.violations = sorted(explorer.shortest.values(), key=lambda v: (len(v.trace), v.rule))
    return report


def _quiet_worker() -> None:
    import torch

    torch.set_num_threads(1)
