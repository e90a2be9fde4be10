"""What a check exercised: the lifecycle table's rows that fired, the refusal kinds the
runtime counted and the oracle rules that had something to judge (docs/testing-kit.md,
"Coverage"). "0 violations" then says what it is about.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvlife import _lifecycle
from kvlife._lifecycle import TABLE, Event, LoadTicket, State, Transition

__all__ = ["ROWS", "RULES", "Coverage", "recording_rows", "row_name"]


def row_name(row: Transition) -> str:
    """One table row as text: ``SOURCE --event[guard]--> DEST``."""
    guard = f"[{row.guard}]" if row.guard else ""
    return f"{row.source.name} --{row.event.value}{guard}--> {row.dest.name}"


#: Every row of the lifecycle table, by name.
ROWS: tuple[str, ...] = tuple(row_name(r) for r in TABLE)
_BY_MOVE: dict[tuple[State, Event, State], str] = {
    (r.source, r.event, r.dest): row_name(r) for r in TABLE
}

#: Every rule the oracle judges (docs/testing-kit.md, "What the kit checks").
RULES: tuple[str, ...] = (
    "release-once",
    "release-in-flight",
    "misfiled-page",
    "hash-chain",
    "copy-owner",
    "stuck-copy",
    "unreleased",
    "host-leak",
    "device-leak",
    "pending-load",
    "load-bytes",
    "restore-bytes",
    "failed-load",
    "stuck-pin",
    "stuck-pending",
)

#: Refusal kinds kvlife's manager may count (its typed errors' names).
KNOWN_REFUSALS: tuple[str, ...] = (
    "DuplicateAck",
    "ForeignAck",
    "InvalidChunk",
    "LifecycleError",
    "ManagerError",
    "PoolError",
)


@dataclass
class Coverage:
    """Counts of what was reached: table rows, refusal kinds, oracle rules."""

    rows: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    rules: Counter[str] = field(default_factory=Counter)

    def merge(self, other: Coverage) -> None:
        self.rows.update(other.rows)
        self.refusals.update(other.refusals)
        self.rules.update(other.rules)

    def as_dict(self, rows: bool = True) -> dict[str, Any]:
        """Reached (with counts) and never reached, per kind. Without ``rows`` (a runtime
        that is not kvlife's manager) the table rows are not known."""
        kinds = sorted(set(KNOWN_REFUSALS) | set(self.refusals))
        out: dict[str, Any] = {
            "rules": {
                "reached": dict(sorted(self.rules.items())),
                "never": _never(RULES, self.rules),
            },
            "refusals": {
                "reached": dict(sorted(self.refusals.items())),
                "never": _never(kinds, self.refusals),
            },
        }
        if rows:
            out["rows"] = {
                "reached": {r: self.rows[r] for r in ROWS if self.rows[r]},
                "never": _never(ROWS, self.rows),
            }
        return out


def _never(universe: tuple[str, ...] | list[str], reached: Counter[str]) -> list[str]:
    return [name for name in universe if not reached[name]]


@contextlib.contextmanager
def recording_rows(coverage: Coverage) -> Iterator[None]:
    """Count every table row a :class:`~kvlife._lifecycle.Lifecycle` takes in this process
    while the block runs: its submit, load, ack and finish are wrapped (class-level, put
    back after), each call's state before and after naming its row (and the automatic
    release's, when it released)."""
    cls = _lifecycle.Lifecycle
    saved = {name: getattr(cls, name) for name in ("submit", "load", "ack", "finish")}
    events = {"submit": Event.SUBMIT, "load": Event.LOAD, "finish": Event.FINISH}

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            before = self.state
            result = original(self, *args, **kwargs)
            after = self.state
            event = events.get(name)
            if event is None:
                event = Event.LOAD_ACK if args and type(args[0]) is LoadTicket else Event.ACK
            if after is State.RELEASED and before is not State.RELEASED:
                coverage.rows[_BY_MOVE.get((State.FINISHED, Event.RELEASE, after), "?")] += 1
                after = State.FINISHED
            row = _BY_MOVE.get((before, event, after))
            if row is not None:
                coverage.rows[row] += 1
            return result

        call.__name__ = name
        return call

    for name, original in saved.items():
        setattr(cls, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(cls, name, original)
