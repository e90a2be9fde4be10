"""Hypothesis strategies for the kit: rids that get reused, prompts, decode steps, events.

Small pools on purpose, so reused rids and chunks that look like another life's are the
common case. :func:`replay` runs an :func:`events` sequence: the stateless twin of
:class:`~kvlife.testing.RuntimeMachine`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from typing import TypeVar

from hypothesis import strategies as st

from kvlife._lifecycle import FinishReason
from kvlife.testing.adapter import RuntimeAdapter
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
from kvlife.testing.oracle import Oracle

__all__ = [
    "RIDS",
    "copy_outcomes",
    "decode_tokens",
    "events",
    "finish_reasons",
    "prompts",
    "replay",
    "rids",
    "sampled",
]

_T = TypeVar("_T")

#: The rid pool: small, so reuse is frequent.
RIDS = ("r0", "r1", "r2")


def sampled(options: Sequence[_T]) -> st.SearchStrategy[_T]:
    """``st.sampled_from(options)``, drawn by index. Hypothesis labels a ``sampled_from`` by
    its elements' ``hash()``, which for ``str``, enums and most objects differs from one
    process to the next (``PYTHONHASHSEED``, addresses), and the labels steer its search: a
    derandomized run would test other cases in each process. A ``range`` hashes alike
    everywhere."""
    return st.sampled_from(range(len(options))).map(tuple(options).__getitem__)


def rids(pool: Sequence[str] = RIDS) -> st.SearchStrategy[str]:
    """A rid from a small pool."""
    return sampled(pool)


def prompts(max_tokens: int = 7) -> st.SearchStrategy[tuple[int, ...]]:
    """A prompt of 1 to ``max_tokens`` ids from a tiny vocabulary (equal prompts are common)."""
    return st.lists(st.integers(0, 3), min_size=1, max_size=max_tokens).map(tuple)


def decode_tokens(max_tokens: int = 4) -> st.SearchStrategy[tuple[int, ...]]:
    """The tokens one or a few decode steps produce."""
    return st.lists(st.integers(0, 5), min_size=1, max_size=max_tokens).map(tuple)


def finish_reasons() -> st.SearchStrategy[FinishReason]:
    """Finished, aborted or retracted."""
    return sampled(tuple(FinishReason))


def copy_outcomes() -> st.SearchStrategy[bool]:
    """A copy's outcome: mostly success, sometimes a failed copy."""
    return st.sampled_from((True, True, True, False))


def events(max_events: int = 40) -> st.SearchStrategy[list[KitEvent]]:
    """Event sequences; lives and chunks are picked by index, modulo what exists when replayed."""
    pick = st.integers(0, 7)
    event: st.SearchStrategy[KitEvent] = st.one_of(
        st.builds(Start, rids(), prompts()),
        st.builds(Step, pick, decode_tokens()),
        st.builds(Step, pick, decode_tokens()),
        st.builds(Finish, pick, finish_reasons()),
        st.builds(Resume, pick),
        st.builds(Return, pick),
        st.builds(Complete, pick, pick, copy_outcomes(), st.booleans()),
        st.builds(Complete, pick, pick, copy_outcomes(), st.booleans()),
        st.just(Poll()),
    )
    return st.lists(event, max_size=max_events)


def replay(
    adapter_factory: Callable[[], RuntimeAdapter],
    sequence: Sequence[KitEvent],
    *,
    max_unreleased: int = 6,
    max_tokens: int = 24,
) -> Oracle:
    """Run ``sequence`` on a fresh adapter under the oracle, then close; the oracle.

    Indices are taken modulo the lives (or copies) that exist at that point,
    and events that cannot happen then (no running life, a rid still running)
    are skipped, so any drawn sequence is a valid run. Raises on the first
    broken rule; the adapter is closed either way.
    """
    oracle = Oracle(adapter_factory())
    resolved = (_concrete(oracle, e, max_unreleased, max_tokens) for e in sequence)
    oracle.run(chain(filter(None, resolved), [Close()]))  # each resolved just before it runs
    return oracle


def _concrete(
    oracle: Oracle, event: KitEvent, max_unreleased: int, max_tokens: int
) -> KitEvent | None:
    """``event`` with its indices resolved against the oracle's lives now, or None to skip."""
    room = oracle.unreleased() < max_unreleased
    if isinstance(event, Start):
        return event if room and oracle.idle([event.rid]) else None
    if isinstance(event, Step):
        growing = oracle.growing(max_tokens)
        return Step(growing[event.life % len(growing)].index, event.tokens) if growing else None
    if isinstance(event, Finish):
        running = oracle.running()
        return Finish(running[event.life % len(running)].index, event.reason) if running else None
    if isinstance(event, Resume):
        ready = oracle.resumable()
        return Resume(ready[event.life % len(ready)].index) if ready and room else None
    if isinstance(event, Return):
        back = oracle.returnable(max_tokens)
        return Return(back[event.life % len(back)].index) if back and room else None
    if isinstance(event, Complete):
        oracle.check()  # registers the copies submitted so far
        waiting = oracle.in_flight()
        if not waiting:
            return None
        copy = waiting[event.chunk % len(waiting)]
        life = oracle.owner(copy)
        return Complete(life.index, life.copies.index(copy), event.ok, event.poll)
    return event
