"""The offload manager on real parts: a torch KV pool, the threaded CPU engine, a store.

Each "Scenario:" test reproduces one bug class of docs/design.md with a copy delay,
and checks the stored bytes, not only counters.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvlife import FinishReason, State
from kvlife.engine.base import Ack
from kvlife.engine.cpu import CpuCopyEngine
from kvlife.errors import (
    DrainTimeout,
    DuplicateAck,
    EngineClosed,
    EngineError,
    InvalidEvent,
    InvalidTransition,
    ManagerError,
)
from kvlife.hashing import page_hashes
from kvlife.layout import LayerFirstLayout
from kvlife.manager import OffloadManager, OffloadRequest
from kvlife.pool import HostPagePool
from kvlife.store.memory import MemoryStore
from kvlife.testing.faults import FaultyMemoryStore

PAGE = 4


@dataclass
class Rig:
    """A small decode runtime's offload parts, all real."""

    layout: LayerFirstLayout
    host: HostPagePool
    engine: CpuCopyEngine
    store: FaultyMemoryStore  # a MemoryStore that fails a put when a test says so
    manager: OffloadManager
    released: list[tuple[OffloadRequest, tuple[int, ...]]] = field(default_factory=list)

    def on_release(self, lc: OffloadRequest, pages: object) -> None:
        self.released.append((lc, tuple(pages)))  # type: ignore[call-overload]

    def fill(self, pages: list[int], tag: int) -> None:
        """Give each device page values no other (tag, page) has."""
        for i, page in enumerate(pages):
            n = self.layout.page_numel
            self.layout.write_page(page, torch.arange(n, dtype=torch.float32) + tag * 1e4 + i * 1e2)

    def stored(self, key: str) -> torch.Tensor:
        data = self.store.get(key)
        assert data is not None, f"key {key[:12]} not stored"
        return torch.frombuffer(bytearray(data), dtype=torch.float32)

    def wait_acks(self, n: int, timeout: float = 5.0) -> None:
        """Poll until ``n`` more chunks were acked (the engine is a real thread)."""
        target = self.manager.metrics().chunks_acked + n
        deadline = time.monotonic() + timeout
        while self.manager.metrics().chunks_acked < target:
            assert time.monotonic() < deadline, "acks did not arrive"
            time.sleep(0.002)
            self.manager.poll()


@pytest.fixture
def rig() -> Iterator[Rig]:
    layout = LayerFirstLayout.zeros(
        num_layers=2, num_pages=64, page_size=PAGE, num_heads=2, head_dim=4, dtype=torch.float32
    )
    host = HostPagePool(32, layout.page_numel, torch.float32)
    engine = CpuCopyEngine(layout, host, copy_delay=0.05)
    store = FaultyMemoryStore()
    manager = OffloadManager(engine, host, store, page_size=PAGE)
    yield Rig(layout, host, engine, store, manager)
    manager.close(timeout=10)
    engine.close()
    store.close()


def tokens_for(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + i) % 50_000 for i in range(n)]


def test_stride_policy_offloads_whole_pages_after_prefill(rig: Rig) -> None:
    """Prompt of 6 tokens: one page (4) came from prefill; the newest token has no KV."""
    m = rig.manager
    prompt = tokens_for(6, 1)
    lc = m.start("r", prompt, rig.on_release)
    assert lc.prefill_len == 4
    pages = [10, 11, 12, 13]
    rig.fill(pages, tag=1)
    assert m.offload(lc, [*prompt, 1], pages) is None  # 6 tokens with KV after prefill: 2 < page
    toks = [*prompt, 1, 2, 3]  # 9 tokens, 8 with KV: page 1 (tokens 4..8) is due
    ticket = m.offload(lc, toks, pages)
    assert ticket is not None and ticket[3] == 0 and len(ticket[2]) == 1
    assert lc.state is State.OFFLOADING and lc.inflight == 1
    assert m.offload(lc, toks, pages) is None  # nothing new is due while it flies
    # The chain continues from the prefill side's keys for the prompt's whole page.
    expected = page_hashes(toks[:8], PAGE)
    assert ticket[2] == (expected[1],)
    rig.wait_acks(1)
    m.close()
    assert torch.equal(rig.stored(expected[1]), rig.layout.read_page(11))
    assert rig.host.num_used == 0


def test_stride_larger_than_page_rounds_and_leaves_tail(rig: Rig) -> None:
    m = OffloadManager(rig.engine, rig.host, rig.store, page_size=PAGE, stride=2 * PAGE + 3)
    assert m.stride == 2 * PAGE
    lc = m.start("r", [], rig.on_release)
    pages = list(range(8))
    toks = tokens_for(4 * PAGE + 1, 2)  # 16 tokens with KV: two strides
    ticket = m.offload(lc, toks, pages)
    assert ticket is not None and len(ticket[2]) == 4
    toks = toks + tokens_for(PAGE * 3, 3)  # 12 more with KV: one stride of 8, tail of 4 stays
    t2 = m.offload(lc, toks, pages)
    assert t2 is not None and len(t2[2]) == 2 and t2[3] == 4
    m.finish(lc)
    m.close()
    assert lc.snapshot().tokens_submitted == 6 * PAGE  # the short tail was never offloaded
    assert [r[0] for r in rig.released] == [lc]


@pytest.mark.parametrize("reason", list(FinishReason))
def test_scenario_device_pages_not_released_while_copy_reads_them(
    rig: Rig, reason: FinishReason
) -> None:
    """Scenario: a request finishes (or is aborted, or retracted) with a copy in flight.

    The runtime must not get the device pages back before the copy has read
    them: here it overwrites them the moment it gets them, as a real allocator
    reuses pages at once. The stored page must hold the values at submit time.
    """
    m = rig.manager
    lc = m.start("r", [], rig.on_release)
    pages = [5, 6]
    rig.fill(pages, tag=3)
    before = rig.layout.read_page(5).clone()
    ticket = m.offload(lc, tokens_for(PAGE + 1, 4), pages)
    assert ticket is not None
    m.finish(lc, reason)
    assert rig.released == []  # the copy is still reading page 5
    assert lc.state is State.FINISHED

    def reuse_at_once(released: OffloadRequest, device_pages: object) -> None:
        rig.on_release(released, device_pages)
        rig.fill(list(device_pages), tag=99)  # type: ignore[call-overload]

    lc.release_handler = reuse_at_once
    rig.wait_acks(1)
    assert rig.released == [(lc, (5, 6))]
    m.close()
    assert torch.equal(rig.stored(ticket[2][0]), before)
    assert lc.state is State.RELEASED and lc.snapshot().finish_reason is reason


def test_scenario_reused_rid_late_ack_moves_only_its_own_request(rig: Rig) -> None:
    """Scenario: request A (rid "reused") finishes with a copy in flight; B reuses "reused".

    A's late ack must release A (once) and leave B in flight with its own
    progress; each page must be stored under its own request's key.
    """
    m = rig.manager
    a = m.start("reused", [], rig.on_release)
    rig.fill([1, 2], tag=1)
    ta = m.offload(a, tokens_for(PAGE + 1, 1), [1, 2])
    m.finish(a, FinishReason.ABORTED)
    b = m.start("reused", [], rig.on_release)
    rig.fill([3, 4, 5], tag=2)
    rig.engine.slow_next(0.5)  # B's copy is slow, so A's ack lands while B's is in flight
    tb = m.offload(b, tokens_for(2 * PAGE + 1, 2), [3, 4, 5])
    assert ta is not None and tb is not None
    a_page, b_pages = rig.layout.read_page(1).clone(), [rig.layout.read_page(p) for p in (3, 4)]
    rig.wait_acks(1)
    assert [r[0] for r in rig.released] == [a] and a.state is State.RELEASED
    assert b.state is State.OFFLOADING and b.inflight == 1
    assert b.snapshot().tokens_submitted == 2 * PAGE and b.snapshot().last_hash is None
    m.close()
    assert b.state is State.IDLE and [r[0] for r in rig.released] == [a]
    assert b.snapshot().last_hash == tb[2][-1] and a.snapshot().last_hash == ta[2][-1]
    assert torch.equal(rig.stored(ta[2][0]), a_page)
    for key, page in zip(tb[2], b_pages, strict=True):
        assert torch.equal(rig.stored(key), page)


def test_a_released_request_is_freed_at_once_and_a_late_duplicate_ack_still_refused(
    rig: Rig,
) -> None:
    """Once released, a request's Lifecycle no longer leads back to it (no reference cycle):
    the runtime's last reference gone, it is freed without the cycle collector. An engine's
    duplicate of its last ack after that is still a DuplicateAck, changing nothing."""
    m = rig.manager
    req = m.start("r", [], rig.on_release)
    ticket = m.offload(req, tokens_for(PAGE + 1, 1), [1, 2])
    assert ticket is not None
    m.finish(req)
    m.close()
    rig.store.close()  # its writer thread lets go of the last put's token (the request)
    assert rig.released == [(req, (1, 2))] and req._lifecycle.owner is m
    gone = weakref.ref(req)
    gc.disable()
    try:
        del req
        rig.released.clear()
        assert gone() is None
    finally:
        gc.enable()
    before = m.metrics()
    m.transfers.apply_acks([Ack(ticket, (1,), (0,))])
    assert m.refusals.count("DuplicateAck") == 1
    assert m.metrics().chunks_acked == before.chunks_acked and m.host.num_used == 0


def test_scenario_full_host_pool_leaves_no_state_behind(rig: Rig) -> None:
    """Scenario: the host pool is full when a chunk is due.

    Nothing may change (no chunk recorded, no pages held); the chunk is
    retried the next step once pages are free, and the refusal is counted.
    """
    small = HostPagePool(1, rig.layout.page_numel, torch.float32)
    engine = CpuCopyEngine(rig.layout, small, copy_delay=0.02)
    m = OffloadManager(engine, small, rig.store, page_size=PAGE)
    try:
        lc = m.start("r", [], rig.on_release)
        before = lc.snapshot()
        assert m.offload(lc, tokens_for(2 * PAGE + 1, 5), [1, 2]) is None  # needs 2 pages
        assert lc.snapshot() == before and small.num_used == 0
        assert m.metrics().host_pool_exhausted == 1
        one = m.offload(lc, tokens_for(PAGE + 1, 5), [1, 2])
        assert one is not None and small.num_used == 1
        m.close()
        assert small.num_used == 0 and rig.store.contains(one[2][0])
    finally:
        engine.close()


def test_scenario_progress_never_polled_close_drains_everything(rig: Rig) -> None:
    """Scenario: a runtime submits and finishes but never polls; close() must drain it all."""
    m = rig.manager
    lcs = []
    for i in range(4):
        lc = m.start(f"r{i % 2}", [], rig.on_release)
        pages = [8 * i + j for j in range(3)]
        rig.fill(pages, tag=10 + i)
        assert m.offload(lc, tokens_for(3 * PAGE + 1, i), pages) is not None
        m.finish(lc)
        lcs.append(lc)
    m.close(timeout=10)
    metrics = m.metrics()
    assert metrics.chunks_in_flight == 0 and metrics.store_writes_pending == 0
    assert rig.host.num_used == 0
    assert {id(r[0]) for r in rig.released} == {id(lc) for lc in lcs}
    assert metrics.pages_stored == 12 and metrics.lifecycles_by_state["RELEASED"] == 4


class _ReportsTwice(CpuCopyEngine):
    """A real CPU engine that reports every ack twice (an engine bug the manager survives)."""

    def poll(self) -> list[Ack]:
        return [ack for ack in super().poll() for _ in range(2)]


def test_scenario_copy_failure_frees_host_pages_once_and_still_releases(rig: Rig) -> None:
    """Scenario: a copy fails. Its pages are not stored, its host pages are freed
    exactly once, and a duplicate of the failed ack is refused without a second free."""
    engine = _ReportsTwice(rig.layout, rig.host, copy_delay=0.05)
    m = OffloadManager(engine, rig.host, rig.store, page_size=PAGE)
    lc = m.start("r", [], rig.on_release)
    engine.fail_next(1)
    ticket = m.offload(lc, tokens_for(PAGE + 1, 6), [1])
    assert ticket is not None and rig.host.num_used == 1
    m.finish(lc)
    deadline = time.monotonic() + 5
    while lc.state is not State.RELEASED:
        assert time.monotonic() < deadline, "the failed copy's ack did not arrive"
        time.sleep(0.002)
        m.poll()  # the ack and its duplicate arrive in one poll
    assert rig.host.num_used == 0
    m.close()
    engine.close()
    metrics = m.metrics()
    assert metrics.copy_failures == 1 and metrics.refused_events == {DuplicateAck.__name__: 1}
    assert not rig.store.contains(ticket[2][0])
    assert len(rig.released) == 1


def test_scenario_store_failure_frees_host_pages_and_stores_nothing(rig: Rig) -> None:
    """Scenario: the store fails a write: host pages freed, counted, no page visible."""
    m = rig.manager
    rig.store.fail_next(1)
    lc = m.start("r", [], rig.on_release)
    ticket = m.offload(lc, tokens_for(2 * PAGE + 1, 7), [1, 2])
    assert ticket is not None
    m.finish(lc)
    m.close()
    assert rig.host.num_used == 0 and m.metrics().store_failures == 1
    assert not any(rig.store.contains(k) for k in ticket[2])
    assert lc.state is State.RELEASED


def test_release_callback_error_is_reported_and_never_released_twice(rig: Rig) -> None:
    m = rig.manager
    calls = []

    def broken(lc: OffloadRequest, pages: object) -> None:
        calls.append(lc)
        raise RuntimeError("runtime bug")

    lc = m.start("r", [], broken)
    m.offload(lc, tokens_for(PAGE + 1, 8), [1])
    m.finish(lc)
    m.close()
    assert calls == [lc] and lc.state is State.RELEASED
    assert m.metrics().release_callback_errors == 1
    assert isinstance(m.callback_errors[0].__cause__, RuntimeError)
    with pytest.raises(InvalidTransition):
        m.finish(lc)
    assert calls == [lc]


def test_refusals_change_nothing(rig: Rig) -> None:
    m = rig.manager
    other = OffloadManager(rig.engine, rig.host, rig.store, page_size=PAGE)
    lc = other.start("x", [], rig.on_release)
    with pytest.raises(ManagerError, match="not started by this manager"):
        m.offload(lc, tokens_for(PAGE + 1, 9), [1])
    mine = m.start("y", [], rig.on_release)
    before, used = mine.snapshot(), rig.host.num_used
    with pytest.raises(ManagerError, match="device pages cannot hold"):
        m.offload(mine, tokens_for(2 * PAGE + 1, 9), [1])  # one page cannot hold 8 tokens
    with pytest.raises(EngineError, match="out of range"):
        m.offload(mine, tokens_for(PAGE + 1, 9), [10_000])  # out of the device pool
    assert mine.snapshot() == before and rig.host.num_used == used
    assert rig.engine.inflight == 0


def test_metrics_never_negative_and_consistent(rig: Rig) -> None:
    m = rig.manager
    lcs = [m.start(f"r{i % 3}", [], rig.on_release) for i in range(6)]
    for step in range(1, 4):
        for i, lc in enumerate(lcs):
            if lc.state in (State.IDLE, State.OFFLOADING):
                m.offload(lc, tokens_for(step * PAGE + 1, i), list(range(8 * i, 8 * i + 4)))
        m.poll()
        snap = m.metrics()
        assert all(v >= 0 for v in snap.lifecycles_by_state.values())
        assert snap.chunks_in_flight == rig.engine.inflight
        m.finish(lcs[step])
    m.close()
    snap = m.metrics()
    assert snap.chunks_in_flight == 0
    assert sum(snap.lifecycles_by_state.values()) == 6
    assert all(v >= 0 for v in snap.lifecycles_by_state.values())
    assert snap.lifecycles_by_state["RELEASED"] == 3


def test_scenario_offload_on_closed_engine_changes_nothing(rig: Rig) -> None:
    """Scenario: the engine was closed under the runtime. The chunk is refused before
    the Lifecycle hears of it: no chunk that can never be acked, no host page held."""
    m = rig.manager
    lc = m.start("r", [], rig.on_release)
    rig.engine.close()
    before = lc.snapshot()
    with pytest.raises(EngineClosed):
        m.offload(lc, tokens_for(PAGE + 1, 12), [1, 2])
    assert lc.snapshot() == before and rig.host.num_used == 0
    m.finish(lc)
    assert [r[0] for r in rig.released] == [lc]


def test_scenario_store_refusing_a_put_does_not_drop_other_acks(rig: Rig) -> None:
    """Scenario: the store refuses one chunk's put outright (here: keys it cannot name).

    The other acks of the same poll must still be applied: both Lifecycles
    release, every host page is freed, and the refusal is counted.
    """

    def upper_keys(tokens: Any, page_size: int, prior: str | None) -> list[str]:
        return [k.upper() for k in page_hashes(tokens, page_size, prior.lower() if prior else None)]

    m = OffloadManager(rig.engine, rig.host, rig.store, page_size=PAGE, hasher=upper_keys)
    lcs = [m.start(f"r{i}", [], rig.on_release) for i in range(2)]
    for i, lc in enumerate(lcs):
        assert m.offload(lc, tokens_for(PAGE + 1, 13 + i), [i]) is not None
        m.finish(lc)
    m.close()
    assert [r[0] for r in rig.released] == lcs
    assert rig.host.num_used == 0
    snap = m.metrics()
    assert snap.store_failures == 2 and snap.refused_events == {"InvalidPut": 2}


def test_finish_gives_the_final_page_table_and_steps_after_finish_are_refused(rig: Rig) -> None:
    m = rig.manager
    lc = m.start("r", tokens_for(6, 14), rig.on_release)
    m.finish(lc, FinishReason.ABORTED, device_pages=[7, 8])  # aborted before any step
    assert rig.released == [(lc, (7, 8))]
    with pytest.raises(ManagerError, match="decoding has ended"):
        m.offload(lc, tokens_for(9, 14), [9, 10, 11])
    assert lc.device_pages == [7, 8] and lc.state is State.RELEASED


def test_refused_steps_leave_the_page_table_and_are_counted(rig: Rig) -> None:
    m = rig.manager
    lc = m.start("r", [], rig.on_release)
    m.offload(lc, tokens_for(2, 15), [1, 2, 3])
    with pytest.raises(ManagerError, match="device pages cannot hold"):
        m.offload(lc, tokens_for(2 * PAGE + 1, 15), [1])  # too few pages for 8 tokens
    with pytest.raises(InvalidEvent):
        m.finish(lc, "bogus", device_pages=[9, 9])  # type: ignore[arg-type]
    assert lc.device_pages == [1, 2, 3] and lc.state is State.IDLE
    assert m.metrics().refused_events == {"ManagerError": 1, "InvalidEvent": 1}


class _BrokenOnce(MemoryStore):
    """A store whose first put fails outright (as a store backed by a dead disk might)."""

    broken = True

    def put(self, token: object, keys: Any, pages: torch.Tensor) -> None:
        if self.broken:
            self.broken = False
            raise OSError("disk gone")
        super().put(token, keys, pages)


class _PollWaits(CpuCopyEngine):
    """Polling waits for every copy, so both acks surely come back in one poll."""

    def poll(self) -> list[Any]:
        return self.drain(5)


def test_scenario_an_exception_in_poll_loses_no_other_ack(rig: Rig) -> None:
    """Scenario: two finished requests' copies complete; the store's first put raises.

    The error reaches the runtime, but the second ack of that same poll stays
    with the manager: the next poll applies it, both requests release, and every
    host page is freed.
    """
    engine, store = _PollWaits(rig.layout, rig.host, copy_delay=0.02), _BrokenOnce()
    m = OffloadManager(engine, rig.host, store, page_size=PAGE)
    try:
        a, b = (m.start(rid, [], rig.on_release) for rid in ("a", "b"))
        for i, lc in enumerate((a, b)):
            m.offload(lc, tokens_for(PAGE + 1, 16 + i), [i])
            m.finish(lc)
        with pytest.raises(OSError):
            m.poll()
        assert [r[0] for r in rig.released] == [a] and b.state is State.FINISHED
        m.poll()
        assert [r[0] for r in rig.released] == [a, b]
        m.close()
        assert rig.host.num_used == 0
        assert m.metrics().store_failures == 1 and m.metrics().pages_stored == 1
    finally:
        engine.close()
        store.close()


class _TakesNothing(CpuCopyEngine):
    """An engine whose submit fails after check passed (e.g. out of memory on the device)."""

    def submit(self, ticket: Any, device_pages: Any, host_pages: Any) -> None:
        raise MemoryError("no room for the staging buffer")


def test_scenario_engine_failing_after_check_settles_the_chunk(rig: Rig) -> None:
    """Scenario: the engine accepted the pages in check() but fails in submit().

    The Lifecycle already holds the chunk; it must be settled as a failed copy
    (host pages freed), so the request still drains and releases.
    """
    engine = _TakesNothing(rig.layout, rig.host)
    m = OffloadManager(engine, rig.host, rig.store, page_size=PAGE)
    try:
        lc = m.start("r", [], rig.on_release)
        with pytest.raises(MemoryError):
            m.offload(lc, tokens_for(PAGE + 1, 18), [1])
        assert lc.state is State.IDLE and lc.inflight == 0 and rig.host.num_used == 0
        assert m.metrics().copy_failures == 1 and m.metrics().chunks_in_flight == 0
        m.finish(lc)
        assert [r[0] for r in rig.released] == [lc]
    finally:
        engine.close()


def test_a_request_record_has_no_events_that_bypass_its_manager(rig: Rig) -> None:
    """The runtime holds a record, not a Lifecycle: it has no event to call behind the
    manager's back, and its views are read-only, so nothing but the manager moves it."""
    m = rig.manager
    lc = m.start("r", [], rig.on_release)
    ticket = m.offload(lc, tokens_for(PAGE + 1, 19), [1])
    assert ticket is not None
    before, counters = lc.snapshot(), m.metrics()
    for event in ("submit", "ack", "finish", "load", "lifecycle"):
        assert not hasattr(lc, event), event
    for view, value in (("state", State.RELEASED), ("inflight", 0), ("rid", "s")):
        with pytest.raises(AttributeError):
            setattr(lc, view, value)
    with pytest.raises(AttributeError):
        lc.sneaky = 1  # type: ignore[attr-defined]  # slots: no new attribute either
    assert lc.snapshot() == before and m.metrics() == counters
    m.finish(lc)
    m.close()
    assert lc.state is State.RELEASED
    assert all(v >= 0 for v in m.metrics().lifecycles_by_state.values())


def test_start_refuses_a_prior_the_scheme_cannot_chain_from(rig: Rig) -> None:
    m = rig.manager
    with pytest.raises(ManagerError, match="cannot start rid='r'"):
        m.start("r", [], rig.on_release, prior_hash="not-hex")
    with pytest.raises(ManagerError, match="cannot start rid='r'"):
        m.start("r", [1, 2**40, 3, 4, 5], rig.on_release)  # a prompt page it cannot hash
    assert m.metrics().lifecycles_started == 0
    good = m.start("r", [], rig.on_release, prior_hash="ab" * 32)
    assert good.snapshot().last_hash == good.snapshot().chain_tail == "ab" * 32


class _PeerNeverCompletes:
    """An agreement whose peer rank never completes a copy (a real one would time out too)."""

    def __init__(self) -> None:
        self.held: list[Any] = []
        self.completes = False  # set: the peer finally completes what is held

    def submitted(self, ticket: Any) -> None:
        pass

    def admit(self, n_pages: int) -> bool:
        return True

    def agree(self, acks: list[Any]) -> list[Any]:
        self.held += acks
        if not self.completes:
            return []
        done, self.held = self.held, []
        return done

    @property
    def pending(self) -> int:
        return len(self.held)


def test_close_with_an_agreement_that_never_completes_times_out_and_loses_nothing(
    rig: Rig,
) -> None:
    agreement = _PeerNeverCompletes()
    m = OffloadManager(rig.engine, rig.host, rig.store, page_size=PAGE, agreement=agreement)
    lc = m.start("r", [], rig.on_release)
    m.offload(lc, tokens_for(PAGE + 1, 21), [1])
    m.finish(lc)
    with pytest.raises(DrainTimeout):
        m.close(timeout=0.3)
    assert lc.state is State.FINISHED and rig.host.num_used == 1 and agreement.pending == 1
    agreement.completes = True  # the peer finally completes: nothing was lost
    m.close(timeout=10)
    assert lc.state is State.RELEASED and rig.host.num_used == 0
