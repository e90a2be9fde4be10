"""Scenario regressions: one test per bug class of the design, each narrated step by step."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence

import pytest

from kvlife import (
    DuplicateAck,
    FinishReason,
    ForeignAck,
    InvalidTransition,
    Lifecycle,
    LifecycleSnapshot,
    ReleaseCallbackError,
    State,
)
from kvlife.hashing import sglang_page_hashes

PAGE = 4


def tokens(first: int, pages: int = 1) -> list[int]:
    """``pages`` whole pages of distinct token ids starting at ``first``."""
    return list(range(first, first + pages * PAGE))


def key_after(prior: str | None, chunk: Sequence[int]) -> str:
    """The SGLang key of the last page of ``chunk`` chained from ``prior``."""
    return sglang_page_hashes(chunk, PAGE, prior)[-1]


class Released:
    """A release callback that records every call."""

    def __init__(self) -> None:
        self.calls: list[Lifecycle] = []

    def __call__(self, lc: Lifecycle) -> None:
        self.calls.append(lc)


def test_reused_rid_late_ack_moves_only_its_own_lifecycle() -> None:
    """Scenario: a request id is reused while the old life's copy is still in flight.

    1. Lifecycle A (rid "reused") submits a chunk and finishes with it in flight.
    2. Lifecycle B, a new request with the same rid "reused", submits its own chunk.
    3. A's ack arrives late: A drains and is RELEASED, its callback ran once;
       B is untouched: still OFFLOADING, inflight 1, its own tokens submitted,
       its own last_hash (none acked yet) and chain tail.
    4. B's ack arrives: only B moves (to IDLE, last_hash = its own page key).
    """
    a_released, b_released = Released(), Released()
    a = Lifecycle("reused", page_size=PAGE, on_release=a_released)
    b = Lifecycle("reused", page_size=PAGE, on_release=b_released)

    a_chunk = tokens(100)
    a_ticket = a.submit(a_chunk)
    a.finish(FinishReason.FINISHED)
    assert a.state is State.FINISHED

    b_chunk = tokens(200, pages=2)
    b_ticket = b.submit(b_chunk)
    b_before = b.snapshot()
    assert b_before == LifecycleSnapshot(
        State.OFFLOADING, 1, 2 * PAGE, None, key_after(None, b_chunk), (0,), 1, None
    )

    a.ack(a_ticket)
    assert a.snapshot() == LifecycleSnapshot(
        State.RELEASED,
        0,
        PAGE,
        key_after(None, a_chunk),
        key_after(None, a_chunk),
        (),
        1,
        FinishReason.FINISHED,
    )
    assert a_released.calls == [a]
    assert b.snapshot() == b_before
    assert b_released.calls == []

    b.ack(b_ticket)
    b_key = key_after(None, b_chunk)
    assert b.snapshot() == LifecycleSnapshot(State.IDLE, 0, 2 * PAGE, b_key, b_key, (), 1, None)
    assert a.state is State.RELEASED
    assert a_released.calls == [a]
    assert b_released.calls == []


def test_duplicate_ack_changes_nothing() -> None:
    """Scenario: the copy engine reports the same completion twice.

    1. A Lifecycle submits two chunks.
    2. The first chunk's ack arrives: inflight 1, last_hash = that chunk's key.
    3. The same ack arrives again: DuplicateAck, and nothing moved (inflight is
       still 1, not 0; the Lifecycle did not go IDLE).
    4. The finish and the second ack still release it exactly once.
    """
    released = Released()
    lc = Lifecycle("dup", page_size=PAGE, on_release=released)
    t0, t1 = lc.submit(tokens(0)), lc.submit(tokens(10))
    lc.ack(t0)
    before = lc.snapshot()
    assert (before.state, before.inflight, before.last_hash) == (
        State.OFFLOADING,
        1,
        t0[2][-1],
    )
    with pytest.raises(DuplicateAck, match="chunk 0 was already acked"):
        lc.ack(t0)
    assert lc.snapshot() == before
    lc.finish(FinishReason.ABORTED)
    with pytest.raises(DuplicateAck):
        lc.ack(t0)
    lc.ack(t1)
    assert lc.state is State.RELEASED
    assert released.calls == [lc]


def test_ack_of_another_lifecycles_chunk_is_foreign() -> None:
    """Scenario: an ack is handed to the wrong Lifecycle (same rid, other life).

    1. Lifecycles A and B, both rid "x", each submit a chunk.
    2. B's ticket is given to A: ForeignAck naming B; neither A nor B changed.
    3. Each ack given to its own Lifecycle works.
    """
    a = Lifecycle("x", page_size=PAGE)
    b = Lifecycle("x", page_size=PAGE)
    ta, tb = a.submit(tokens(0)), b.submit(tokens(0))
    assert ta[2] == tb[2]  # same tokens, same keys: only identity tells them apart
    a_before, b_before = a.snapshot(), b.snapshot()
    with pytest.raises(ForeignAck) as info:
        a.ack(tb)
    assert f"id=0x{id(b):x}" in str(info.value)
    assert f"id=0x{id(a):x}" in str(info.value)
    assert (a.snapshot(), b.snapshot()) == (a_before, b_before)
    a.ack(ta)
    b.ack(tb)
    assert (a.state, b.state) == (State.IDLE, State.IDLE)


def test_every_event_after_release_is_refused() -> None:
    """Scenario: events keep arriving after the runtime got the pages back.

    1. A Lifecycle submits a chunk, finishes, and its ack releases it.
    2. A submit, the same ack again, a finish (with every reason): each refused,
       the snapshot unchanged, the release callback not run again.
    """
    released = Released()
    lc = Lifecycle("gone", page_size=PAGE, on_release=released)
    ticket = lc.submit(tokens(0))
    lc.finish()
    lc.ack(ticket)
    assert released.calls == [lc]
    after = lc.snapshot()
    assert after.state is State.RELEASED
    with pytest.raises(InvalidTransition, match="submit refused in state RELEASED"):
        lc.submit(tokens(50))
    assert lc.snapshot() == after
    with pytest.raises(DuplicateAck, match="ack refused in state RELEASED"):
        lc.ack(ticket)
    assert lc.snapshot() == after
    for reason in FinishReason:
        with pytest.raises(InvalidTransition, match="finish refused in state RELEASED"):
            lc.finish(reason)
        assert lc.snapshot() == after
    assert released.calls == [lc]


def test_finish_while_idle_releases_at_once() -> None:
    """Scenario: a request ends with nothing in flight.

    1. A Lifecycle offloads one chunk and its ack arrives: IDLE.
    2. It finishes (retracted): RELEASED in the same call, callback ran once,
       last_hash kept for the store.
    """
    released = Released()
    lc = Lifecycle("idle", page_size=PAGE, on_release=released)
    ticket = lc.submit(tokens(0, pages=3))
    lc.ack(ticket)
    assert lc.state is State.IDLE
    lc.finish(FinishReason.RETRACTED)
    assert lc.snapshot() == LifecycleSnapshot(
        State.RELEASED,
        0,
        3 * PAGE,
        ticket[2][-1],
        ticket[2][-1],
        (),
        1,
        FinishReason.RETRACTED,
    )
    assert released.calls == [lc]


def test_out_of_order_acks_keep_the_hash_chain_in_page_order() -> None:
    """Scenario: the copies of three chunks complete in the order 2, 0, 1.

    1. Chunks 0, 1, 2 are submitted (one page each), chained.
    2. Ack 2: last_hash does not move (chunks 0 and 1 still in flight).
    3. Ack 0: last_hash = chunk 0's key (the prefix is chunk 0 only).
    4. Ack 1: the prefix jumps over 1 and the already acked 2: last_hash =
       chunk 2's key, and that key is the chain over all three pages.
    """
    lc = Lifecycle("ooo", page_size=PAGE, prior_hash=None)
    t = [lc.submit(tokens(10 * i)) for i in range(3)]
    all_tokens = [tok for i in range(3) for tok in tokens(10 * i)]
    chain = sglang_page_hashes(all_tokens, PAGE, None)
    assert [ti[2][-1] for ti in t] == chain
    lc.ack(t[2])
    assert (lc.last_hash, lc.inflight, lc.snapshot().in_flight_seqs) == (None, 2, (0, 1))
    lc.ack(t[0])
    assert (lc.last_hash, lc.inflight, lc.snapshot().in_flight_seqs) == (chain[0], 1, (1,))
    lc.ack(t[1])
    assert (lc.last_hash, lc.inflight, lc.state) == (chain[2], 0, State.IDLE)


def test_a_raising_release_callback_still_releases_exactly_once() -> None:
    """Scenario: the runtime's release callback raises.

    1. A Lifecycle submits a chunk and finishes with it in flight.
    2. The ack releases it; the callback raises RuntimeError: the ack raises
       ReleaseCallbackError (cause: the RuntimeError), and the Lifecycle IS
       released: state RELEASED, nothing in flight.
    3. Later events are refused; the callback is never called again.
    """
    calls: list[Lifecycle] = []

    def explode(lc: Lifecycle) -> None:
        calls.append(lc)
        raise RuntimeError("runtime could not take the pages")

    lc = Lifecycle("boom", page_size=PAGE, on_release=explode)
    ticket = lc.submit(tokens(0))
    lc.finish()
    with pytest.raises(ReleaseCallbackError) as info:
        lc.ack(ticket)
    err = info.value
    assert isinstance(err.__cause__, RuntimeError)
    assert (err.rid, err.ident) == ("boom", id(lc))
    assert "rid='boom'" in str(err)
    assert f"id=0x{id(lc):x}" in str(err)
    assert (lc.state, lc.inflight) == (State.RELEASED, 0)
    assert calls == [lc]
    with pytest.raises(DuplicateAck):
        lc.ack(ticket)
    with pytest.raises(InvalidTransition):
        lc.finish()
    assert calls == [lc]


def test_a_release_callback_that_re_enters_is_refused_inside_it() -> None:
    """Scenario: the release callback calls back into its Lifecycle.

    1. The callback tries to finish the Lifecycle again: that is refused (the
       Lifecycle is already RELEASED when the callback runs), surfacing as
       ReleaseCallbackError from finish().
    2. The Lifecycle is released once.
    """
    calls: list[Lifecycle] = []

    def re_enter(lc: Lifecycle) -> None:
        calls.append(lc)
        assert lc.state is State.RELEASED
        lc.finish()

    lc = Lifecycle("again", page_size=PAGE, on_release=re_enter)
    with pytest.raises(ReleaseCallbackError) as info:
        lc.finish()
    assert isinstance(info.value.__cause__, InvalidTransition)
    assert lc.state is State.RELEASED
    assert calls == [lc]


def test_lifecycles_are_identities_not_rids() -> None:
    """Scenario: two lives of one rid, used as dict keys and held weakly.

    1. A and B share rid "same": they are unequal and hash differently as keys.
    2. A dict keyed by them keeps two entries.
    3. weakref.ref(A) works; once A is dropped the reference dies, B's lives on.
    """
    a = Lifecycle("same", page_size=PAGE)
    b = Lifecycle("same", page_size=PAGE)
    assert a != b
    assert (a == b) is False
    assert a == a
    by_life = {a: "a", b: "b"}
    assert len(by_life) == 2
    assert (by_life[a], by_life[b]) == ("a", "b")
    ref_a, ref_b = weakref.ref(a), weakref.ref(b)
    assert ref_a() is a
    ticket = a.submit(tokens(0))
    del by_life, a, ticket
    gc.collect()
    assert ref_a() is None
    assert ref_b() is b
