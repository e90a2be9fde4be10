"""One readable failure (:class:`KitFailure`): the broken rule, the shortest run found, and
how to replay it (:func:`replay_trace`); docs/testing-kit.md, "When it fails"."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvlife.testing.adapter import RuntimeAdapter
from kvlife.testing.events import KitEvent
from kvlife.testing.options import KitOptions
from kvlife.testing.oracle import InvariantViolation, Oracle

__all__ = ["KitFailure", "format_trace", "replay_trace", "rule_of"]


def rule_of(exc: BaseException) -> str:
    """The rule an exception broke: an :class:`InvariantViolation`'s rule, else its type name
    (a runtime that raised: ``PoolError``, ``ManagerError``, ...)."""
    return exc.rule if isinstance(exc, InvariantViolation) else type(exc).__name__


def format_trace(trace: Sequence[object]) -> str:
    """``trace`` as numbered lines."""
    return "\n".join(f"  {i:2d}. {step}" for i, step in enumerate(trace, 1))


class KitFailure(InvariantViolation):
    """The runtime broke a rule (or raised): the rule, the run that shows it, the seed."""

    def __init__(
        self,
        rule: str,
        message: str,
        events: Sequence[KitEvent],
        *,
        seed: int | None = None,
        how: str = "",
    ) -> None:
        self.events = list(events)
        self.trace = [str(e) for e in self.events]
        self.seed = seed
        self.detail = message
        #: The replay file written for it (``kvlife check --replay``), if one was.
        self.replay_path: str | None = None
        seeded = f", seed {seed}" if seed is not None else ""
        head = f"{message}\nshortest failing run found ({len(self.trace)} events{seeded}):\n"
        super().__init__(rule, head + format_trace(self.trace) + (f"\n{how}" if how else ""))


def replay_trace(
    adapter_factory: Callable[[], RuntimeAdapter],
    events: Sequence[KitEvent],
    options: KitOptions | None = None,
) -> Oracle:
    """Run ``events`` (a failure's ``events``) on a fresh adapter under the oracle; the
    oracle. Raises what the run raises; ends with a close if the trace does."""
    oracle = Oracle(adapter_factory(), options)
    oracle.run(events)
    return oracle
