"""The ``transitions`` twin of :data:`kvlife._lifecycle.TABLE`: table checks and a reference engine.

Test tooling, not shipped. It cross-checks the table the fast path runs:

* **validation** -- every state reachable from ``IDLE``, no dead end but
  ``RELEASED``, every guard known, one row at most per (state, event, guard
  outcome), and ``transitions`` accepts the table (:func:`validate`);
* **reference engine** -- :class:`ReferenceLifecycle` runs the events through
  one shared ``transitions`` machine with its own, deliberately naive
  bookkeeping, so ``tests/test_spec.py`` holds the fast
  :class:`~kvlife.Lifecycle` to it.

(``transitions`` also draws the table: :mod:`kvlife.diagrams`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transitions import Machine, MachineError

from kvlife._lifecycle import (
    AUTOMATIC,
    GUARDS,
    TABLE,
    Event,
    FinishReason,
    State,
    Transition,
    compile_table,
)
from kvlife.errors import (
    DuplicateAck,
    ForeignAck,
    HashingError,
    InvalidChunk,
    InvalidEvent,
    InvalidTransition,
    LifecycleError,
    UnknownChunk,
)
from kvlife.hashing import sglang_page_hashes

__all__ = ["ReferenceLifecycle", "build_machine", "validate"]


def _machine_transitions(table: Sequence[Transition]) -> list[dict[str, Any]]:
    return [
        {
            "trigger": row.event.value,
            "source": row.source,
            "dest": row.dest,
            "conditions": [row.guard] if row.guard else [],
        }
        for row in table
    ]


def build_machine(table: Sequence[Transition] = TABLE) -> Machine:
    """A model-less ``transitions`` machine of ``table``."""
    return Machine(
        model=None,
        states=list(State),
        transitions=_machine_transitions(table),
        initial=State.IDLE,
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )


def validate(table: Sequence[Transition] = TABLE) -> None:
    """Refuse a table with an unreachable state, a dead end, or two rows for one case."""
    compiled = compile_table(table)  # determinism and known guards
    reachable = {State.IDLE}
    frontier = [State.IDLE]
    while frontier:
        state = frontier.pop()
        for row in table:
            if row.source is state and row.dest not in reachable:
                reachable.add(row.dest)
                frontier.append(row.dest)
    if missing := set(State) - reachable:
        raise ValueError(f"states unreachable from IDLE: {sorted(s.name for s in missing)}")
    for state in State:
        if state is not State.RELEASED and not any(k[0] is state for k in compiled):
            raise ValueError(f"{state.name} is a dead end: no row leaves it")
    if any(row.source is State.RELEASED for row in table):
        raise ValueError("RELEASED must be terminal")
    # The transitions machine must accept the same table (it checks states and triggers).
    build_machine(table)


_MACHINE = build_machine()


class _MachineModel:
    """What the shared machine sees of one :class:`ReferenceLifecycle`: its state and guards.

    A separate object, so the machine binds its triggers (``submit``, ``ack``,
    ``finish``, ``release``) here and not over the reference's own methods.
    """

    state: State

    def __init__(self, owner: ReferenceLifecycle) -> None:
        self.owner = owner

    def _inflight_class(self) -> tuple[int, int]:
        """(stores, loads) in flight, each capped at 2, as the guards read them."""
        stores = self.owner.acked.count(False)
        loads = self.owner.loads_acked.count(False)
        return min(stores, 2), min(loads, 2)

    def __getattr__(self, name: str) -> bool:
        """A guard of the table, by name (``transitions`` reads conditions as attributes)."""
        if name not in GUARDS:
            raise AttributeError(name)
        return GUARDS[name](*self._inflight_class())


class ReferenceLifecycle:
    """The slow, obviously-right twin of :class:`~kvlife.Lifecycle`, driven by ``transitions``.

    Same events, same refusals, same observable fields; bookkeeping kept in
    plain lists so it shares no code with the fast path. Every instance is a
    model of the one shared machine; :meth:`close` detaches it.
    """

    def __init__(self, rid: object, *, page_size: int, prior_hash: str | None = None) -> None:
        self.rid = rid
        self.page_size = page_size
        self.prior_hash = prior_hash
        self.submitted: list[tuple[str, ...]] = []  # keys per chunk, by seq
        self.acked: list[bool] = []  # acked flag per chunk, by seq
        self.loads: list[tuple[str, ...]] = []  # keys per load, by load seq
        self.loads_acked: list[bool] = []  # acked flag per load, by load seq
        self.finish_reason: FinishReason | None = None
        self.releases = 0
        self._model = _MachineModel(self)
        _MACHINE.add_model(self._model)

    def close(self) -> None:
        """Detach from the shared machine."""
        _MACHINE.remove_model(self._model)

    @property
    def machine(self) -> Machine:
        """The one shared ``transitions`` machine every reference runs on."""
        return _MACHINE

    @property
    def state(self) -> State:
        return self._model.state

    @property
    def inflight(self) -> int:
        return self.acked.count(False) + self.loads_acked.count(False)

    @property
    def tokens_submitted(self) -> int:
        return sum(len(k) for k in self.submitted) * self.page_size

    @property
    def last_hash(self) -> str | None:
        last = self.prior_hash
        for keys, acked in zip(self.submitted, self.acked, strict=True):
            if not acked:
                break
            last = keys[-1]
        return last

    @property
    def chain_tail(self) -> str | None:
        return self.submitted[-1][-1] if self.submitted else self.prior_hash

    def _allowed(self, event: Event) -> bool:
        return event.value in _MACHINE.get_triggers(self.state)

    def _fire(self, event: Event) -> None:
        """Trigger ``event`` on the machine; its guards see the bookkeeping as it is now."""
        try:
            moved = self._model.trigger(event.value)  # type: ignore[attr-defined]
        except MachineError:
            moved = False
        if not moved:
            raise self._error(InvalidTransition, event, "no transition")

    def _fire_automatic(self) -> None:
        """Fire every automatic event whose guard holds, after the bookkeeping changed."""
        for auto in AUTOMATIC:
            if self._allowed(auto) and self._model.trigger(auto.value):  # type: ignore[attr-defined]
                self.releases += 1

    def _error(self, kind: type[LifecycleError], event: Event, why: str) -> LifecycleError:
        return kind(why, event=event.value, state=self.state, rid=self.rid, ident=id(self))

    def submit(self, tokens: Sequence[int]) -> int:
        """Record a chunk; return its seq."""
        if not tokens or len(tokens) % self.page_size:
            raise self._error(InvalidChunk, Event.SUBMIT, "not whole pages")
        if not self._allowed(Event.SUBMIT):
            raise self._error(InvalidTransition, Event.SUBMIT, "no transition")
        try:
            keys = tuple(sglang_page_hashes(tokens, self.page_size, self.chain_tail))
        except HashingError:
            raise self._error(InvalidChunk, Event.SUBMIT, "bad tokens") from None
        self._fire(Event.SUBMIT)
        self.submitted.append(keys)
        self.acked.append(False)
        self._fire_automatic()
        return len(self.submitted) - 1

    def ack(self, owner: ReferenceLifecycle, seq: int) -> None:
        """Settle chunk ``seq`` of ``owner`` (refused unless ``owner`` is this one)."""
        self._settle(owner, seq, self.acked)

    def load(self, keys: Sequence[str]) -> int:
        """Record a load of ``keys``; return its load seq."""
        if isinstance(keys, str) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise self._error(InvalidChunk, Event.LOAD, "bad keys")
        self._fire(Event.LOAD)
        self.loads.append(tuple(keys))
        self.loads_acked.append(False)
        return len(self.loads) - 1

    def ack_load(self, owner: ReferenceLifecycle, seq: int) -> None:
        """Settle load ``seq`` of ``owner`` (refused unless ``owner`` is this one)."""
        self._settle(owner, seq, self.loads_acked)

    def _settle(self, owner: ReferenceLifecycle, seq: int, acked: list[bool]) -> None:
        event = Event.ACK if acked is self.acked else Event.LOAD_ACK
        if owner is not self:
            raise self._error(ForeignAck, event, "foreign")
        if not 0 <= seq < len(acked):
            raise self._error(UnknownChunk, event, "unknown")
        if acked[seq]:
            raise self._error(DuplicateAck, event, "duplicate")
        self._fire(event)  # guards see the counts before this ack
        acked[seq] = True
        self._fire_automatic()  # release sees the count after it

    def finish(self, reason: object = FinishReason.FINISHED) -> None:
        """End decoding with ``reason``."""
        if not isinstance(reason, FinishReason):
            raise self._error(InvalidEvent, Event.FINISH, "bad reason")
        self._fire(Event.FINISH)
        self.finish_reason = reason
        self._fire_automatic()
