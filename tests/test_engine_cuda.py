"""The CUDA copy engine: side stream, pinned host pages, one event per chunk. Skips without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvlife import Lifecycle, LoadTicket, Ticket
from kvlife.engine import CopyEngine, CudaCopyEngine
from kvlife.errors import ConfigError, EngineClosed, EngineError, PageBusy, UnallocatedHostPage
from kvlife.host_tier import HostTier
from kvlife.layout import KVLayout, LayerFirstLayout, MLALayout, PageFirstLayout
from kvlife.pool import HostPagePool
from kvlife.refusals import Refusals
from kvlife.store import MemoryStore
from kvlife.transfers import Transfers

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PAGE = 4
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
KINDS = ["layer_first", "page_first", "mla"]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def make_layout(kind: str, dtype: torch.dtype = torch.float32, num_pages: int = 8) -> KVLayout:
    if kind == "layer_first":
        return LayerFirstLayout.zeros(2, num_pages, PAGE, 2, 4, dtype=dtype, device="cuda")
    if kind == "page_first":
        return PageFirstLayout.zeros(2, num_pages, PAGE, 2, 4, dtype=dtype, device="cuda")
    return MLALayout.zeros(2, num_pages, PAGE, 12, dtype=dtype, device="cuda")


def fill_random_bits(layout: KVLayout, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    for buf in layout.buffers():
        view = buf.view(BITS[layout.dtype])
        info = torch.iinfo(view.dtype)
        view.copy_(
            torch.randint(
                info.min, info.max, view.shape, generator=g, dtype=view.dtype, device="cuda"
            )
        )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(BITS[t.dtype])


def chunk(lc: Lifecycle, n_pages: int) -> Ticket:
    start = lc.tokens_submitted
    return lc.submit(list(range(start, start + n_pages * PAGE)))


def setup(
    kind: str = "layer_first", dtype: torch.dtype = torch.float32, **kwargs: Any
) -> tuple[KVLayout, HostPagePool, CudaCopyEngine]:
    layout = make_layout(kind, dtype)
    fill_random_bits(layout, seed=5)
    host = HostPagePool(8, layout.page_numel, dtype, pin_memory=True)
    return layout, host, CudaCopyEngine(layout, host, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bit_exact(kind: str, dtype: torch.dtype) -> None:
    src, host, engine = setup(kind, dtype)
    lc = Lifecycle("r", page_size=PAGE)
    device_pages = [6, 1, 3, 0, 7]
    ticket = chunk(lc, 5)
    host.alloc(1, object())
    host_pages = host.alloc(5, ticket)
    assert host_pages == [1, 2, 3, 4, 5]
    engine.submit(ticket, device_pages, host_pages)
    (ack,) = engine.drain()
    assert ack.ok and ack.ticket is ticket and engine.inflight == 0
    for d, h in zip(device_pages, host_pages, strict=True):
        assert torch.equal(bits(host.page(h)), bits(src.read_page(d)))
    dst = make_layout(kind, dtype)
    dst.scatter(torch.tensor(device_pages), host.tensor[1:6])
    for d in device_pages:
        assert torch.equal(bits(dst.read_page(d)), bits(src.read_page(d)))


def test_small_staging_windows_and_scattered_host_pages() -> None:
    layout, host, engine = setup(max_staging_bytes=2 * make_layout("layer_first").page_nbytes)
    owner = object()
    host.alloc(8, owner)
    host.free([6, 2, 3, 4, 0], owner)
    lc = Lifecycle("r", page_size=PAGE)
    ticket = chunk(lc, 5)
    host_pages = host.alloc(5, ticket)
    assert host_pages == [6, 2, 3, 4, 0]
    engine.submit(ticket, [7, 5, 3, 1, 0], host_pages)
    assert [a.ok for a in engine.drain()] == [True]
    for d, h in zip([7, 5, 3, 1, 0], host_pages, strict=True):
        assert torch.equal(bits(host.page(h)), bits(layout.read_page(d)))


def test_copy_waits_for_work_enqueued_before_submit() -> None:
    """Scenario: the runtime writes a page on the compute stream, then submits at once.

    The compute stream is kept busy first, so without ``wait_stream`` the side
    stream would copy the old contents.
    """
    layout, host, engine = setup()
    lc = Lifecycle("r", page_size=PAGE)
    ticket = chunk(lc, 1)
    pages = host.alloc(1, ticket)
    assert pages is not None
    new = torch.full((layout.page_numel,), 3.0, device="cuda")
    # keep the current stream busy (~0.1 s)
    torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]
    layout.write_page(2, new)  # enqueued on the current stream, behind the sleep
    engine.submit(ticket, [2], pages)
    (ack,) = engine.drain()
    assert ack.ok
    assert torch.equal(host.page(pages[0]), new.cpu())


def test_acks_in_order_and_poll_returns_each_once() -> None:
    _, host, engine = setup()
    lc = Lifecycle("r", page_size=PAGE)
    tickets = [chunk(lc, 1) for _ in range(4)]
    for i, t in enumerate(tickets):
        pages = host.alloc(1, t)
        assert pages is not None
        engine.submit(t, [i], pages)
    torch.cuda.synchronize()
    acks = engine.poll() + engine.drain()
    assert [a.ticket for a in acks] == tickets
    assert engine.poll() == [] and engine.inflight == 0
    for a in acks:
        a.owner.ack(a.ticket)
    assert lc.last_hash == tickets[-1][2][-1]


def test_refusals_change_nothing() -> None:
    _, host, engine = setup()
    lc = Lifecycle("r", page_size=PAGE)
    first = chunk(lc, 2)
    busy = host.alloc(2, first)
    assert busy == [0, 1]
    torch.cuda._sleep(100_000_000)  # type: ignore[no-untyped-call]
    engine.submit(first, [0, 1], busy)
    ticket = chunk(lc, 2)
    mine = host.alloc(2, ticket)
    assert mine == [2, 3]
    for dev, hst, error, why in (
        ([2], mine, EngineError, "pages but"),
        ([2, 8], mine, EngineError, "out of range"),
        ([3, 3], mine, EngineError, "appears twice"),
        ([2, 3], [2, 4], UnallocatedHostPage, "is free"),
        ([2, 3], [1, 2], PageBusy, "host page 1 is still being written"),
    ):
        inflight, used = engine.inflight, host.num_used
        with pytest.raises(error, match=why) as refused:
            engine.submit(ticket, dev, hst)
        assert type(refused.value) is error
        assert (engine.inflight, host.num_used) == (inflight, used)
    engine.drain()
    engine.close()
    with pytest.raises(EngineClosed):
        engine.submit(ticket, [2, 3], mine)
    assert engine.inflight == 0


def test_unpinned_host_and_cpu_layouts_are_refused() -> None:
    layout = make_layout("page_first")
    with pytest.raises(ConfigError):
        CudaCopyEngine(layout, HostPagePool(4, layout.page_numel, layout.dtype, pin_memory=False))
    cpu_layout = PageFirstLayout.zeros(2, 8, PAGE, 2, 4, dtype=torch.float32)
    with pytest.raises(ConfigError):
        CudaCopyEngine(cpu_layout, HostPagePool(4, cpu_layout.page_numel, torch.float32))


def test_engine_follows_the_protocol() -> None:
    _, _, engine = setup()
    assert isinstance(engine, CopyEngine)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_defect18_a_stream_on_another_device_is_refused() -> None:
    layout = make_layout("layer_first")
    host = HostPagePool(4, layout.page_numel, layout.dtype, pin_memory=True)
    other = torch.cuda.Stream(device="cuda:1")  # type: ignore[no-untyped-call]
    with pytest.raises(ConfigError):
        CudaCopyEngine(layout, host, stream=other)


def test_defect18_a_chunk_failing_part_way_is_acked_only_after_its_queued_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scenario: a chunk over max_staging_bytes copies its first window, then fails.

    The first window's write into the host pages is still queued behind a long
    kernel. submit() must not raise (the manager would free the host pages at
    once); the chunk is acked as failed when its event, recorded after the
    queued write, completes, and its host pages stay busy until then.
    """
    layout, host, engine = setup(max_staging_bytes=make_layout("layer_first").page_nbytes)
    real = layout.gather_runs

    def fails_after_first_window(*args: Any, **kwargs: Any) -> None:
        runs = args[2]
        real(args[0][:1], args[1], [(0, runs[0][1], 1)], **kwargs)  # one page enqueued ...
        raise torch.cuda.OutOfMemoryError("staging buffer")  # ... then the next one fails

    monkeypatch.setattr(layout, "gather_runs", fails_after_first_window)
    lc = Lifecycle("r", page_size=PAGE)
    ticket = chunk(lc, 2)
    pages = host.alloc(2, ticket)
    assert pages is not None
    torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(engine.stream):
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]
    engine.submit(ticket, [0, 1], pages)  # no exception: the failure comes as the ack
    assert engine.poll() == [] and engine.inflight == 1
    with pytest.raises(PageBusy, match="host page"):
        engine.check([2], [pages[0]])
    (ack,) = engine.drain()
    assert isinstance(ack.error, torch.cuda.OutOfMemoryError) and ack.host_pages == tuple(pages)
    assert engine.inflight == 0


# ---------------------------------------------------------------- loads (host -> device)


def load(lc: Lifecycle, n_pages: int) -> LoadTicket:
    return lc.load([f"key-{i}" for i in range(n_pages)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_store_then_load_into_other_device_pages_is_bit_exact(
    kind: str, dtype: torch.dtype
) -> None:
    layout, host, engine = setup(kind, dtype, max_staging_bytes=2 * make_layout(kind).page_nbytes)
    owner = object()
    host.alloc(8, owner)
    host.free([6, 2, 3, 4, 0], owner)  # host runs: 6 | 2 3 4 | 0
    lc = Lifecycle("r", page_size=PAGE)
    ticket = chunk(lc, 5)
    host_pages = host.alloc(5, ticket)
    assert host_pages == [6, 2, 3, 4, 0]
    stored_from = [7, 5, 3, 1, 0]
    engine.submit(ticket, stored_from, host_pages)
    (ack,) = engine.drain()
    lc.ack(ack.ticket)
    originals = {p: layout.read_page(p).clone() for p in range(8)}
    loaded_into = [2, 4, 6, 1, 3]
    ticket_in = load(lc, 5)
    engine.submit(ticket_in, loaded_into, host_pages)
    (ack,) = engine.drain()
    assert ack.ok and ack.is_load and ack.ticket is ticket_in
    lc.ack(ack.ticket)
    for s, d in zip(stored_from, loaded_into, strict=True):
        assert torch.equal(bits(layout.read_page(d)), bits(originals[s]))
    for p in set(range(8)) - set(loaded_into):
        assert torch.equal(bits(layout.read_page(p)), bits(originals[p]))


def test_load_is_ordered_after_work_enqueued_before_submit_and_before_reads_after_ack() -> None:
    """Scenario: the compute stream still writes a device page when a load into it is
    submitted; the load must land after that write, and a read enqueued on the compute
    stream after the ack must see the loaded bytes."""
    layout, host, engine = setup()
    lc = Lifecycle("r", page_size=PAGE)
    ticket = load(lc, 1)
    pages = host.alloc(1, ticket)
    assert pages is not None
    host.tensor[pages[0]] = 6.0
    torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]
    layout.write_page(2, torch.full((layout.page_numel,), 1.0, device="cuda"))  # behind sleep
    engine.submit(ticket, [2], pages)
    (ack,) = engine.drain()
    assert ack.ok
    seen = layout.read_page(2).sum()  # enqueued on the compute stream after the ack
    assert float(seen) == 6.0 * layout.page_numel


def test_load_refusals_change_nothing() -> None:
    layout, host, engine = setup()
    lc = Lifecycle("r", page_size=PAGE)
    first = load(lc, 2)
    busy = host.alloc(2, first)
    assert busy == [0, 1]
    torch.cuda._sleep(100_000_000)  # type: ignore[no-untyped-call]
    engine.submit(first, [0, 1], busy)
    ticket = load(lc, 2)
    mine = host.alloc(2, ticket)
    assert mine == [2, 3]
    before = {p: layout.read_page(p).clone() for p in range(2, 8)}  # not the in-flight load's
    for t, dev, hst, error, why in (
        (ticket, [2], mine, EngineError, "pages but"),
        (ticket, [1, 2], mine, PageBusy, "device page 1 is still being written"),
        (ticket, [2, 3], [2, 4], UnallocatedHostPage, "is free"),
        (
            chunk(Lifecycle("other", page_size=PAGE), 1),
            [0],
            [2],
            PageBusy,
            "device page 0 is still being written",
        ),  # a store may not read a page being loaded
    ):
        inflight, used = engine.inflight, host.num_used
        with pytest.raises(error, match=why) as refused:
            engine.submit(t, dev, hst)
        assert type(refused.value) is error
        assert (engine.inflight, host.num_used) == (inflight, used)
    engine.drain()
    assert all(torch.equal(bits(layout.read_page(p)), bits(v)) for p, v in before.items())
    engine.check([0, 1], mine, load=True)  # acked: free again


def test_a_load_failing_part_way_is_acked_only_after_its_queued_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout, host, engine = setup(max_staging_bytes=make_layout("layer_first").page_nbytes)
    real = layout.scatter_runs

    def fails_after_first_window(*args: Any, **kwargs: Any) -> None:
        runs = args[2]
        real(args[0][:1], args[1], [(0, runs[0][1], 1)], **kwargs)
        raise torch.cuda.OutOfMemoryError("staging buffer")

    monkeypatch.setattr(layout, "scatter_runs", fails_after_first_window)
    lc = Lifecycle("r", page_size=PAGE)
    ticket = load(lc, 2)
    pages = host.alloc(2, ticket)
    assert pages is not None
    with torch.cuda.stream(engine.stream):
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]
    engine.submit(ticket, [0, 1], pages)
    assert engine.poll() == [] and engine.inflight == 1
    with pytest.raises(PageBusy, match="device page 0"):
        engine.check([0], [pages[0]], load=True)
    (ack,) = engine.drain()
    assert isinstance(ack.error, torch.cuda.OutOfMemoryError) and ack.is_load
    assert engine.inflight == 0


class Record:
    """A host's record of one operation (as the vLLM worker's job is): not a Lifecycle."""

    def __init__(self, keys: tuple[str, ...], load: bool = False) -> None:
        self.ticket: Any = LoadTicket(self, 0, keys) if load else (self, 0, keys, 0)
        self.inflight = 1

    def ack(self, ticket: object) -> None:
        assert ticket is self.ticket and self.inflight == 1
        self.inflight = 0


@pytest.mark.parametrize("kind", KINDS)
def test_the_core_pipeline_stores_promotes_and_loads_a_host_records_pages(kind: str) -> None:
    """Scenario: kvlife/transfers.py over the CUDA engine, owners that are host records.
    A store goes ack, then store, then free; the stored bytes are the device pages' bits;
    promotion reads them back into a pinned host page and a load writes them into other
    device pages, bit-exact, and its ack drops the pin."""
    layout, host, engine = setup(kind, torch.bfloat16)
    refusals = Refusals()
    tier: HostTier[str] = HostTier(host, refusals=refusals, keep=False)
    store = MemoryStore()
    pipe = Transfers(engine, host, store, refusals=refusals, tier=tier)
    keys = ("a0", "b1", "c2")
    op = Record(keys)
    pages = host.alloc(3, owner=op)
    assert pages is not None
    originals = {p: bits(layout.read_page(p)).clone() for p in range(8)}
    pipe.submit(op.ticket, [6, 1, 4], pages)
    pipe.drain()
    assert op.inflight == 0 and host.num_used == 0 and pipe.idle
    for key, device in zip(keys, [6, 1, 4], strict=True):
        payload = store.get(key)
        assert payload == originals[device].view(torch.uint8).numpy().tobytes()
    loads = []
    for key, device in zip(keys, [0, 7, 2], strict=True):
        assert pipe.promote(key)
        entry = tier.entry(key)
        assert entry is not None
        load_op = Record((key,), load=True)
        pipe.submit(load_op.ticket, [device], [entry.page])
        loads.append(load_op)
    assert tier.counts.pinned == 3
    pipe.drain()
    assert all(op.inflight == 0 for op in loads) and tier.counts.pinned == 0
    for src, dst in zip([6, 1, 4], [0, 7, 2], strict=True):
        assert torch.equal(bits(layout.read_page(dst)), originals[src])
    assert (pipe.counts.pages_stored, pipe.counts.pages_loaded) == (3, 3)
    engine.close()
    store.close()
