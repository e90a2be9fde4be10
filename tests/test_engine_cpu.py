"""The CPU copy engine: real worker threads, real tensors, acks that carry their Lifecycle."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from kvlife import Lifecycle, LoadTicket, State, Ticket
from kvlife.engine import Ack, CopyEngine, CpuCopyEngine, host_runs
from kvlife.engine.cpu import MAX_PENDING_FAULTS
from kvlife.errors import (
    ConfigError,
    CopyFault,
    DrainTimeout,
    EngineClosed,
    EngineError,
    PageBusy,
    UnallocatedHostPage,
)
from kvlife.layout import KVLayout, LayerFirstLayout, MLALayout, PageFirstLayout
from kvlife.pool import HostPagePool

PAGE = 4
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
KINDS = ["layer_first", "page_first", "mla"]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}

#: A refusal: the exact error class, and what its message says was wrong.
Refusal = tuple[type[EngineError], str]
LENGTHS: Refusal = (EngineError, "pages but")
OUT_OF_RANGE: Refusal = (EngineError, "out of range")
TWICE: Refusal = (EngineError, "appears twice")
NOT_A_TICKET: Refusal = (EngineError, "expected a Ticket or a LoadTicket")
UNALLOCATED: Refusal = (UnallocatedHostPage, "is free; allocate it")
HOST_BUSY: Refusal = (PageBusy, r"host page \d+ is still being")
DEVICE_BUSY: Refusal = (PageBusy, r"device page \d+ is still being")


def make_layout(kind: str, dtype: torch.dtype = torch.float32, num_pages: int = 8) -> KVLayout:
    if kind == "layer_first":
        return LayerFirstLayout.zeros(2, num_pages, PAGE, 2, 4, dtype=dtype)
    if kind == "page_first":
        return PageFirstLayout.zeros(2, num_pages, PAGE, 2, 4, dtype=dtype)
    return MLALayout.zeros(2, num_pages, PAGE, 12, dtype=dtype)


def fill_random_bits(layout: KVLayout, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for buf in layout.buffers():
        view = buf.view(BITS[layout.dtype])
        info = torch.iinfo(view.dtype)
        view.copy_(torch.randint(info.min, info.max, view.shape, generator=g, dtype=view.dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype])


def chunk(lc: Lifecycle, n_pages: int) -> Ticket:
    """Submit the next ``n_pages`` whole pages of ``lc`` and return the ticket."""
    start = lc.tokens_submitted
    return lc.submit(list(range(start, start + n_pages * PAGE)))


@pytest.fixture
def engines() -> Iterator[Callable[..., CpuCopyEngine]]:
    """Make engines that are closed (threads joined) after the test."""
    made: list[CpuCopyEngine] = []

    def make(layout: KVLayout, host: HostPagePool, **kwargs: object) -> CpuCopyEngine:
        engine = CpuCopyEngine(layout, host, **kwargs)  # type: ignore[arg-type]
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def setup(
    engines: Callable[..., CpuCopyEngine], kind: str = "layer_first", **kwargs: object
) -> tuple[KVLayout, HostPagePool, CpuCopyEngine]:
    layout = make_layout(kind)
    fill_random_bits(layout, seed=7)
    host = HostPagePool(8, layout.page_numel, layout.dtype, pin_memory=False)
    return layout, host, engines(layout, host, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_through_the_engine_is_bit_exact(
    engines: Callable[..., CpuCopyEngine], kind: str, dtype: torch.dtype
) -> None:
    """Device pages -> host pool by the engine -> a fresh device layout: the same bits."""
    src = make_layout(kind, dtype)
    fill_random_bits(src, seed=11)
    host = HostPagePool(8, src.page_numel, dtype, pin_memory=False)
    engine = engines(src, host)
    lc = Lifecycle("r", page_size=PAGE)
    device_pages = [6, 1, 3, 0, 7]
    ticket = chunk(lc, 5)
    host.alloc(1, object())  # host pages start at 1: the engine writes the rows it is given
    host_pages = host.alloc(5, ticket)
    assert host_pages == [1, 2, 3, 4, 5]
    engine.submit(ticket, device_pages, host_pages)
    (ack,) = engine.drain()
    assert ack.ok and ack.ticket is ticket and ack.host_pages == tuple(host_pages)
    for d, h in zip(device_pages, host_pages, strict=True):
        assert torch.equal(bits(host.page(h)), bits(src.read_page(d)))
    assert host.tensor[0].abs().sum() == 0 and host.tensor[6:].abs().sum() == 0
    dst = make_layout(kind, dtype)
    dst.scatter(torch.tensor(device_pages), host.tensor[1:6])
    for d in device_pages:
        assert torch.equal(bits(dst.read_page(d)), bits(src.read_page(d)))


@pytest.mark.parametrize("in_c", [True, False])
def test_host_runs_are_the_maximal_runs_in_c_and_in_python(
    monkeypatch: pytest.MonkeyPatch, in_c: bool
) -> None:
    """host_runs finds the same maximal runs of consecutive pages in one C pass and, where
    kvlife._rowcopy is not built, in Python; from a list, a tuple, an int32 or int64 array
    (strided too), and from items that are not ints (C hands those to Python)."""
    import kvlife.engine.base as base

    if not in_c:
        monkeypatch.setattr(base, "_c_runs", None)
    cases: dict[tuple[int, ...], list[tuple[int, int, int]]] = {
        (): [],
        (4,): [(0, 4, 1)],
        (0, 1, 2, 3): [(0, 0, 4)],
        (5, 2, 3, 7): [(0, 5, 1), (1, 2, 2), (3, 7, 1)],
        (3, 2, 1): [(0, 3, 1), (1, 2, 1), (2, 1, 1)],
        (1, 2, 2, 3): [(0, 1, 2), (2, 2, 2)],  # a page twice: no run crosses it
    }
    for pages, runs in cases.items():
        spread = np.zeros(2 * len(pages), dtype=np.int64)
        spread[::2] = pages
        for given in (
            list(pages),
            pages,
            np.array(pages, dtype=np.int64),
            np.array(pages, dtype=np.int32),
            spread[::2],
            [np.int64(p) for p in pages],
        ):
            assert host_runs(given) == runs, (given, in_c)


def test_scattered_host_pages_are_written_run_by_run(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    layout, host, engine = setup(engines)
    owner = object()
    host.alloc(8, owner)
    host.free([5, 2, 3, 7], owner)
    lc = Lifecycle("r", page_size=PAGE)
    ticket = chunk(lc, 4)
    host_pages = host.alloc(4, ticket)
    assert host_pages == [5, 2, 3, 7]
    assert host_runs(host_pages) == [(0, 5, 1), (1, 2, 2), (3, 7, 1)]
    engine.submit(ticket, [0, 1, 2, 3], host_pages)
    (ack,) = engine.drain()
    assert ack.ok
    for d, h in zip([0, 1, 2, 3], host_pages, strict=True):
        assert torch.equal(bits(host.page(h)), bits(layout.read_page(d)))


def test_overwriting_device_pages_before_the_ack_gives_a_wrong_host_copy(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    """Scenario: the hazard the lifecycle exists for.

    A runtime submits a chunk, then reuses its device pages (say, for another
    request) before the ack. The copy runs later, so the host -- and then the
    store, under this request's keys -- holds the other request's KV.
    """
    layout, host, engine = setup(engines, copy_delay=0.01)
    lc = Lifecycle("r", page_size=PAGE)
    original = [layout.read_page(p).clone() for p in (2, 3)]
    ticket = chunk(lc, 2)
    host_pages = host.alloc(2, ticket)
    assert host_pages is not None
    gate = engine.hold_next()  # the copy is delayed until the gate opens
    done = engine.submit(ticket, [2, 3], host_pages)
    assert not done.query() and not done.started
    reused = torch.full((layout.page_numel,), 9.0)
    layout.write_page(2, reused)  # the runtime reuses device page 2 too early
    gate.open()
    (ack,) = engine.drain()
    assert ack.ok  # the engine cannot know: the ack says success
    assert torch.equal(host.page(host_pages[0]), reused)
    assert not torch.equal(host.page(host_pages[0]), original[0])  # wrong copy
    assert torch.equal(host.page(host_pages[1]), original[1])


def test_waiting_for_the_ack_before_reuse_gives_the_right_copy(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    layout, host, engine = setup(engines, copy_delay=0.01)
    lc = Lifecycle("r", page_size=PAGE)
    original = layout.read_page(2).clone()
    ticket = chunk(lc, 1)
    host_pages = host.alloc(1, ticket)
    assert host_pages is not None
    engine.submit(ticket, [2], host_pages)
    (ack,) = engine.drain()
    lc.ack(ack.ticket)
    layout.write_page(2, torch.full((layout.page_numel,), 9.0))
    assert torch.equal(host.page(host_pages[0]), original)


def test_injected_fault_arrives_as_a_failed_ack_and_pages_stay_accounted(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    _, host, engine = setup(engines)
    lc = Lifecycle("r", page_size=PAGE)
    engine.fail_next()
    t0 = chunk(lc, 2)
    h0 = host.alloc(2, t0)
    t1 = chunk(lc, 1)
    h1 = host.alloc(1, t1)
    assert h0 is not None and h1 is not None
    engine.submit(t0, [0, 1], h0)
    engine.submit(t1, [2], h1)
    acks = engine.drain()
    assert [a.seq for a in acks] == [0, 1]
    failed, good = acks
    assert not failed.ok and isinstance(failed.error, CopyFault)
    assert failed.host_pages == tuple(h0) and good.ok
    assert host.num_used == 3 and host.owned_by(t0) == h0  # still accounted, still owned
    for ack in acks:
        ack.owner.ack(ack.ticket)
        host.free(ack.host_pages, ack.ticket)
    assert host.num_used == 0 and lc.state is State.IDLE and lc.inflight == 0


def test_injected_error_is_the_given_one(engines: Callable[..., CpuCopyEngine]) -> None:
    _, host, engine = setup(engines)
    lc = Lifecycle("r", page_size=PAGE)
    boom = OSError("disk on fire")
    engine.fail_next(2, boom)
    for _ in range(3):
        t = chunk(lc, 1)
        pages = host.alloc(1, t)
        assert pages is not None
        engine.submit(t, [t[1]], pages)
    errors = [a.error for a in engine.drain()]
    assert errors[0] is boom and errors[1] is boom and errors[2] is None


def test_fail_rate_is_seeded(engines: Callable[..., CpuCopyEngine]) -> None:
    def pattern(seed: int) -> list[bool]:
        _, host, engine = setup(engines, fail_rate=0.5, seed=seed)
        lc = Lifecycle("r", page_size=PAGE)
        oks = []
        for _ in range(16):
            t = chunk(lc, 1)
            pages = host.alloc(1, t)
            assert pages is not None
            engine.submit(t, [0], pages)
            (ack,) = engine.drain()
            oks.append(ack.ok)
            host.free(ack.host_pages, t)
        return oks

    first = pattern(3)
    assert first == pattern(3)
    assert True in first and False in first


def test_acks_move_only_their_own_lifecycle_even_out_of_order(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    """Scenario: two workers; chunk 0 is held, chunk 1 completes first.

    The ack of chunk 1 reaches its Lifecycle through the ticket; the hash-chain
    tail waits for chunk 0 (page order), then jumps over both.
    """
    _, host, engine = setup(engines, workers=2)
    old = Lifecycle("same-rid", page_size=PAGE)
    new = Lifecycle("same-rid", page_size=PAGE)
    gate = engine.hold_next()
    t0, t1 = chunk(new, 1), chunk(new, 1)
    other = chunk(old, 1)
    for t, dev in ((t0, 0), (t1, 1), (other, 2)):
        pages = host.alloc(1, t)
        assert pages is not None
        engine.submit(t, [dev], pages)
    while engine.inflight > 1:  # chunk 1 and the old life's chunk complete; chunk 0 is held
        for ack in engine.poll():
            assert ack.ticket in (t1, other)
            ack.owner.ack(ack.ticket)
    assert new.inflight == 1 and new.last_hash is None and old.inflight == 0
    gate.open()
    (ack,) = engine.drain()
    assert ack.ticket is t0 and ack.owner is new
    new.ack(ack.ticket)
    assert new.last_hash == t1[2][-1] and new.state is State.IDLE


def test_poll_never_blocks_and_returns_each_ack_once(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    _, host, engine = setup(engines)
    lc = Lifecycle("r", page_size=PAGE)
    gate = engine.hold_next()
    tickets = [chunk(lc, 1) for _ in range(3)]
    events = []
    for i, t in enumerate(tickets):
        pages = host.alloc(1, t)
        assert pages is not None
        events.append(engine.submit(t, [i], pages))
    assert engine.poll() == [] and engine.inflight == 3  # FIFO worker: all wait on the gate
    gate.open()
    events[-1].synchronize()
    seen: list[Ack] = []
    seen += engine.poll()
    seen += engine.drain()
    assert [a.ticket for a in seen] == tickets  # one worker: completion order is submit order
    assert engine.inflight == 0 and engine.poll() == [] and engine.drain() == []
    for a in seen:
        assert a.submitted_at <= a.completed_at
        assert a.device_pages == (a.seq,) and a.owner is lc


def test_drain_timeout_keeps_everything_for_later(engines: Callable[..., CpuCopyEngine]) -> None:
    _, host, engine = setup(engines, workers=2)
    lc = Lifecycle("r", page_size=PAGE)
    gate = engine.hold_next()
    t0, t1 = chunk(lc, 1), chunk(lc, 1)
    for t in (t0, t1):
        pages = host.alloc(1, t)
        assert pages is not None
        done = engine.submit(t, [t[1]], pages)
    done.synchronize()  # chunk 1 is complete, chunk 0 is held
    with pytest.raises(DrainTimeout):
        engine.drain(timeout=0.01)
    assert engine.inflight == 2
    gate.open()
    assert [a.ticket for a in engine.drain()] == [t1, t0]
    assert engine.inflight == 0


def test_ack_is_frozen_and_says_what_it_is(engines: Callable[..., CpuCopyEngine]) -> None:
    _, host, engine = setup(engines)
    lc = Lifecycle("r", page_size=PAGE)
    t = chunk(lc, 1)
    pages = host.alloc(1, t)
    assert pages is not None
    engine.submit(t, [4], pages)
    (ack,) = engine.drain()
    assert (ack.owner, ack.seq, ack.ok, ack.device_pages) == (lc, 0, True, (4,))
    assert ack.keys == t[2] and not ack.is_load
    with pytest.raises(dataclasses.FrozenInstanceError):
        ack.error = None  # type: ignore[misc]


def test_engine_follows_the_protocol(engines: Callable[..., CpuCopyEngine]) -> None:
    _, _, engine = setup(engines)
    assert isinstance(engine, CopyEngine)


# ---------------------------------------------------------------- refusals


def engine_state(engine: CpuCopyEngine, host: HostPagePool) -> tuple[object, ...]:
    owners = tuple(id(host.owner_of(p)) for p in range(host.capacity))
    in_flight = (engine.inflight, engine.host_pages_busy(), engine.host_pages_busy(reads=False))
    return (in_flight, host.num_used, owners, host.tensor.clone())


def same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return a[:3] == b[:3] and torch.equal(a[3], b[3])  # type: ignore[arg-type]


def test_every_refusal_leaves_engine_and_pool_unchanged(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    _, host, engine = setup(engines)
    lc = Lifecycle("r", page_size=PAGE)
    busy_ticket = chunk(lc, 2)
    busy = host.alloc(2, busy_ticket)  # pages 0, 1
    assert busy == [0, 1]
    gate = engine.hold_next()
    engine.submit(busy_ticket, [0, 1], busy)  # in flight, held
    assert engine.host_pages_busy(reads=False) == engine.host_pages_busy() == {0, 1}
    ticket = chunk(lc, 2)
    mine = host.alloc(2, ticket)  # pages 2, 3
    assert mine == [2, 3]
    engine.fail_next()  # must still apply to the next *accepted* chunk
    cases: list[tuple[object, object, object, Refusal]] = [
        (ticket, [2], mine, LENGTHS),
        (ticket, [2, 3], [2], LENGTHS),
        (ticket, [2, 3, 4], [2, 3, 4], LENGTHS),
        (ticket, [2, 8], mine, OUT_OF_RANGE),
        (ticket, [-1, 2], mine, OUT_OF_RANGE),
        (ticket, [2, 2.0], mine, OUT_OF_RANGE),
        (ticket, [2, True], mine, OUT_OF_RANGE),
        (ticket, [2, np.int64(3)], mine, OUT_OF_RANGE),  # an int, exactly
        (ticket, [2, 2**70], mine, OUT_OF_RANGE),
        (ticket, [2, 3], [2, 2**64 + 3], OUT_OF_RANGE),
        (ticket, [2, 3], [2, 8], OUT_OF_RANGE),
        (ticket, [3, 3], mine, TWICE),
        (ticket, [2, 3], [3, 3], TWICE),
        (ticket, [2, 3], [2, 4], UNALLOCATED),
        (ticket, [2, 3], [1, 2], HOST_BUSY),
        ("not a ticket", [2, 3], mine, NOT_A_TICKET),
        (ticket[:3], [2, 3], mine, NOT_A_TICKET),  # a Ticket is a 4-tuple
        ((None, 1, ticket[2], 0), [2, 3], mine, NOT_A_TICKET),  # of an owner, ...
        ((lc, "1", ticket[2], 0), [2, 3], mine, NOT_A_TICKET),  # ... an int seq, ...
        ((*ticket[:2], list(ticket[2]), ticket[3]), [2, 3], mine, NOT_A_TICKET),  # keys: a tuple
    ]
    for t, dev, hst, (error, why) in cases:
        before = engine_state(engine, host)
        with pytest.raises(error, match=why) as refused:
            engine.submit(t, dev, hst)  # type: ignore[arg-type]
        assert type(refused.value) is error
        if t is ticket and why != LENGTHS[1]:
            with pytest.raises(error, match=why):
                engine.check(dev, hst)  # type: ignore[arg-type]
        assert same(engine_state(engine, host), before)
        assert engine.poll() == []
    engine.check([2, 3], mine)
    engine.submit(ticket, [2, 3], mine)
    gate.open()
    acks = engine.drain()
    assert [a.ok for a in acks] == [True, False]  # the injected fault hit the accepted chunk
    assert lc.inflight == 2  # the engine never touches the Lifecycle


def test_refusal_of_a_closed_engine(engines: Callable[..., CpuCopyEngine]) -> None:
    _, host, engine = setup(engines)
    lc = Lifecycle("r", page_size=PAGE)
    held = chunk(lc, 1)
    pages = host.alloc(1, held)
    assert pages is not None
    engine.hold_next()
    engine.submit(held, [0], pages)
    engine.close()  # opens the gate; the submitted chunk still completes
    engine.close()
    t = chunk(lc, 1)
    more = host.alloc(1, t)
    assert more is not None
    before = engine_state(engine, host)
    with pytest.raises(EngineClosed):
        engine.submit(t, [1], more)
    assert same(engine_state(engine, host), before)
    (ack,) = engine.drain()
    assert ack.ticket is held and ack.ok and engine.inflight == 0


def test_layout_and_pool_must_agree() -> None:
    layout = make_layout("layer_first")
    with pytest.raises(ConfigError, match=r"host pool pages are torch\.float16"):
        CpuCopyEngine(layout, HostPagePool(4, layout.page_numel, torch.float16, pin_memory=False))
    with pytest.raises(ConfigError, match="host pool pages are"):
        CpuCopyEngine(layout, HostPagePool(4, layout.page_numel + 1, torch.float32))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"copy_delay": -1.0},
        {"copy_delay": float("inf")},
        {"delay_jitter": -0.1},
        {"delay_jitter": float("nan")},
        {"fail_rate": 1.5},
        {"workers": -1},
        {"workers": True},
        {"workers": 0, "copy_delay": 0.1},
        {"workers": 0, "delay_jitter": 0.1},
        {"copy_delay": True},
        {"copy_delay": "0.1"},
        {"delay_jitter": 10**400},
    ],
)
def test_bad_engine_settings_are_refused(kwargs: dict[str, float]) -> None:
    layout = make_layout("page_first")
    host = HostPagePool(4, layout.page_numel, layout.dtype, pin_memory=False)
    with pytest.raises(ConfigError):
        CpuCopyEngine(layout, host, **kwargs)  # type: ignore[arg-type]


def test_defect13_close_wakes_sleeping_copies_and_is_bounded(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    """A copy sleeping out a huge delay runs at close; close returns in bounded time."""
    layout, host, engine = setup(engines, copy_delay=1e9, workers=2)
    lc = Lifecycle("r", page_size=PAGE)
    t = chunk(lc, 1)
    pages = host.alloc(1, t)
    assert pages is not None
    engine.submit(t, [0], pages)
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()
    closer.join(5.0)
    assert not closer.is_alive(), "close() joined a sleeping worker with no timeout"
    (ack,) = engine.drain(timeout=5.0)  # submitted chunks still complete and are acked
    assert ack.ok and torch.equal(host.page(pages[0]), layout.read_page(0))
    assert engine.copy_errors == 0


def test_bad_fault_injection_is_refused(engines: Callable[..., CpuCopyEngine]) -> None:
    _, _, engine = setup(engines)
    with pytest.raises(ConfigError):
        engine.fail_next(0)
    with pytest.raises(ConfigError):
        engine.slow_next(-1.0)


def test_issue23_fault_injection_is_refused_typed_and_queues_nothing(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    """fail_next(10**12) was a MemoryError and fail_next(True) one fault; each bad count,
    error or delay is a ConfigError naming it, and the next chunk copies as if none came."""
    layout, host, engine = setup(engines)
    bad_calls: list[tuple[Callable[[], None], str]] = [
        (lambda: engine.fail_next(10**12), "at most"),
        (lambda: engine.fail_next(MAX_PENDING_FAULTS + 1), "at most"),
        (lambda: engine.fail_next(True), "positive int"),
        (lambda: engine.fail_next(2.0), "positive int"),  # type: ignore[arg-type]
        (lambda: engine.fail_next(1, "boom"), "exception"),  # type: ignore[arg-type]
        (lambda: engine.slow_next(float("inf")), "seconds"),
        (lambda: engine.slow_next(float("nan")), "seconds"),
        (lambda: engine.slow_next(10**400), "seconds"),
        (lambda: engine.slow_next(True), "seconds"),
    ]
    for call, says in bad_calls:
        with pytest.raises(ConfigError, match=says):
            call()
    lc = Lifecycle("r", page_size=PAGE)
    t = chunk(lc, 1)
    pages = host.alloc(1, t)
    assert pages is not None
    engine.submit(t, [0], pages)
    (ack,) = engine.drain(timeout=5.0)
    assert ack.ok, ack.error  # no refused call left a fault or a delay behind
    assert torch.equal(host.page(pages[0]), layout.read_page(0))


def test_issue23_the_bound_is_on_faults_pending_in_all(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    _, _, engine = setup(engines)
    engine.fail_next(MAX_PENDING_FAULTS - 1)
    with pytest.raises(ConfigError, match="at most"):
        engine.fail_next(2)
    engine.fail_next(1)  # exactly the bound pending
    with pytest.raises(ConfigError, match="at most"):
        engine.fail_next(1)


def test_slow_and_jittered_copies_still_copy_right(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    layout, host, engine = setup(engines, delay_jitter=0.005, workers=2, seed=5)
    lc = Lifecycle("r", page_size=PAGE)
    engine.slow_next(0.01)
    for p in range(4):
        t = chunk(lc, 1)
        pages = host.alloc(1, t)
        assert pages is not None
        engine.submit(t, [p], pages)
    acks = engine.drain()
    assert sorted(a.seq for a in acks) == [0, 1, 2, 3]
    for a in acks:
        assert a.ok
        assert torch.equal(host.page(a.host_pages[0]), layout.read_page(a.device_pages[0]))


# ---------------------------------------------------------------- loads (host -> device)


def load(lc: Lifecycle, n_pages: int) -> LoadTicket:
    """Start a load of ``n_pages`` pages of ``lc`` and return its ticket."""
    return lc.load([f"key-{lc.rid}-{i}" for i in range(n_pages)])


def device_state(layout: KVLayout) -> list[torch.Tensor]:
    return [b.clone() for b in layout.buffers()]


def device_unchanged(layout: KVLayout, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(bits(a), bits(b)) for a, b in zip(layout.buffers(), before, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_store_then_load_into_other_device_pages_is_bit_exact(
    engines: Callable[..., CpuCopyEngine], kind: str, dtype: torch.dtype
) -> None:
    """A chunk stored to scattered host pages, loaded back into other device pages: same bits."""
    layout = make_layout(kind, dtype, num_pages=16)
    fill_random_bits(layout, seed=13)
    host = HostPagePool(10, layout.page_numel, dtype, pin_memory=False)
    engine = engines(layout, host)
    owner = object()
    host.alloc(10, owner)
    host.free([8, 2, 3, 4, 0, 9], owner)  # host runs: 8 | 2 3 4 | 0 | 9
    lc = Lifecycle("r", page_size=PAGE)
    stored_from = [6, 1, 3, 0, 7, 12]
    ticket = chunk(lc, 6)
    host_pages = host.alloc(6, ticket)
    assert host_pages == [8, 2, 3, 4, 0, 9]
    engine.submit(ticket, stored_from, host_pages)
    (ack,) = engine.drain()
    assert ack.ok and not ack.is_load
    lc.ack(ack.ticket)
    originals = {p: layout.read_page(p).clone() for p in range(16)}
    loaded_into = [9, 10, 11, 13, 2, 15]  # consecutive stretch 9 10 11, then scattered
    ticket_in = load(lc, 6)
    engine.submit(ticket_in, loaded_into, host_pages)
    (ack,) = engine.drain()
    assert ack.ok and ack.is_load and ack.ticket is ticket_in and ack.owner is lc
    assert ack.device_pages == tuple(loaded_into) and ack.host_pages == tuple(host_pages)
    lc.ack(ack.ticket)
    assert lc.state is State.IDLE and lc.inflight == 0
    for s, d in zip(stored_from, loaded_into, strict=True):
        assert torch.equal(bits(layout.read_page(d)), bits(originals[s]))
    for p in set(range(16)) - set(loaded_into):
        assert torch.equal(bits(layout.read_page(p)), bits(originals[p]))  # untouched


def test_a_load_writes_the_device_pages_when_it_runs_not_at_submit(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    """Scenario: a runtime reads a load's device pages before the ack: stale KV.

    The pages are right only once the ack has come, which is why the runtime
    must wait for it (as vLLM waits for ``get_finished``).
    """
    layout, host, engine = setup(engines)
    lc = Lifecycle("r", page_size=PAGE)
    ticket = load(lc, 1)
    (h,) = host.alloc(1, ticket) or []
    host.tensor[h] = 5.0
    stale = layout.read_page(3).clone()
    gate = engine.hold_next()
    done = engine.submit(ticket, [3], [h])
    assert torch.equal(bits(layout.read_page(3)), bits(stale))  # read too early: stale
    gate.open()
    done.synchronize()
    (ack,) = engine.drain()
    assert ack.ok and torch.equal(layout.read_page(3), host.page(h))


def test_a_failed_load_is_an_ack_with_its_error(engines: Callable[..., CpuCopyEngine]) -> None:
    layout, host, engine = setup(engines)
    lc = Lifecycle("r", page_size=PAGE)
    before = device_state(layout)
    boom = OSError("host tier unreadable")
    engine.fail_next(1, boom)
    t0 = load(lc, 2)
    pages = host.alloc(2, t0)
    assert pages is not None
    engine.submit(t0, [4, 5], pages)
    engine.fail_next()
    t1 = load(lc, 1)
    more = host.alloc(1, t1)
    assert more is not None
    engine.submit(t1, [6], more)
    first, second = engine.drain()
    assert first.ticket is t0 and first.is_load and first.error is boom
    assert first.device_pages == (4, 5) and first.host_pages == tuple(pages)
    assert second.ticket is t1 and isinstance(second.error, CopyFault)
    assert "load 1" in str(second.error)
    assert device_unchanged(layout, before) and engine.copy_errors == 0
    for ack in (first, second):
        ack.owner.ack(ack.ticket)
        host.free(ack.host_pages, ack.ticket)
    assert lc.inflight == 0 and host.num_used == 0
    # the pages are free again for the next load
    t2 = load(lc, 2)
    again = host.alloc(2, t2)
    assert again is not None
    engine.submit(t2, [4, 5], again)
    (ack,) = engine.drain()
    assert ack.ok and torch.equal(layout.read_page(4), host.page(again[0]))


def test_a_load_fails_for_a_reason_of_its_own_and_is_counted(
    engines: Callable[..., CpuCopyEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, host, engine = setup(engines)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("scatter broke")

    monkeypatch.setattr(layout, "scatter_runs", broken)
    lc = Lifecycle("r", page_size=PAGE)
    t = load(lc, 1)
    pages = host.alloc(1, t)
    assert pages is not None
    engine.submit(t, [0], pages)
    (ack,) = engine.drain()
    assert isinstance(ack.error, RuntimeError) and ack.is_load
    assert engine.copy_errors == 1 and engine.last_copy_error is ack.error


def test_loads_and_stores_in_flight_at_once_copy_right(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    """Two workers, stores and loads of two lifecycles interleaved, some held, all right."""
    layout = make_layout("layer_first", num_pages=16)
    fill_random_bits(layout, seed=21)
    host = HostPagePool(16, layout.page_numel, layout.dtype, pin_memory=False)
    engine = engines(layout, host, workers=2, delay_jitter=0.002, seed=3)
    originals = {p: layout.read_page(p).clone() for p in range(16)}
    a, b = Lifecycle("a", page_size=PAGE), Lifecycle("b", page_size=PAGE)
    loaded_rows: dict[object, tuple[list[int], list[int]]] = {}
    gate = engine.hold_next()
    for lc, store_pages, load_pages in ((a, [0, 1, 2], [8, 9]), (b, [3, 4], [10, 11, 12])):
        st = chunk(lc, len(store_pages))
        sh = host.alloc(len(store_pages), st)
        assert sh is not None
        engine.submit(st, store_pages, sh)
        lt = load(lc, len(load_pages))
        lh = host.alloc(len(load_pages), lt)
        assert lh is not None
        for i, h in enumerate(lh):
            host.tensor[h] = float(10 * len(loaded_rows) + i)
        engine.submit(lt, load_pages, lh)
        loaded_rows[lc.rid] = (load_pages, lh)
        assert lc.inflight == 2
    assert engine.inflight == 4
    gate.open()
    acks = engine.drain()
    assert len(acks) == 4 and all(ack.ok for ack in acks)
    assert sum(ack.is_load for ack in acks) == 2
    for ack in acks:
        if ack.is_load:
            pages, rows = loaded_rows[ack.owner.rid]
            assert ack.device_pages == tuple(pages)
            for d, h in zip(pages, rows, strict=True):
                assert torch.equal(layout.read_page(d), host.page(h))
        else:
            for d, h in zip(ack.device_pages, ack.host_pages, strict=True):
                assert torch.equal(bits(host.page(h)), bits(originals[d]))
        ack.owner.ack(ack.ticket)
    assert a.inflight == b.inflight == 0 and engine.inflight == 0


def test_two_loads_may_read_one_host_page(engines: Callable[..., CpuCopyEngine]) -> None:
    """Two requests sharing a prefix load the same host page into their own device pages."""
    layout, host, engine = setup(engines)
    owner = object()
    (h,) = host.alloc(1, owner) or []
    host.tensor[h] = 4.0
    gate = engine.hold_next()
    t0 = load(Lifecycle("a", page_size=PAGE), 1)
    t1 = load(Lifecycle("b", page_size=PAGE), 1)
    engine.submit(t0, [1], [h])
    engine.submit(t1, [2], [h])
    with pytest.raises(PageBusy, match="being read by a load"):  # no store may write it now
        engine.check([5], [h])
    gate.open()
    assert [ack.ok for ack in engine.drain()] == [True, True]
    assert torch.equal(layout.read_page(1), host.page(h))
    assert torch.equal(layout.read_page(2), host.page(h))
    engine.check([5], [h])  # free to write again once both are acked


def test_a_page_two_loads_read_stays_busy_until_the_last_is_acked(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    """Loads overlapping in one host page: acking one frees its other pages at once (a store
    may write them) and leaves the shared page busy until the other load is acked too."""
    _, host, engine = setup(engines)
    owner = object()
    h0, h1, h2 = host.alloc(3, owner) or []
    first, second = engine.hold_next(), engine.hold_next()
    done = engine.submit(load(Lifecycle("a", page_size=PAGE), 2), [1, 2], [h0, h1])
    engine.submit(load(Lifecycle("b", page_size=PAGE), 2), [3, 4], [h1, h2])
    assert engine.host_pages_busy() == {h0, h1, h2}  # read: no store may write them
    assert engine.host_pages_busy(reads=False) == set()  # nothing writes them
    first.open()
    done.synchronize(timeout=10.0)
    assert [a.host_pages for a in engine.poll()] == [(h0, h1)]
    assert engine.host_pages_busy() == {h1, h2}
    engine.check([5], [h0])  # only the first load read it: free
    for page in (h1, h2):
        with pytest.raises(PageBusy, match="being read by a load"):
            engine.check([5], [page])
    second.open()
    assert [a.host_pages for a in engine.drain()] == [(h1, h2)]
    engine.check([5, 6, 7], [h0, h1, h2])  # every page free again


def full_state(engine: CpuCopyEngine, host: HostPagePool, layout: KVLayout) -> tuple[object, ...]:
    return (*engine_state(engine, host), device_state(layout))


def same_full(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return same(a[:4], b[:4]) and all(
        torch.equal(bits(x), bits(y))
        for x, y in zip(a[4], b[4], strict=True)  # type: ignore[call-overload]
    )


def test_every_load_refusal_leaves_engine_pool_and_device_unchanged(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    """In flight and held: a store (device 0 1 -> host 0 1) and a load (host 2 -> device 2)."""
    layout, host, engine = setup(engines)
    lc = Lifecycle("r", page_size=PAGE)
    gate = engine.hold_next()
    store = chunk(lc, 2)
    assert host.alloc(2, store) == [0, 1]
    engine.submit(store, [0, 1], [0, 1])
    reading = load(lc, 1)
    assert host.alloc(1, reading) == [2]
    engine.submit(reading, [2], [2])
    ticket = load(lc, 2)
    mine = host.alloc(2, ticket)
    assert mine == [3, 4]
    engine.fail_next()  # must still apply to the next *accepted* chunk
    other_lc = Lifecycle("other", page_size=PAGE)
    cases: list[tuple[object, object, object, Refusal]] = [
        (ticket, [5], mine, LENGTHS),
        (ticket, [5, 6], [3], LENGTHS),
        (ticket, [5, 6, 7], [3, 4, 5], LENGTHS),
        (ticket, [5, 8], mine, OUT_OF_RANGE),
        (ticket, [5, 6], [3, 8], OUT_OF_RANGE),
        (ticket, [5, 5], mine, TWICE),
        (ticket, [5, 6], [3, 3], TWICE),
        (ticket, [5, 6], [3, 5], UNALLOCATED),
        (ticket, [5, 6], [1, 3], HOST_BUSY),  # host page 1 is being written by the store
        (ticket, [5, 2], mine, DEVICE_BUSY),  # device page 2 is being written by a load
        (ticket, [1, 5], mine, DEVICE_BUSY),  # device page 1 is being read by the store
        # a store may not read device pages a load writes, nor write host pages it reads
        (chunk(other_lc, 1), [2], [3], DEVICE_BUSY),
        (chunk(other_lc, 1), [6], [2], HOST_BUSY),
    ]
    for t, dev, hst, (error, why) in cases:
        before = full_state(engine, host, layout)
        with pytest.raises(error, match=why) as refused:
            engine.submit(t, dev, hst)  # type: ignore[arg-type]
        assert type(refused.value) is error
        if why != LENGTHS[1]:
            with pytest.raises(error, match=why):
                engine.check(dev, hst, load=type(t) is LoadTicket)  # type: ignore[arg-type]
        assert same_full(full_state(engine, host, layout), before)
        assert engine.poll() == []
    engine.check([5, 6], mine, load=True)
    engine.submit(ticket, [5, 6], mine)
    gate.open()
    acks = engine.drain()
    assert [(a.is_load, a.ok) for a in acks] == [(False, True), (True, True), (True, False)]
    assert lc.inflight == 3  # the engine never touches the Lifecycle
    # acked: every page is free for any direction again
    engine.check([2], [2], load=True)
    engine.check([1, 2], [2, 1])


@pytest.mark.parametrize(
    "refusals",
    [
        test_every_refusal_leaves_engine_and_pool_unchanged,
        test_every_load_refusal_leaves_engine_pool_and_device_unchanged,
    ],
)
@pytest.mark.parametrize("without", [("_c_pages",), ("_c_claim",), ("_c_pages", "_c_claim")])
def test_every_refusal_is_the_same_without_the_c_page_check(
    monkeypatch: pytest.MonkeyPatch,
    engines: Callable[..., CpuCopyEngine],
    refusals: Callable[[Callable[..., CpuCopyEngine]], None],
    without: tuple[str, ...],
) -> None:
    """Where kvlife._rowcopy is not built the pages are checked and claimed in Python: the
    same refusals, the same pages marked and released."""
    import kvlife.engine.base as base

    for name in without:
        monkeypatch.setattr(base, name, None)
    refusals(engines)


def test_a_ticket_of_any_owner_is_copied_and_acked_to_that_owner(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    """Scenario: a host whose unit of work is not a request life (a vLLM transfer job)
    submits a store and a load under its own small record, with its own key type (bytes).
    The engine copies both and each ack carries that record: no Lifecycle is made for an
    operation, and the bytes land where they belong."""
    layout, host, engine = setup(engines)

    class Job:  # a host's record: no Lifecycle, no state machine
        pass

    job = Job()
    pages = host.alloc(2, job)
    assert pages is not None
    engine.submit((job, 0, (b"k0", b"k1"), 0), [3, 5], pages)
    (stored,) = engine.drain()
    assert stored.owner is job and stored.ok and not stored.is_load
    assert stored.keys == (b"k0", b"k1")
    expected = torch.stack([layout.read_page(3), layout.read_page(5)])
    assert torch.equal(host.tensor[pages], expected)
    engine.submit(LoadTicket(job, 0, (b"k0", b"k1")), [6, 7], pages)
    (loaded,) = engine.drain()
    assert loaded.owner is job and loaded.ok and loaded.is_load
    assert torch.equal(layout.read_page(6), expected[0])
    assert torch.equal(layout.read_page(7), expected[1])


def test_workers_0_copies_in_submit_and_acks_at_the_next_poll(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    """``workers=0`` (the vLLM worker's default on a CPU): submit copies before it returns,
    on the caller's thread; the chunk stays in flight, pages claimed, until a poll or drain
    returns its ack, as with a worker thread. A store, then a load of it elsewhere, then an
    injected fault (acked failed, nothing copied)."""
    layout, host, engine = setup(engines, workers=0)
    assert not any(t.is_alive() for t in engine._threads)
    lc = Lifecycle("r", page_size=PAGE)
    store = chunk(lc, 2)
    pages = host.alloc(2, store)
    assert pages is not None
    event = engine.submit(store, [5, 2], pages)
    assert event.query() and event.started and engine.inflight == 1
    assert all(
        torch.equal(bits(host.page(h)), bits(layout.read_page(d)))
        for d, h in zip([5, 2], pages, strict=True)
    )
    with pytest.raises(PageBusy):  # claimed until acked, as with a worker thread
        engine.submit(chunk(lc, 1), [5], [0])
    (ack,) = engine.poll()
    assert ack.ok and ack.ticket is store and engine.inflight == 0
    lc.ack(store)
    wanted = [bits(layout.read_page(d)).clone() for d in (5, 2)]
    load = Lifecycle("l", page_size=PAGE).load(["a", "b"])
    engine.submit(load, [0, 7], pages)
    (ack,) = engine.drain()
    assert ack.ok and all(
        torch.equal(bits(layout.read_page(d)), w) for d, w in zip([0, 7], wanted, strict=True)
    )
    before = bits(layout.read_page(3)).clone()
    engine.fail_next()
    failed = Lifecycle("f", page_size=PAGE).load(["c"])
    engine.submit(failed, [3], [pages[0]])
    (ack,) = engine.poll()
    assert isinstance(ack.error, CopyFault) and torch.equal(bits(layout.read_page(3)), before)


def test_workers_0_refuses_holds_and_delays_and_changes_nothing(
    engines: Callable[..., CpuCopyEngine],
) -> None:
    """A copy made in submit cannot be held or delayed (submit would never return): both
    are refused with ConfigError, nothing queued, and the next chunk still copies at once."""
    layout, host, engine = setup(engines, workers=0)
    for refused in (engine.hold_next, lambda: engine.slow_next(0.5)):
        with pytest.raises(ConfigError, match="needs a worker thread"):
            refused()
    assert not engine._hold_next and not engine._slow_next and not engine._held
    lc = Lifecycle("r", page_size=PAGE)
    store = chunk(lc, 1)
    pages = host.alloc(1, store)
    assert pages is not None
    assert engine.submit(store, [4], pages).query()
    (ack,) = engine.poll()
    assert ack.ok and torch.equal(bits(host.page(pages[0])), bits(layout.read_page(4)))
