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
from kvlife.testing.coverage import Coverage, recording_rows
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

__all__ = [
    "CheckConfig",
    "CheckReport",
    "Violation",
    "check_exhaustively",
    "count_interleavings",
    "count_runs",
]

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
    #: Partial-order reduction (sleep sets over :func:`_dependent`): one interleaving of
    #: each class of interleavings that differ only in the order of independent events.
    #: ``False`` (``--no-reduction``): the full walk.
    reduction: bool = True

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

    @classmethod
    def from_dict(cls, data: dict[str, Any], options: KitOptions) -> CheckConfig:
        """The config :meth:`as_dict` wrote (its options given apart)."""
        return cls(
            int(data["requests"]),
            int(data["chunks"]),
            int(data.get("page_size", 2)),
            options,
            returns=int(data.get("returns", 0)),
            return_chunks=int(data.get("return_chunks", 0)),
            reduction=bool(data.get("reduction", True)),
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain dict, for JSON."""
        return {
            "requests": self.requests,
            "chunks": self.chunks,
            "returns": self.returns,
            "return_chunks": self.return_chunks,
            "reasons": [r.value for r in self.options.reasons],
            "page_size": self.page_size,
            "reduction": self.reduction,
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
    #: Complete interleavings the walk runs if nothing is pruned (``interleavings`` then):
    #: one per class of equivalent interleavings under the reduction, else all of them.
    total: int = 0
    #: Complete interleavings the configuration has (the full walk's ``total``).
    full: int = 0
    #: Of the runs, prefixes the reduction left with no move to take (each way on is walked
    #: from an equivalent prefix), run and closed.
    blocked: int = 0
    #: What the runs reached: table rows, refusal kinds, oracle rules.
    coverage: Coverage = field(default_factory=Coverage)
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
            "full": self.full,
            "blocked": self.blocked,
            "coverage": self.coverage.as_dict(rows=bool(self.coverage.rows)),
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


#: One move of the model: the life it belongs to (-1: a draining poll, of every life), the
#: event, and the state after it.
_Move = tuple[int, KitEvent, _State]


def _moves(cfg: CheckConfig, state: _State, progress: Progress = "poll") -> Iterator[_Move]:
    """Every event that may happen next, with its life and the state after it, in a fixed
    order. :func:`_dependent`, below, says which two of them commute."""
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
                    yield i, Return(i - 1), now((True, 1, 0, 0))
                continue
            if before:
                yield i, Start(RID, prompt), now((True, 0, 0, 0))
            if before == 2 and opts.resumes:
                yield i, Resume(i - 1), now((True, 0, 0, 0))
            continue
        if not finished:
            # A returning life decodes only once its load (copy 0) completed.
            if k < (cfg.return_chunks + 1 if returning else cfg.chunks) and (
                not returning or done & 1
            ):
                first = 100 * (i + 1) + (k - returning) * cfg.page_size
                tokens = tuple(range(first, first + cfg.page_size))
                yield i, Step(i, tokens), now((True, k + 1, 0, done))
            for reason in opts.reasons:
                fin = 2 if reason is FinishReason.RETRACTED else 1
                yield i, Finish(i, reason), now((True, k, fin, done & ~_SETTLED))
        if progress == "poll":
            for j in range(k):
                if not done >> j & 1:
                    for ok in outcomes:
                        yield i, Complete(i, j, ok), now((True, k, finished, done | 1 << j))
    if progress == "drain":
        after = tuple(
            (s, k, f, (1 << k) - 1 | (_SETTLED if f else 0)) if s else (s, k, f, d)
            for s, k, f, d in state
        )
        if after != state:
            yield -1, Poll(), after


def _is_load(cfg: CheckConfig, life: int, event: KitEvent) -> bool:
    """Whether ``event`` completes a load: a returning life's copy 0."""
    return isinstance(event, Complete) and 1 <= life <= cfg.returns and event.chunk == 0


def _dependent(
    cfg: CheckConfig, a: tuple[int, KitEvent], b: tuple[int, KitEvent], host_bounded: bool
) -> bool:
    """Whether moves ``a`` and ``b`` (life, event), both possible next, may not commute:
    the relation the reduction trusts (docs/testing-kit.md, "Partial-order reduction").
    Independent moves commute in :func:`_moves` (neither enables nor disables the other)
    and, in a runtime that keeps each life's state by the life, touch nothing in common.

    Dependent:

    - a draining poll and anything (it completes every life's copies);
    - two moves of one life, except a completion and a finish of that life, and a store
      copy's completion and a step (a step does not read what an ack settled; a finish
      releases at its last ack whichever comes first) while the host pool cannot defer;
    - ``rid``: a start, resume or return (a new life on the rid) and any move of another
      life: a runtime that keys state by rid meets the new life there (a late ack, a
      finish, a release of an older life), and a return's load looks up what the older
      life's completions stored;
    - host tier: a load's completion and the completion of a store copy of a later life,
      both ok (a store copy submitted after the load must not write the host pages the
      load reads: pins evicted under a load); failed copies write or read nothing kept;
    - host pool, while it is smaller than ``cfg.host_pages_needed`` (a runtime may defer
      a chunk): a step (it takes host pages) and another life's step or store completion
      (it frees them).

    Device pages are no object here: a runtime frees a life's pages at its release, which
    the oracle checks when it happens, and which free page a step gets changes nothing the
    oracle sees.
    """
    (i, x), (j, y) = a, b
    if i < 0 or j < 0:
        return True
    if i == j:
        for p, q in ((x, y), (y, x)):
            if isinstance(p, Finish) and isinstance(q, Complete):
                return False
            if isinstance(p, Step) and isinstance(q, Complete) and not host_bounded:
                return _is_load(cfg, i, q)  # a load's completion lets its life decode
        return True
    if isinstance(x, Start | Resume | Return) or isinstance(y, Start | Resume | Return):
        return True
    if isinstance(x, Complete) and isinstance(y, Complete):
        loads = (_is_load(cfg, i, x), _is_load(cfg, j, y))
        if not (x.ok and y.ok) or loads[0] == loads[1]:
            return False
        return (j > i) if loads[0] else (i > j)  # the store copy's life came later
    if host_bounded and (isinstance(x, Step) or isinstance(y, Step)):
        return not any(isinstance(e, Finish) or _is_load(cfg, n, e) for n, e in (a, b))
    return False


def _initial(cfg: CheckConfig) -> _State:
    return tuple((False, 0, 0, 0) for _ in range(cfg.lives))


#: A move as the sleep sets keep it: its life and its event.
_Key = tuple[int, KitEvent]
_Sleep = frozenset[_Key]


class _Walk:
    """The reduced walk's choices: which moves of a state to take, with the sleep set each
    child inherits (sleep sets: Godefroid 1996). With ``reduce`` off, every move, no
    sleep. Shared by the explorer, the frontier and the count, so all three agree."""

    def __init__(self, cfg: CheckConfig, progress: Progress, host_bounded: bool) -> None:
        self.cfg = cfg
        self.progress = progress
        self.reduce = cfg.reduction
        self.host_bounded = host_bounded
        self._dep: dict[tuple[_Key, _Key], bool] = {}

    def dependent(self, a: _Key, b: _Key) -> bool:
        found = self._dep.get((a, b))
        if found is None:
            found = self._dep[a, b] = _dependent(self.cfg, a, b, self.host_bounded)
        return found

    def children(
        self, state: _State, sleep: _Sleep
    ) -> tuple[bool, list[tuple[KitEvent, _State, _Sleep]]]:
        """(whether ``state`` has any move, the moves to take with each child's sleep set).
        A state with moves but none to take is blocked: every way on is taken elsewhere."""
        moves = list(_moves(self.cfg, state, self.progress))
        if not self.reduce:
            return bool(moves), [(event, after, sleep) for _, event, after in moves]
        # The newest life's moves first: the move taken first is never put to sleep, so of
        # independent moves of two lives the older life's (a late ack) comes last.
        moves.sort(key=lambda move: -move[0])
        taken: list[tuple[KitEvent, _State, _Sleep]] = []
        done: list[_Key] = []
        for life, event, after in moves:
            key = (life, event)
            if key in sleep:
                continue
            child = frozenset(s for s in (*sleep, *done) if not self.dependent(s, key))
            taken.append((event, after, child))
            done.append(key)
        return bool(moves), taken

    def count(self) -> int:
        """Runs this walk makes (counted, not run): its leaves and its blocked states."""

        @cache
        def count(state: _State, sleep: _Sleep) -> int:
            _, taken = self.children(state, sleep)
            return sum(count(after, child) for _, after, child in taken) or 1

        return count(_initial(self.cfg), frozenset())


def count_interleavings(cfg: CheckConfig, progress: Progress = "poll") -> int:
    """How many complete interleavings ``cfg`` has under ``progress`` (counted, not run):
    the full walk's, whatever ``cfg.reduction`` says."""

    @cache
    def count(state: _State) -> int:
        return sum(count(after) for _, _, after in _moves(cfg, state, progress)) or 1

    return count(_initial(cfg))


def count_runs(cfg: CheckConfig, progress: Progress = "poll", host_bounded: bool = False) -> int:
    """How many complete interleavings a check of ``cfg`` runs: one per class of
    equivalent interleavings under the reduction, every one without it."""
    return _Walk(cfg, progress, host_bounded).count()


#: The rule :func:`_run` gives a completion of a chunk the runtime deferred (host pool full).
_DEFERRED = "deferred"


def _run(
    adapter: RuntimeAdapter,
    trace: Sequence[KitEvent],
    options: KitOptions,
    coverage: Coverage | None = None,
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
    finally:
        if coverage is not None:
            coverage.rules.update(oracle.reached)
            counts = getattr(adapter, "refusal_counts", None)
            with contextlib.suppress(Exception):
                coverage.refusals.update(counts() if counts is not None else {})
    return None


class _Explorer:
    """A depth-first walk of one subtree: runs its leaves, keeps counts and shortest traces."""

    def __init__(
        self,
        cfg: CheckConfig,
        adapter_factory: Callable[[], RuntimeAdapter],
        progress: Progress,
        host_bounded: bool = False,
    ) -> None:
        self.cfg = cfg
        self.adapter_factory = adapter_factory
        self.model = progress
        self.walk = _Walk(cfg, progress, host_bounded)
        #: Runs of states the reduction left with no move to take (see :meth:`explore`).
        self.blocked = 0
        self.coverage = Coverage()
        self.interleavings = 0
        self.violating = 0
        self.deferred = 0
        self.shortest: dict[str, Violation] = {}
        self.prefix: list[KitEvent] = []
        self.progress: Callable[[int], None] | None = None

    def explore(self, state: _State, sleep: _Sleep = frozenset()) -> int:
        """Walk the subtree; return the prefix length to unwind to (a large number: none)."""
        prefix = self.prefix
        any_move, taken = self.walk.children(state, sleep)
        for event, after, child in taken:
            prefix.append(event)
            unwind = self.explore(after, child)
            prefix.pop()
            if unwind <= len(prefix):
                return unwind
        if taken:
            return _NO_UNWIND
        # A leaf, or a state the reduction blocked (each way on is walked from an equivalent
        # prefix): run it too, closed, so that every prefix the walk reaches is run once.
        self.blocked += any_move
        self.interleavings += 1
        if self.progress is not None:
            self.progress(1)
        found = _run(self.adapter_factory(), prefix, self.cfg.options, self.coverage)
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


_Task = tuple[tuple[KitEvent, ...], _State, _Sleep]


def _work(task: _Task) -> tuple[int, int, int, int, list[Violation], Coverage]:
    """Explore one subtree from a frontier prefix (a worker's task)."""
    assert _WORKER is not None
    sub = _Explorer(_WORKER.cfg, _WORKER.adapter_factory, _WORKER.model)
    sub.walk = _WORKER.walk
    sub.prefix = list(task[0])
    with recording_rows(sub.coverage):
        sub.explore(task[1], task[2])
    found = list(sub.shortest.values())
    return sub.interleavings, sub.violating, sub.deferred, sub.blocked, found, sub.coverage


def _frontier(walk: _Walk, width: int) -> list[_Task]:
    """Prefixes (in walk order) whose subtrees partition the walked tree, at least
    ``width`` of them, each with its sleep set."""
    level: list[_Task] = [((), _initial(walk.cfg), frozenset())]
    while len(level) < width:
        deeper: list[_Task] = []
        for prefix, state, sleep in level:
            _, taken = walk.children(state, sleep)
            if not taken:  # a leaf or a blocked state: a run of its own
                deeper.append((prefix, state, sleep))
            deeper.extend(((*prefix, event), after, child) for event, after, child in taken)
        if len(deeper) == len(level):
            break
        level = deeper
    return level


def default_factory(cfg: CheckConfig) -> Callable[[], RuntimeAdapter]:
    """kvlife's manager, sized for ``cfg``: a host pool that never defers a chunk."""
    return partial(
        ManagerAdapter,
        page_size=cfg.page_size,
        host_pages=cfg.host_pages_needed,
        device_pages=cfg.lives * (cfg.lives * (cfg.chunks + 1) + 3),  # resumes, returns grow
    )


def _probe(
    cfg: CheckConfig, factory: Callable[[], RuntimeAdapter]
) -> tuple[CheckConfig, Progress, bool]:
    """One adapter made first: ``cfg`` with its page size (and no returns without
    ``restore``), its progress model, and whether its host pool may defer a chunk (a
    runtime that does not say is taken to: the reduction then orders steps and
    completions of different lives)."""
    probe = factory()
    try:
        model = progress_of(probe)
        returns = cfg.returns if getattr(probe, "restore", None) is not None else 0
        cfg = replace(cfg, page_size=probe.page_size, returns=returns)
        free = getattr(probe, "host_pages_free", None)
        host_bounded = free is None or free() < cfg.host_pages_needed
    finally:
        with contextlib.suppress(Exception):
            probe.close()
    return cfg, model, host_bounded


def check_exhaustively(
    cfg: CheckConfig | None = None,
    adapter_factory: Callable[[], RuntimeAdapter] | None = None,
    *,
    jobs: int = 1,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> CheckReport:
    """Run every interleaving of ``cfg`` on fresh adapters; report the count and violations.

    ``progress`` and ``page_size`` are read from one adapter made first. ``jobs`` > 1 runs
    subtrees in forked workers (where possible); a violation prunes only inside its subtree.
    ``on_total`` hears the number of runs the walk makes if nothing is pruned, before the
    first; ``progress`` hears each run done (for a progress bar).
    """
    global _WORKER
    cfg = cfg or CheckConfig()
    factory = adapter_factory or default_factory(cfg)
    cfg, model, host_bounded = _probe(cfg, factory)
    explorer = _Explorer(cfg, factory, model, host_bounded)
    total = explorer.walk.count()
    if on_total is not None:
        on_total(total)
    t0 = time.perf_counter()
    if jobs > 1 and "fork" in multiprocessing.get_all_start_methods():
        _WORKER = explorer
        tasks = _frontier(explorer.walk, jobs * 16)
        pool = multiprocessing.get_context("fork").Pool
        try:  # one torch thread per worker: the workers are the parallelism. Whatever ends
            # the walk early (a stop signal raised as kvlife.cli.Stopped, an error) leaves
            # the block, whose exit terminates every worker by PID.
            with pool(jobs, _start_worker, (os.getpid(),)) as p:
                for runs, violating, deferred, blocked, found, cov in p.imap(_work, tasks):
                    explorer.coverage.merge(cov)
                    explorer.interleavings += runs
                    explorer.violating += violating
                    explorer.deferred += deferred
                    explorer.blocked += blocked
                    for violation in found:
                        explorer.keep(violation)
                    if progress is not None:
                        progress(runs)
        finally:
            _WORKER = None
    else:
        explorer.progress = progress
        with recording_rows(explorer.coverage):
            explorer.explore(_initial(cfg))
    return CheckReport(
        cfg,
        interleavings=explorer.interleavings,
        total=total,
        full=count_interleavings(cfg, model) if cfg.reduction else total,
        blocked=explorer.blocked,
        coverage=explorer.coverage,
        violating=explorer.violating,
        deferred=explorer.deferred,
        progress=model,
        violations=sorted(explorer.shortest.values(), key=lambda v: (len(v.trace), v.rule)),
        elapsed_s=time.perf_counter() - t0,
    )
