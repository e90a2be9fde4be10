"""Whole-state unit tests of :class:`kvlife.Lifecycle`.

Every step asserts every observable field (:meth:`Lifecycle.snapshot`); every
refused event asserts the error's type, its message (event, state, rid and the
Lifecycle's identity), its attributes, and that the snapshot did not change.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import pytest

from kvlife import (
    DuplicateAck,
    Event,
    FinishReason,
    ForeignAck,
    InvalidChunk,
    InvalidEvent,
    InvalidTransition,
    KVLifeError,
    Lifecycle,
    LifecycleError,
    LifecycleSnapshot,
    State,
    Ticket,
    UnknownChunk,
)
from kvlife.errors import HashingError
from kvlife.hashing import sglang_page_hashes

PAGE = 2


def label_hasher(tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
    """Readable keys: page ``[10, 11]`` gets key ``"k10"`` (tests use distinct first tokens)."""
    if len(tokens) % page_size:
        raise HashingError("not whole pages")
    return [f"k{tokens[i]}" for i in range(0, len(tokens), page_size)]


def page(n: int) -> list[int]:
    """Tokens of one page whose key under :func:`label_hasher` is ``k{n}``."""
    return [n, 0]


def _copy(ticket: Ticket) -> Ticket:
    """An equal ticket that is another object, as one that crossed a process comes back."""
    copy = tuple(list(ticket))
    assert copy == ticket and copy is not ticket
    return copy  # type: ignore[return-value]


def snap(
    state: State,
    *,
    inflight: int = 0,
    tokens: int = 0,
    last: str | None = None,
    tail: str | None = None,
    seqs: tuple[int, ...] = (),
    next_seq: int = 0,
    reason: FinishReason | None = None,
) -> LifecycleSnapshot:
    return LifecycleSnapshot(state, inflight, tokens, last, tail, seqs, next_seq, reason)


class Released:
    """A release callback that records every call."""

    def __init__(self) -> None:
        self.calls: list[Lifecycle] = []

    def __call__(self, lc: Lifecycle) -> None:
        self.calls.append(lc)


def make(rid: object = "r1", **kwargs: Any) -> tuple[Lifecycle, Released]:
    released = Released()
    kwargs.setdefault("hasher", label_hasher)
    return Lifecycle(rid, page_size=PAGE, on_release=released, **kwargs), released


def assert_refused(
    lc: Lifecycle,
    call: Callable[[], object],
    kind: type[LifecycleError],
    event: Event,
    why: str = "",
) -> LifecycleError:
    """``call`` raises exactly ``kind``, names event/state/rid/identity, and changes nothing."""
    before = lc.snapshot()
    with pytest.raises(kind) as info:
        call()
    err = info.value
    assert type(err) is kind
    assert isinstance(err, KVLifeError)
    message = str(err)
    assert f"{event.value} refused" in message
    assert f"state {before.state.name}" in message
    assert f"rid={lc.rid!r}" in message
    assert f"id=0x{id(lc):x}" in message
    assert why in message
    assert (err.event, err.state, err.rid, err.ident) == (event.value, before.state, lc.rid, id(lc))
    assert lc.snapshot() == before
    return err


# ------------------------------------------------------------------ happy paths


def test_a_new_lifecycle_is_idle_and_empty() -> None:
    lc, released = make()
    assert lc.snapshot() == snap(State.IDLE)
    assert (lc.rid, lc.page_size) == ("r1", PAGE)
    assert lc.chunks_in_flight() == ()
    assert released.calls == []


def test_a_prior_hash_seeds_both_last_hash_and_chain_tail() -> None:
    lc, _ = make(prior_hash="prefill-tail")
    assert lc.snapshot() == snap(State.IDLE, last="prefill-tail", tail="prefill-tail")
    ticket = lc.submit(page(1))
    assert lc.snapshot() == snap(
        State.OFFLOADING,
        inflight=1,
        tokens=2,
        last="prefill-tail",
        tail="k1",
        seqs=(0,),
        next_seq=1,
    )
    lc.ack(ticket)
    assert lc.last_hash == "k1"


def test_submit_ack_finish_whole_state_after_every_step() -> None:
    lc, released = make()
    t0 = lc.submit(page(10))
    assert t0 == (lc, 0, ("k10",), 0)
    assert len(t0[2]) == 1
    assert lc.snapshot() == snap(
        State.OFFLOADING, inflight=1, tokens=2, tail="k10", seqs=(0,), next_seq=1
    )
    t1 = lc.submit(page(11) + page(12))
    assert t1 == (lc, 1, ("k11", "k12"), 1)
    assert len(t1[2]) == 2
    assert lc.snapshot() == snap(
        State.OFFLOADING, inflight=2, tokens=6, tail="k12", seqs=(0, 1), next_seq=2
    )
    assert lc.chunks_in_flight() == (t0, t1)
    lc.ack(t0)
    assert lc.snapshot() == snap(
        State.OFFLOADING, inflight=1, tokens=6, last="k10", tail="k12", seqs=(1,), next_seq=2
    )
    lc.ack(t1)
    assert lc.snapshot() == snap(State.IDLE, tokens=6, last="k12", tail="k12", next_seq=2)
    t2 = lc.submit(page(13))
    assert t2 == (lc, 2, ("k13",), 3)
    assert lc.snapshot() == snap(
        State.OFFLOADING, inflight=1, tokens=8, last="k12", tail="k13", seqs=(2,), next_seq=3
    )
    lc.finish(FinishReason.FINISHED)
    assert lc.snapshot() == snap(
        State.FINISHED,
        inflight=1,
        tokens=8,
        last="k12",
        tail="k13",
        seqs=(2,),
        next_seq=3,
        reason=FinishReason.FINISHED,
    )
    assert released.calls == []
    lc.ack(t2)
    assert lc.snapshot() == snap(
        State.RELEASED,
        tokens=8,
        last="k13",
        tail="k13",
        next_seq=3,
        reason=FinishReason.FINISHED,
    )
    assert released.calls == [lc]


@pytest.mark.parametrize("reason", list(FinishReason))
def test_every_finish_reason_drains_then_releases(reason: FinishReason) -> None:
    lc, released = make()
    t0, t1 = lc.submit(page(1)), lc.submit(page(2))
    lc.finish(reason)
    expected = snap(
        State.FINISHED, inflight=2, tokens=4, tail="k2", seqs=(0, 1), next_seq=2, reason=reason
    )
    assert lc.snapshot() == expected
    lc.ack(t1)
    assert lc.snapshot() == expected._replace(inflight=1, in_flight_seqs=(0,))
    assert released.calls == []
    lc.ack(t0)
    assert lc.snapshot() == snap(
        State.RELEASED, tokens=4, last="k2", tail="k2", next_seq=2, reason=reason
    )
    assert released.calls == [lc]


def test_finish_defaults_to_finished_and_releases_an_idle_lifecycle_at_once() -> None:
    lc, released = make()
    lc.finish()
    assert lc.snapshot() == snap(State.RELEASED, reason=FinishReason.FINISHED)
    assert released.calls == [lc]


def test_without_a_callback_release_still_happens() -> None:
    lc = Lifecycle("quiet", page_size=PAGE, hasher=label_hasher)
    lc.ack(lc.submit(page(1)))
    lc.finish(FinishReason.ABORTED)
    assert lc.state is State.RELEASED


def test_the_default_hasher_is_the_sglang_chain() -> None:
    lc = Lifecycle("r", page_size=PAGE)
    t0 = lc.submit([1, 2, 3, 4])
    t1 = lc.submit([5, 6])
    assert t0[2] == tuple(sglang_page_hashes([1, 2, 3, 4], PAGE, None))
    assert t1[2] == tuple(sglang_page_hashes([5, 6], PAGE, t0[2][-1]))
    assert t1[2] == tuple(sglang_page_hashes([1, 2, 3, 4, 5, 6], PAGE, None)[2:])


def test_the_hasher_is_given_the_chain_tail_as_prior() -> None:
    seen: list[tuple[tuple[int, ...], int, str | None]] = []

    def recording(tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
        seen.append((tuple(tokens), page_size, prior))
        return label_hasher(tokens, page_size, prior)

    lc = Lifecycle("r", page_size=PAGE, hasher=recording, prior_hash="p")
    lc.submit(page(1) + page(2))
    lc.submit(page(3))
    assert seen == [((1, 0, 2, 0), PAGE, "p"), ((3, 0), PAGE, "k2")]


def test_a_copy_of_a_ticket_acks_its_chunk_once() -> None:
    lc, _ = make()
    ticket = lc.submit(page(1))
    lc.ack(_copy(ticket))
    assert lc.snapshot() == snap(State.IDLE, tokens=2, last="k1", tail="k1", next_seq=1)
    assert_refused(lc, lambda: lc.ack(ticket), DuplicateAck, Event.ACK, "chunk 0")


def test_repr_names_rid_state_and_identity() -> None:
    lc, _ = make("req-7")
    lc.submit(page(1))
    assert repr(lc) == f"<Lifecycle rid='req-7' OFFLOADING inflight=1 id=0x{id(lc):x}>"


@pytest.mark.parametrize("page_size", [0, -16, 1.5, "16", True, None])
def test_a_bad_page_size_is_refused(page_size: Any) -> None:
    with pytest.raises(ValueError, match="page_size"):
        Lifecycle("r", page_size=page_size)


# ---------------------------------------------------------------- every refusal


def _in_state(state: State) -> tuple[Lifecycle, list[Ticket]]:
    """A Lifecycle in ``state``; the tickets it issued (the last ones still in flight)."""
    lc, _ = make()
    tickets: list[Ticket] = []
    if state is State.IDLE:
        tickets.append(lc.submit(page(1)))
        lc.ack(tickets[0])
    elif state is State.OFFLOADING:
        tickets += [lc.submit(page(1)), lc.submit(page(2))]
        lc.ack(tickets[0])
    elif state is State.LOADING:
        tickets.append(lc.submit(page(1)))
        lc.ack(tickets[0])
        lc.load(["k1"])
    elif state is State.FINISHED:
        tickets += [lc.submit(page(1)), lc.submit(page(2))]
        lc.ack(tickets[0])
        lc.finish(FinishReason.RETRACTED)
    else:
        tickets.append(lc.submit(page(1)))
        lc.finish()
        lc.ack(tickets[0])
    assert lc.state is state
    return lc, tickets


BAD_CHUNKS = {
    "empty": [],
    "partial page": [1],
    "one and a half pages": [1, 2, 3],
    "token -1": [1, -1],
    "token 2**32": [2**32, 1],
    "float token": [1.5, 2],
    "str token": ["a", 2],
}


@pytest.mark.parametrize("state", [State.IDLE, State.OFFLOADING])
@pytest.mark.parametrize("name", list(BAD_CHUNKS))
def test_a_malformed_chunk_is_refused(state: State, name: str) -> None:
    lc, _ = _in_state(state)
    lc._hasher = sglang_page_hashes  # the real scheme checks token ids
    assert_refused(lc, lambda: lc.submit(BAD_CHUNKS[name]), InvalidChunk, Event.SUBMIT)


@pytest.mark.parametrize("state", [State.FINISHED, State.RELEASED])
def test_submit_after_finish_is_refused(state: State) -> None:
    lc, _ = _in_state(state)
    err = assert_refused(
        lc, lambda: lc.submit(page(9)), InvalidTransition, Event.SUBMIT, "no such transition"
    )
    assert err.state is state


@pytest.mark.parametrize("state", [State.FINISHED, State.RELEASED])
@pytest.mark.parametrize("reason", list(FinishReason))
def test_a_second_finish_is_refused(state: State, reason: FinishReason) -> None:
    lc, _ = _in_state(state)
    assert_refused(lc, lambda: lc.finish(reason), InvalidTransition, Event.FINISH)


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("reason", ["finished", None, 0, State.FINISHED])
def test_a_bogus_finish_reason_is_refused(state: State, reason: Any) -> None:
    lc, _ = _in_state(state)
    assert_refused(lc, lambda: lc.finish(reason), InvalidEvent, Event.FINISH, repr(reason))


@pytest.mark.parametrize("state", list(State))
def test_a_duplicate_ack_is_refused(state: State) -> None:
    lc, tickets = _in_state(state)
    assert_refused(lc, lambda: lc.ack(tickets[0]), DuplicateAck, Event.ACK, "already acked")


def test_a_duplicate_of_an_out_of_order_ack_is_refused() -> None:
    lc, _ = make()
    t0, t1 = lc.submit(page(1)), lc.submit(page(2))
    lc.ack(t1)
    assert_refused(lc, lambda: lc.ack(t1), DuplicateAck, Event.ACK, "chunk 1 was already acked")
    assert lc.chunks_in_flight() == (t0,)


def test_an_equal_copy_of_a_ticket_acks_its_chunk_in_and_out_of_order() -> None:
    """A ticket that crossed a process comes back as an equal copy, not the same object."""
    lc, _ = make()
    t0, t1, t2 = lc.submit(page(1)), lc.submit(page(2)), lc.submit(page(3))
    lc.ack(_copy(t1))  # out of order
    assert lc.chunks_in_flight() == (t0, t2) and lc.last_hash is None
    lc.ack(_copy(t0))  # the oldest: the prefix grows over t0 and t1
    assert lc.snapshot() == snap(
        State.OFFLOADING, inflight=1, tokens=6, last="k2", tail="k3", seqs=(2,), next_seq=3
    )
    assert_refused(lc, lambda: lc.ack(_copy(t0)), DuplicateAck, Event.ACK, "already acked")
    lc.ack(_copy(t2))
    assert lc.snapshot() == snap(State.IDLE, tokens=6, last="k3", tail="k3", next_seq=3)


class _Agreeable(tuple):  # type: ignore[type-arg]
    """A forged ticket that says it equals whatever it is compared with."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = tuple.__hash__


@pytest.mark.parametrize("kind", [_Agreeable, list])
def test_a_look_alike_of_a_ticket_is_refused_and_cannot_plant_keys(kind: type) -> None:
    """Only a plain tuple is a ticket: a tuple subclass would answer the equal-copy test
    itself and, acked out of order, plant its own key as last_hash."""
    lc, _ = make()
    t0, t1 = lc.submit(page(1)), lc.submit(page(2))
    forged = kind((lc, t1[1], ("forged",), t1[3]))
    assert_refused(lc, lambda: lc.ack(forged), UnknownChunk, Event.ACK, "not a Ticket")
    lc.ack(t1)
    lc.ack(t0)
    assert lc.last_hash == "k2"


@pytest.mark.parametrize("state", list(State))
def test_an_ack_of_a_chunk_never_submitted_is_refused(state: State) -> None:
    lc, tickets = _in_state(state)
    for forged in (
        (lc, lc.next_seq, ("k1",), 0),
        (lc, lc.next_seq + 5, ("k1",), 0),
        (lc, -1, ("k1",), 0),
        (lc, tickets[-1][1], ("forged",), tickets[-1][3]),
    ):
        if state in (State.IDLE, State.LOADING, State.RELEASED) and forged[1] == tickets[-1][1]:
            continue  # that seq was acked: a duplicate, tested above
        assert_refused(lc, lambda f=forged: lc.ack(f), UnknownChunk, Event.ACK, "never submitted")


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("not_a_ticket", [None, (0, 0), "ticket", (None, "x", (), 0)])
def test_an_ack_of_something_that_is_not_a_ticket_is_refused(
    state: State, not_a_ticket: Any
) -> None:
    lc, _ = _in_state(state)
    assert_refused(lc, lambda: lc.ack(not_a_ticket), UnknownChunk, Event.ACK, "not a Ticket")


def test_an_ack_of_a_ticket_lookalike_that_cannot_be_compared_is_refused() -> None:
    """A lookalike that unpacks as (this Lifecycle, seq, first page, keys) but whose
    comparison raises is a typed refusal, never its exception."""
    lc, _ = make()
    t0, t1 = lc.submit(page(1)), lc.submit(page(2))

    class Hostile:
        def __init__(self, *fields: object) -> None:
            self.fields = fields

        def __iter__(self) -> Any:
            return iter(self.fields)

        def __eq__(self, other: object) -> bool:
            raise RuntimeError("no comparing me")

        def __ne__(self, other: object) -> bool:
            raise RuntimeError("no comparing me")

        __hash__ = object.__hash__

    for seq in (0, 1):
        fake = Hostile(lc, seq, seq, (f"k{seq + 1}",))
        assert_refused(lc, lambda f=fake: lc.ack(f), UnknownChunk, Event.ACK, "not a Ticket")
    assert lc.chunks_in_flight() == (t0, t1)


@pytest.mark.parametrize("state", list(State))
def test_an_ack_of_another_lifecycles_chunk_is_refused(state: State) -> None:
    lc, _ = _in_state(state)
    other, _ = make(lc.rid)
    foreign = other.submit(page(1))
    err = assert_refused(lc, lambda: lc.ack(foreign), ForeignAck, Event.ACK, repr(other))
    assert err.ident != id(other)
    assert other.snapshot() == snap(
        State.OFFLOADING, inflight=1, tokens=2, tail="k1", seqs=(0,), next_seq=1
    )


def test_a_hasher_error_is_refused_as_an_invalid_chunk() -> None:
    def failing(tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
        raise HashingError("cannot hash these")

    lc, _ = make(hasher=failing)
    assert_refused(lc, lambda: lc.submit(page(1)), InvalidChunk, Event.SUBMIT, "cannot hash")


@pytest.mark.parametrize("keys", [[], ["a", "b"]])
def test_a_hasher_giving_the_wrong_number_of_keys_is_refused(keys: list[str]) -> None:
    lc, _ = make(hasher=lambda tokens, page_size, prior: list(keys))
    assert_refused(
        lc, lambda: lc.submit(page(1)), InvalidChunk, Event.SUBMIT, f"{len(keys)} keys for 1"
    )


@pytest.mark.parametrize("raised", [ValueError("odd"), AssertionError(), ZeroDivisionError()])
@pytest.mark.parametrize("tokens", [[], [1], [1, 2, 3]])
def test_a_partial_chunk_is_refused_as_one_whatever_the_hasher_raises(
    raised: Exception, tokens: list[int]
) -> None:
    """Whole pages are checked on the hasher's keys (one check, not two, on the hot path):
    a hasher that raises anything at all on a partial chunk still gives the chunk's own
    refusal, with the state unchanged."""

    def strict(tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
        raise raised

    for state in (State.IDLE, State.OFFLOADING, State.FINISHED):
        lc, _ = _in_state(state)
        lc._hasher = strict
        assert_refused(lc, partial(lc.submit, tokens), InvalidChunk, Event.SUBMIT, "whole pages")


def test_a_hasher_error_on_whole_pages_that_is_not_a_refusal_propagates() -> None:
    """Only HashingError and TypeError are the hasher refusing a chunk; a bug in a hasher
    given whole pages is its own exception, and the Lifecycle is unchanged."""

    def buggy(tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
        raise ZeroDivisionError("bug")

    lc, _ = make(hasher=buggy)
    before = lc.snapshot()
    with pytest.raises(ZeroDivisionError):
        lc.submit(page(1))
    assert lc.snapshot() == before


# ------------------------------------------------------ every ack order, exhaustive

N_CHUNKS = 4


@pytest.mark.parametrize("order", list(itertools.permutations(range(N_CHUNKS))))
def test_every_ack_order_and_finish_point_keeps_page_order(order: tuple[int, ...]) -> None:
    """All 24 ack orders of 4 chunks (one of them 2 pages), finish at each of 5 points."""
    chunk_pages = [[1], [2, 3], [4], [5]]
    keys = [tuple(f"k{p}" for p in pages) for pages in chunk_pages]
    for finish_at in range(N_CHUNKS + 1):
        lc, released = make()
        tickets = [lc.submit([t for p in pages for t in page(p)]) for pages in chunk_pages]
        assert [t[2] for t in tickets] == keys
        assert [t[3] for t in tickets] == [0, 1, 3, 4]
        acked: set[int] = set()
        reason: FinishReason | None = None
        for step, seq in enumerate([*order, None]):
            if step == finish_at:
                lc.finish(FinishReason.ABORTED)
                reason = FinishReason.ABORTED
            else:
                if seq is None:
                    continue
                lc.ack(tickets[seq])
                acked.add(seq)
            prefix = 0
            while prefix in acked:
                prefix += 1
            in_flight = tuple(s for s in range(N_CHUNKS) if s not in acked)
            if reason is None:
                state = State.OFFLOADING if in_flight else State.IDLE
            else:
                state = State.FINISHED if in_flight else State.RELEASED
            assert lc.snapshot() == snap(
                state,
                inflight=len(in_flight),
                tokens=10,
                last=keys[prefix - 1][-1] if prefix else None,
                tail="k5",
                seqs=in_flight,
                next_seq=N_CHUNKS,
                reason=reason,
            ), (order, finish_at, step)
            assert lc.chunks_in_flight() == tuple(tickets[s] for s in in_flight)
            assert released.calls == ([lc] if state is State.RELEASED else [])


@pytest.mark.parametrize("bad", [b"\x02\x00", 7, "", None])
def test_a_hasher_key_that_is_not_a_non_empty_str_is_refused(bad: object) -> None:
    """One key type per ticket: a pluggable scheme's keys are hex-digest ``str``s, so
    ``last_hash`` and the store's names are too; bytes, ints and "" are refused before
    anything changes (issue 23, item 10: an int-key hasher was accepted)."""

    def odd_keys(tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
        return ["k" * (i + 1) for i in range(len(tokens) // page_size - 1)] + [bad]  # type: ignore[list-item]

    lc = Lifecycle("r", page_size=2, hasher=odd_keys)
    before = lc.snapshot()
    for tokens in ([1, 2], [1, 2, 3, 4]):
        with pytest.raises(InvalidChunk, match="not a non-empty str"):
            lc.submit(tokens)
        assert lc.snapshot() == before


def test_rid_and_page_size_are_fixed_for_the_life() -> None:
    lc = Lifecycle("r", page_size=2)
    before = lc.snapshot()
    for name, value in (("rid", "other"), ("page_size", 3)):
        with pytest.raises(AttributeError):
            setattr(lc, name, value)
    assert (lc.rid, lc.page_size, lc.snapshot()) == ("r", 2, before)


def test_still_decoding_is_a_predicate_of_the_state_derived_from_the_table() -> None:
    """Issue 32 item 4: ``DECODING`` is the one definition of "still decoding": a state
    decodes exactly when the table lets it finish, submit and load; every state has an
    answer; a Lifecycle's state reads it through every event."""
    from kvlife._lifecycle import DECODING, TABLE

    def allowed(event: Event) -> set[State]:
        return {row.source for row in TABLE if row.event is event}

    assert set(DECODING) == set(State)
    decoding = {s for s, yes in DECODING.items() if yes}
    assert decoding == allowed(Event.FINISH) == allowed(Event.SUBMIT) == allowed(Event.LOAD)
    assert decoding == {State.IDLE, State.OFFLOADING, State.LOADING}
    lc = Lifecycle("r", page_size=PAGE, hasher=label_hasher)
    load = lc.load(["x"])
    chunk = lc.submit([10, 11])
    assert DECODING[lc.state] and lc.state is State.OFFLOADING
    lc.ack(chunk)
    assert DECODING[lc.state] and lc.state is State.LOADING
    lc.finish()
    assert not DECODING[lc.state] and lc.state is State.FINISHED
    lc.ack(load)
    assert not DECODING[lc.state] and lc.state is State.RELEASED


def test_no_module_but_the_state_module_keeps_a_list_of_states() -> None:
    """What derives from the state lives in ``kvlife/_lifecycle.py``: no other module of the
    package spells a tuple, list or set of two or more states (``(State.IDLE,
    State.OFFLOADING)`` was the SGLang decode manager's "live", and the manager listed the
    live states for its metrics)."""
    import re
    from pathlib import Path

    import kvlife

    root = Path(kvlife.__file__).parent
    pattern = re.compile(r"[(\[{]\s*State\.[A-Z_]+\s*,\s*State\.[A-Z_]+")
    offenders = [
        str(path.relative_to(root))
        for path in sorted(root.rglob("*.py"))
        if path.name != "_lifecycle.py" and pattern.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []
