"""Every interleaving of a small configuration, run on a real runtime and checked.

A depth-first walk over a model of what may happen next (:func:`_moves`) runs each complete
interleaving on a fresh adapter under the :class:`~kvlife.testing.Oracle` (guide:
docs/testing-kit.md, "Every interleaving: kvlife check").
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cache, partial
from typing import Any

import torch

from kvlife._lifecycle import FinishReason
from kvlife.errors import ConfigError
from kvlife.testing.adapter import ManagerAdapter, RuntimeAdapter
from kvlife.testing.events import (
    Close,
    Complete,
    Finish,
    KitEvent,
    Poll,
    Resume,
    Return,
    Start,
    Step,
)
from kvlife.testing.options import KitOptions, Progress, progress_of
from kvlife.testing.oracle import InvariantViolation, Oracle
from kvlife.testing.report import format_trace, rule_of

__all__ = ["CheckConfig", "CheckReport", "Violation", "check_exhaustively", "count_interleavings"]

#: The rid every life of the configuration shares.
RID = "r"


@dataclass(frozen=True)
class CheckConfig:
    """The bounds of one exhaustive check, and the kit's options."""

    #: Request lives sharing one rid, started one after the other.
    requests: int = 2
    #: Most chunks (one-page decode steps) each life offloads.
    chunks: int = 2
    #: Tokens per page (an adapter's own ``page_size`` wins).
    page_size: int = 2
    #: Failures, aborts, retractions, resumes, the stuck-copy deadline.
    options: KitOptions = field(default_factory=KitOptions)
    #: Lives that are a conversation returning on the same rid, right after the first life
    #: (life 1 returns life 0, life 2 returns life 1, ...; the other requests follow): a
    #: new life whose prompt extends the earlier one's tokens, restored by one load (its
    #: copy 0), then up to ``return_chunks`` chunks. Only for adapters with ``restore``.
    returns: int = 0
    #: Most chunks a returning life offloads after its load.
    return_chunks: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.requests <= 4 or not 0 <= self.chunks <= 6:
            raise ConfigError("requests must be in [1, 4] and chunks in [0, 6]")
        if not 0 <= self.returns <= 2 or not 0 <= self.return_chunks <= self.chunks:
            raise ConfigError(
                f"returns must be in [0, 2] and return_chunks in [0, chunks], got "
                f"{self.returns} and {self.return_chunks}"
            )
        if self.page_size < 1:
            raise ConfigError(f"page_size must be positive, got {self.page_size}")
        if not isinstance(self.options, KitOptions):
            raise ConfigError(f"options must be KitOptions, got {self.options!r}")

    @property
    def host_pages_needed(self) -> int:
        """Host pages with which a runtime that submits each due chunk at once never defers
        one: every chunk of every life in flight, plus a page a store write still holds."""
        returned = self.returns * (self.chunks + self.return_chunks + 3)  # loads promote pages
        return self.requests * self.chunks + 1 + returned

    @property
    def lives(self) -> int:
        """Every life of the configuration: the requests, then the returns."""
        return self.requests + self.returns

    def as_dict(self) -> dict[str, Any]:
        """Plain dict, for JSON."""
        return {
            "requests": self.requests,
            "chunks": self.chunks,
            "returns": self.returns,
            "return_chunks": self.return_chunks,
            "reasons": [r.value for r in self.options.reasons],
            "page_size": self.page_size,
            **self.options.as_dict(),
        }


@dataclass
class Violation:
    """A broken rule and the shortest interleaving found that breaks it."""

    rule: str
    message: str
    trace: list[str]
    #: The trace as events, for :func:`~kvlife.testing.replay_trace`.
    events: list[KitEvent] = field(default_factory=list, repr=False)

    def __str__(self) -> str:
        head = self.message
        if not head.startswith(f"[{self.rule}]"):
            head = f"[{self.rule}] {head}"
        return f"{head}\n{format_trace(self.trace)}"

    def as_dict(self) -> dict[str, Any]:
        """Plain dict, for JSON."""
        return {"rule": self.rule, "message": self.message, "trace": self.trace}


@dataclass
class CheckReport:
    """What one exhaustive check explored and found."""

    config: CheckConfig
    #: Runs: complete interleavings, and pruned prefixes, each once.
    interleavings: int = 0
    #: Complete interleavings the configuration has (``interleavings`` if nothing pruned).
    total: int = 0
    #: Runs that broke a rule.
    violating: int = 0
    #: Runs that completed a chunk the runtime deferred (host pool full); see
    #: ``config.host_pages_needed``.
    deferred: int = 0
    #: The adapter's progress model.
    progress: Progress = "poll"
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
            "deferred": self.deferred,
            "progress": self.progress,
            "violations": [v.as_dict() for v in self.violations],
            "elapsed_s": round(self.elapsed_s, 3),
            "config": self.config.as_dict(),
        }


# Per life: (started, chunks submitted, finished (0 no, 1 yes, 2 retracted), completed
# chunks as a bit mask; under "drain" bit _SETTLED: polled since it finished).
_Life = tuple[bool, int, int, int]
_State = tuple[_Life, ...]
_SETTLED = 1 << 7


def _moves(
    cfg: CheckConfig, state: _State, progress: Progress = "poll"
) -> Iterator[tuple[KitEvent, _State]]:
    """Every event that may happen next, with the state after it, in a fixed order."""
    opts = cfg.options
    prompt = tuple(range(1, cfg.page_size + 2))  # one whole page and one token, for every life
    outcomes = (True, False) if opts.failures and progress == "poll" else (True,)
    for i, (started, k, finished, done) in enumerate(state):

        def now(life: _Life, i: int = i) -> _State:
            return (*state[:i], life, *state[i + 1 :])

        returning = 1 <= i <= cfg.returns
        if not started:
            before = state[i - 1][2] if i else 1
            if returning:
                if before:  # the load is copy 0, in flight from the start
                    yield Return(i - 1), now((True, 1, 0, 0))
                continue
            if before:
                yield Start(RID, prompt), now((True, 0, 0, 0))
            if before == 2 and opts.resumes:
                yield Resume(i - 1), now((True, 0, 0, 0))
            continue
        if not finished:
            # A returning life decodes only once its load (copy 0) completed.
            if k < (cfg.return_chunks + 1 if returning else cfg.chunks) and (
                not returning or done & 1
            ):
                first = 100 * (i + 1) + (k - returning) * cfg.page_size
                tokens = tuple(range(first, first + cfg.page_size))
                yield Step(i, tokens), now((True, k + 1, 0, done))
            for reason in opts.reasons:
                fin = 2 if reason is FinishReason.RETRACTED else 1
                yield Finish(i, reason), now((True, k, fin, done & ~_SETTLED))
        if progress == "poll":
            for j in range(k):
                if not done >> j & 1:
                    for ok in outcomes:
                        yield Complete(i, j, ok), now((True, k, finished, done | 1 << j))
    if progress == "drain":
        after = tuple(
            (s, k, f, (1 << k) - 1 | (_SETTLED if f else 0)) if s else (s, k, f, d)
            for s, k, f, d in state
        )
        if after != state:
            yield Poll(), after


def _initial(cfg: CheckConfig) -> _State:
    return tuple((False, 0, 0, 0) for _ in range(cfg.lives))


def count_interleavings(cfg: CheckConfig, progress: Progress = "poll") -> int:
    """How many complete interleavings ``cfg`` has under ``progress`` (counted, not run)."""

    @cache
    def count(state: _State) -> int:
        return sum(count(after) for _, after in _moves(cfg, state, progress)) or 1

    return count(_initial(cfg))


#: The rule :func:`_run` gives a completion of a chunk the runtime deferred (host pool full).
_DEFERRED = "deferred"


def _run(
    adapter: RuntimeAdapter, trace: Sequence[KitEvent], options: KitOptions
) -> tuple[int, str, str] | None:
    """Replay ``trace`` and close; ``(index of the breaking event, rule, message)`` or None.

    A completion of a chunk the runtime has not submitted (it deferred it: host pool
    full) comes back with the rule :data:`_DEFERRED`.
    """
    oracle = Oracle(adapter, options)
    free = getattr(adapter, "host_pages_free", None)
    full: set[int] = set()  # lives that had a step while the host pool was full
    index = 0

    def events() -> Iterator[KitEvent]:
        nonlocal index
        for event in trace:
            if isinstance(event, Complete):
                oracle.check()  # registers the copies submitted so far
                missing = event.chunk >= len(oracle.lives[event.life].copies)
                if missing and (free is None or event.life in full):
                    raise InvariantViolation(_DEFERRED, f"chunk {event.chunk} deferred")
            if isinstance(event, Step) and free is not None and free() == 0:
                full.add(event.life)
            yield event
            index += 1
        yield Close()

    try:
        oracle.run(events())
    except Exception as exc:  # a broken rule, or the runtime raised (a double free, ...)
        rule = rule_of(exc)
        return index, rule, str(exc) if isinstance(exc, InvariantViolation) else f"{rule}: {exc}"
    return None


class _Explorer:
    """A depth-first walk of one subtree: runs its leaves, keeps counts and shortest traces."""

    def __init__(
        self,
        cfg: CheckConfig,
        adapter_factory: Callable[[], RuntimeAdapter],
        progress: Progress,
    ) -> None:
        self.cfg = cfg
        self.adapter_factory = adapter_factory
        self.model = progress
        self.interleavings = 0
        self.violating = 0
        self.deferred = 0
        self.shortest: dict[str, Violation] = {}
        self.prefix: list[KitEvent] = []
        self.progress: Callable[[int], None] | None = None

    def explore(self, state: _State) -> int:
        """Walk the subtree; return the prefix length to unwind to (a large number: none)."""
        prefix = self.prefix
        moved = False
        for event, after in _moves(self.cfg, state, self.model):
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
        found = _run(self.adapter_factory(), prefix, self.cfg.options)
        if found is None:
            return _NO_UNWIND
        index, rule, message = found
        if rule == _DEFERRED:
            self.deferred += 1
            return index + 1  # every interleaving with this prefix completes that chunk too
        self.violating += 1
        events = prefix[: index + 1]
        if index == len(prefix):
            events.append(Close())
        self.keep(Violation(rule, message, [str(e) for e in events], events))
        return index + 1  # every interleaving with this prefix breaks the same way

    def keep(self, violation: Violation) -> None:
        """Keep ``violation`` if it is the shortest of its rule so far."""
        old = self.shortest.get(violation.rule)
        if old is None or len(violation.trace) < len(old.trace):
            self.shortest[violation.rule] = violation


_NO_UNWIND = 1 << 30
_WORKER: _Explorer | None = None


def _start_worker(parent: int) -> None:
    """A forked worker: ended with the command that forked it (by PID, on any stop signal,
    or by the kernel if that process is killed outright), one torch thread."""
    from kvlife.cli import child_of_a_command

    child_of_a_command(parent)
    torch.set_num_threads(1)


def _work(task: tuple[tuple[KitEvent, ...], _State]) -> tuple[int, int, int, list[Violation]]:
    """Explore one subtree from a frontier prefix (a worker's task)."""
    assert _WORKER is not None
    sub = _Explorer(_WORKER.cfg, _WORKER.adapter_factory, _WORKER.model)
    sub.prefix = list(task[0])
    sub.explore(task[1])
    return sub.interleavings, sub.violating, sub.deferred, list(sub.shortest.values())


def _frontier(
    cfg: CheckConfig, width: int, progress: Progress
) -> list[tuple[tuple[KitEvent, ...], _State]]:
    """Prefixes (in walk order) whose subtrees partition the whole tree, at least ``width``."""
    level: list[tuple[tuple[KitEvent, ...], _State]] = [((), _initial(cfg))]
    while len(level) < width:
        deeper: list[tuple[tuple[KitEvent, ...], _State]] = []
        for prefix, state in level:
            moves = list(_moves(cfg, state, progress))
            if not moves:
                deeper.append((prefix, state))
            deeper.extend(((*prefix, event), after) for event, after in moves)
        if len(deeper) == len(level):
            break
        level = deeper
    return level


def check_exhaustively(
    cfg: CheckConfig | None = None,
    adapter_factory: Callable[[], RuntimeAdapter] | None = None,
    *,
    jobs: int = 1,
    progress: Callable[[int], None] | None = None,
) -> CheckReport:
    """Run every interleaving of ``cfg`` on fresh adapters; report the count and violations.

    ``progress`` and ``page_size`` are read from one adapter made first. ``jobs`` > 1 runs
    subtrees in forked workers (where possible); a violation prunes only inside its subtree.
    """
    global _WORKER
    cfg = cfg or CheckConfig()
    factory = adapter_factory or partial(
        ManagerAdapter,
        page_size=cfg.page_size,
        host_pages=cfg.host_pages_needed,
        device_pages=cfg.lives * (cfg.lives * (cfg.chunks + 1) + 3),  # resumes, returns grow
    )
    probe = factory()
    try:
        model = progress_of(probe)
        returns = cfg.returns if getattr(probe, "restore", None) is not None else 0
        cfg = replace(cfg, page_size=probe.page_size, returns=returns)
    finally:
        with contextlib.suppress(Exception):
            probe.close()
    explorer = _Explorer(cfg, factory, model)
    total = count_interleavings(cfg, model)
    t0 = time.perf_counter()
    if jobs > 1 and "fork" in multiprocessing.get_all_start_methods():
        _WORKER = explorer
        tasks = _frontier(cfg, jobs * 16, model)
        pool = multiprocessing.get_context("fork").Pool
        try:  # one torch thread per worker: the workers are the parallelism. Whatever ends
            # the walk early (a stop signal raised as kvlife.cli.Stopped, an error) leaves
            # the block, whose exit terminates every worker by PID.
            with pool(jobs, _start_worker, (os.getpid(),)) as p:
                for runs, violating, deferred, found in p.imap(_work, tasks):
                    explorer.interleavings += runs
                    explorer.violating += violating
                    explorer.deferred += deferred
                    for violation in found:
                        explorer.keep(violation)
                    if progress is not None:
                        progress(runs)
        finally:
            _WORKER = None
    else:
        explorer.progress = progress
        explorer.explore(_initial(cfg))
    return CheckReport(
        cfg,
        interleavings=explorer.interleavings,
        total=total,
        violating=explorer.violating,
        deferred=explorer.deferred,
        progress=model,
        violations=sorted(explorer.shortest.values(), key=lambda v: (len(v.trace), v.rule)),
        elapsed_s=time.perf_counter() - t0,
    )
