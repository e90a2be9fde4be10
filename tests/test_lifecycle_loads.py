"""Loads in the lifecycle: host pages copied back into device pages, acked to their own life.

Each scenario is a bug class seen in serving engines' load paths, and each runs
against a seeded twin of the Lifecycle that has the bug, so the test is shown
to fail on it:

- device pages a load writes into released while it is in flight (vLLM #46951,
  LMCache #4939: blocks reallocated under a load);
- a retracted request re-admitted with a store and a load in flight at once
  (vLLM #46014);
- an abort during a load whose pages then never come back (vllm-ascend #16662);
- a late load ack reaching a new request that reused the rid.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from kvlife import (
    DuplicateAck,
    Event,
    FinishReason,
    ForeignAck,
    InvalidChunk,
    InvalidTransition,
    Lifecycle,
    LoadTicket,
    State,
    UnknownChunk,
)

PAGE = 2


def page(i: int) -> list[int]:
    return [i, i + 1]


class _LoadNotCounted(Lifecycle):
    """Seeded bug: a load is not counted as in flight (bookkeeping kept for stores only)."""

    __slots__ = ()

    def load(self, keys: Any) -> LoadTicket:
        ticket = super().load(keys)
        del self._loads[ticket.seq]  # type: ignore[index]
        if self.inflight == 0 and self._state is State.LOADING:
            self._state = State.IDLE
        return ticket


class _LoadAckByRid(Lifecycle):
    """Seeded bug: a load ack settles whichever life holds the rid now (a dict keyed by rid)."""

    __slots__ = ()
    newest: ClassVar[dict[object, Lifecycle]] = {}

    def __init__(self, rid: object, **kwargs: Any) -> None:
        super().__init__(rid, **kwargs)
        _LoadAckByRid.newest[rid] = self

    def ack(self, ticket: Any) -> None:
        target = _LoadAckByRid.newest[self.rid]
        if isinstance(ticket, LoadTicket) and target is not ticket.owner:
            ticket = ticket._replace(owner=target)
            target._loads[ticket.seq] = ticket
            Lifecycle.ack(target, ticket)
            return
        Lifecycle.ack(self, ticket)


def finish_during_load(cls: type[Lifecycle]) -> None:
    """Scenario: a request finishes (or aborts, or is retracted) with a load in flight."""
    released: list[Lifecycle] = []
    lc = cls("r", page_size=PAGE, on_release=released.append)
    load = lc.load(["k1", "k2"])
    lc.finish(FinishReason.ABORTED)
    assert released == [], "device pages handed back while a load writes into them"
    assert lc.state is State.FINISHED and lc.inflight == 1
    lc.ack(load)
    assert released == [lc] and lc.state is State.RELEASED


def store_and_load_in_flight(cls: type[Lifecycle]) -> None:
    """Scenario: a re-admitted request has a store and a load in flight at once, then finishes."""
    released: list[Lifecycle] = []
    lc = cls("r", page_size=PAGE, on_release=released.append)
    load = lc.load(["k1"])
    assert lc.state is State.LOADING
    store = lc.submit(page(5))
    assert lc.state is State.OFFLOADING and lc.inflight == 2
    lc.finish(FinishReason.RETRACTED)
    lc.ack(store)
    assert released == [], "released with a load still in flight"
    lc.ack(load)
    assert released == [lc]
    assert lc.last_hash == store[2][-1]  # a load never moves the store chain's tail


def late_load_ack_after_rid_reuse(cls: type[Lifecycle]) -> None:
    """Scenario: an aborted request's load acks after a new request took its rid."""
    released: list[Lifecycle] = []
    old = cls("r", page_size=PAGE, on_release=released.append)
    load = old.load(["k1"])
    old.finish(FinishReason.ABORTED)
    new = cls("r", page_size=PAGE, on_release=released.append)
    new_load = new.load(["k9"])
    load.owner.ack(load)
    assert released == [old], "the late load ack did not release its own life"
    assert new.inflight == 1 and new.state is State.LOADING
    assert new.loads_in_flight() == (new_load,)


SCENARIOS = [finish_during_load, store_and_load_in_flight, late_load_ack_after_rid_reuse]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_holds_for_the_lifecycle(scenario: Any) -> None:
    scenario(Lifecycle)


@pytest.mark.parametrize(
    ("scenario", "buggy"),
    [
        (finish_during_load, _LoadNotCounted),
        (store_and_load_in_flight, _LoadNotCounted),
        (late_load_ack_after_rid_reuse, _LoadAckByRid),
    ],
)
def test_scenario_fails_on_its_seeded_bug(scenario: Any, buggy: type[Lifecycle]) -> None:
    with pytest.raises(AssertionError):
        scenario(buggy)


# ---------------------------------------------------------------- refusals change nothing


def refused(lc: Lifecycle, call: Any, kind: type[Exception], event: Event) -> None:
    before = lc.snapshot(), lc.loads_in_flight()
    with pytest.raises(kind) as info:
        call()
    assert info.value.event == event.value  # type: ignore[attr-defined]
    assert (lc.snapshot(), lc.loads_in_flight()) == before


@pytest.mark.parametrize(
    "keys",
    # "abcd" would be four one-letter keys, b"ab" two ints; "" is no key (issue 23, item 9).
    [[], [5], None, (k for k in ["a"]), {"a"}, {"a": 1}, "abcd", b"ab", [""], ["a", ""]],
)
def test_a_malformed_load_is_refused(keys: Any) -> None:
    lc = Lifecycle("r", page_size=PAGE)
    refused(lc, lambda: lc.load(keys), InvalidChunk, Event.LOAD)


@pytest.mark.parametrize("reason", list(FinishReason))
def test_a_load_after_finish_is_refused(reason: FinishReason) -> None:
    lc = Lifecycle("r", page_size=PAGE)
    t = lc.submit(page(1))
    lc.finish(reason)
    refused(lc, lambda: lc.load(["k1"]), InvalidTransition, Event.LOAD)
    lc.ack(t)
    assert lc.state is State.RELEASED
    refused(lc, lambda: lc.load(["k1"]), InvalidTransition, Event.LOAD)


def test_load_acks_duplicate_foreign_and_unknown_are_refused() -> None:
    lc, other = Lifecycle("r", page_size=PAGE), Lifecycle("r", page_size=PAGE)
    first, second = lc.load(["k1"]), lc.load(["k2"])
    lc.ack(first)
    assert lc.state is State.LOADING and lc.loads_in_flight() == (second,)
    refused(lc, lambda: lc.ack(first), DuplicateAck, Event.LOAD_ACK)
    refused(lc, lambda: lc.ack(other.load(["k3"])), ForeignAck, Event.LOAD_ACK)
    for forged in (
        LoadTicket(lc, 7, ("k1",)),
        LoadTicket(lc, -1, ("k1",)),
        second._replace(keys=("x",)),
        # Forged fields that do not hash or compare: a typed refusal, not a TypeError.
        LoadTicket(lc, [1], ("k1",)),  # type: ignore[arg-type]
        LoadTicket(lc, 1.0, ("k1",)),  # type: ignore[arg-type]
        LoadTicket(lc, None, None),  # type: ignore[arg-type]
    ):
        refused(lc, lambda f=forged: lc.ack(f), UnknownChunk, Event.LOAD_ACK)
    lc.ack(second)
    assert lc.state is State.IDLE and lc.inflight == 0


def test_loads_and_stores_ack_in_any_order_and_release_once() -> None:
    released: list[Lifecycle] = []
    lc = Lifecycle("r", page_size=PAGE, on_release=released.append)
    store = lc.submit(page(1))
    load = lc.load(["k1"])
    assert lc.state is State.OFFLOADING and lc.inflight == 2
    lc.ack(store)
    # Only the load is in flight now: the state says so (it stayed OFFLOADING before).
    assert lc.state is State.LOADING and lc.inflight == 1
    assert (lc.stores_in_flight, lc.loads_in_flight_count) == (0, 1)
    lc.ack(load)
    assert lc.state is State.IDLE
    lc.finish()
    assert released == [lc]
