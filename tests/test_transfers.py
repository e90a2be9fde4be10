"""The copy pipeline (kvlife/transfers.py) on real parts: a threaded CpuCopyEngine over real
torch KV buffers, a host page pool, a memory store and a host tier. Each host's owner here is
a small record, not a Lifecycle: the pipeline serves any owner with ``inflight`` and ``ack``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvlife import LoadTicket
from kvlife.engine import Ack, CpuCopyEngine
from kvlife.errors import CopyFault, DuplicateAck, EngineError, StoreError
from kvlife.host_tier import HostTier, Lookup
from kvlife.layout import LayerFirstLayout
from kvlife.pool import HostPagePool
from kvlife.refusals import Refusals
from kvlife.store import MemoryStore
from kvlife.transfers import TransferCounts, Transfers

PAGE = 2


class Op:
    """A host's record of one operation: one ticket, settled once."""

    def __init__(self, keys: tuple[str, ...], load: bool = False) -> None:
        self.ticket: Any = LoadTicket(self, 0, keys) if load else (self, 0, keys, 0)
        self.inflight = 1
        self.acked: list[Ack] = []

    def ack(self, ticket: object) -> None:
        if ticket is not self.ticket or not self.inflight:
            raise DuplicateAck("no copy in flight", event="ack", state=None, rid="op", ident=0)
        self.inflight = 0


@dataclass
class Rig:
    layout: LayerFirstLayout
    host: HostPagePool
    engine: CpuCopyEngine
    store: MemoryStore
    tier: HostTier[str]
    pipe: Transfers
    settled: list[tuple[object, Ack]]


@pytest.fixture
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    owns = getattr(request, "param", True)
    layout = LayerFirstLayout.zeros(2, 8, PAGE, 2, 4, dtype=torch.float32)
    for i, buf in enumerate(layout.buffers()):
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view_as(buf) + 1000 * i)
    host = HostPagePool(6, layout.page_numel, layout.dtype, pin_memory=False)
    engine = CpuCopyEngine(layout, host)
    store = MemoryStore()
    refusals = Refusals()
    tier: HostTier[str] = HostTier(host, refusals=refusals, keep=False)
    settled: list[tuple[object, Ack]] = []
    pipe = Transfers(
        engine,
        host,
        store,
        refusals=refusals,
        tier=tier,
        owns_pages=owns,
        acked=lambda owner, ack: settled.append((owner, ack)),
    )
    yield Rig(layout, host, engine, store, tier, pipe, settled)
    engine.close()
    store.close()


def snapshot(r: Rig) -> tuple[object, ...]:
    """Everything a refusal must leave as it was."""
    owners = tuple(id(r.host.owner_of(p)) for p in range(r.host.capacity))
    return (owners, r.engine.inflight, TransferCounts(**vars(r.pipe.counts)), len(r.tier))


def test_a_store_of_a_host_record_goes_ack_then_store_then_free(rig: Rig) -> None:
    """Scenario: a host's record (no Lifecycle) offloads two device pages. The ack reaches
    the record; the store gets the bytes under the keys; the host pages are freed after the
    store answered, never before; the counts say so by name."""
    op = Op(("a0", "b1"))
    pages = rig.host.alloc(2, owner=op)
    assert pages is not None
    rig.pipe.submit(op.ticket, [3, 5], pages)
    rig.pipe.drain()
    assert op.inflight == 0 and rig.settled[0][0] is op
    assert rig.host.num_used == 0 and rig.pipe.idle
    for key, device in (("a0", 3), ("b1", 5)):
        payload = rig.store.get(key)
        assert payload is not None
        assert payload == rig.layout.read_page(device).view(-1).view(torch.uint8).numpy().tobytes()
    c = rig.pipe.counts
    assert (c.chunks_acked, c.pages_offloaded, c.pages_stored, c.copy_failures) == (1, 2, 2, 0)


@pytest.mark.parametrize("rig", [False], indirect=True)
def test_pages_the_host_does_not_own_are_copied_for_the_store_and_never_freed(
    rig: Rig,
) -> None:
    """Scenario: the vLLM worker's case: the scheduler owns the host pages. The store gets
    a private copy taken at the ack (a later write to the page does not reach it), and the
    pipeline frees nothing."""
    scheduler = object()
    pages = rig.host.alloc(1, owner=scheduler)
    assert pages is not None
    op = Op(("cc",))
    gate = rig.engine.hold_next()
    rig.pipe.submit(op.ticket, [2], pages)
    gate.open()
    acks = rig.engine.drain()
    rig.pipe.apply_acks(acks)  # the put took its copy here
    expected = rig.host.tensor[pages[0]].clone()
    rig.host.tensor[pages[0]].fill_(-1.0)  # the scheduler reuses the page at once
    rig.pipe.drain()
    payload = rig.store.get("cc")
    assert payload == expected.view(torch.uint8).numpy().tobytes()
    assert rig.host.owned_by(scheduler) == pages


def test_a_duplicate_ack_is_a_counted_refusal_that_changes_nothing(rig: Rig) -> None:
    op = Op(("cc",))
    pages = rig.host.alloc(1, owner=op)
    assert pages is not None
    rig.pipe.submit(op.ticket, [1], pages)
    (ack,) = rig.engine.drain()
    rig.pipe.apply_acks([ack])
    rig.pipe.drain()
    before = snapshot(rig)
    rig.pipe.apply_acks([ack])  # the engine's ack again: its pages are no longer the op's
    assert snapshot(rig) == before
    assert rig.pipe.refusals.count("DuplicateAck") == 1


def test_an_ack_no_route_knows_is_refused_and_changes_nothing(rig: Rig) -> None:
    """A forged ack (an owner of no host of this pipeline) touches nothing."""
    rig.pipe._route = lambda owner: None
    op = Op(("cc",))
    before = snapshot(rig)
    rig.pipe.apply_acks([Ack(op.ticket, (1,), (0,))])
    assert snapshot(rig) == before and op.inflight == 1
    assert rig.pipe.refusals.count("ManagerError") == 1


def test_an_engine_that_fails_to_take_a_checked_chunk_settles_it_as_a_failed_copy(
    rig: Rig,
) -> None:
    """Scenario: the checks passed, then the engine breaks taking the chunk. The owner
    gets a failed ack, the host pages go back, and the error is raised to the host."""
    op = Op(("cc",))
    pages = rig.host.alloc(1, owner=op)
    assert pages is not None

    def broken(*args: object) -> object:
        raise RuntimeError("engine broke")

    rig.pipe.engine = type("Broken", (), {"submit": broken})()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="engine broke"):
        rig.pipe.submit(op.ticket, [1], pages)
    assert op.inflight == 0 and rig.host.num_used == 0
    ((owner, ack),) = rig.settled
    assert owner is op and isinstance(ack.error, CopyFault)
    assert rig.pipe.counts.copy_failures == 1


def test_an_engine_failing_to_take_a_chunk_its_owner_has_not_counted_settles_nothing(
    rig: Rig,
) -> None:
    """Scenario: a host that counts a ticket only once submit returns (the vLLM worker, the
    SGLang linker) hands a chunk to an engine that breaks taking it after its checks. The
    owner gets no ack for a ticket it never counted (before, it got a failed one: a bogus
    DuplicateAck refusal, then the engine's own error, which neither host catches, and the
    linker's host pages leaked); the host gets a CopyFault, an EngineError, made of the
    engine's error, for its refusal path, and nothing changed."""
    op = Op(("cc",))
    op.inflight = 0  # counted only after submit returns
    pages = rig.host.alloc(1, owner=op)
    assert pages is not None

    def broken(*args: object) -> object:
        raise RuntimeError("engine broke")

    before = snapshot(rig)
    rig.pipe.engine = type("Broken", (), {"submit": broken})()  # type: ignore[assignment]
    with pytest.raises(CopyFault, match="engine broke") as raised:
        rig.pipe.submit(op.ticket, [1], pages, checked=False)
    assert isinstance(raised.value, EngineError) and type(raised.value.__cause__) is RuntimeError
    assert snapshot(rig) == before and rig.settled == [] and op.inflight == 0
    assert rig.pipe.refusals.count("DuplicateAck") == 0 and rig.host.owned_by(op) == pages


def test_a_store_that_refuses_the_put_frees_the_pages_and_counts(rig: Rig) -> None:
    op = Op(("cc",))
    pages = rig.host.alloc(1, owner=op)
    assert pages is not None

    def refuse(*args: object) -> None:
        raise StoreError("refused")

    rig.store.put = refuse  # type: ignore[method-assign]
    rig.pipe.submit(op.ticket, [1], pages)
    rig.pipe.drain()
    assert rig.host.num_used == 0 and rig.pipe.counts.store_failures == 1
    assert rig.pipe.refusals.count("StoreError") == 1


def test_promotion_reads_verifies_and_pins_and_a_load_ack_unpins(rig: Rig) -> None:
    """Scenario: a page the store holds is promoted into the host tier (pinned), loaded
    into a device page, and the load's ack drops the pin; the bytes are the stored ones."""
    op = Op(("cc",))
    pages = rig.host.alloc(1, owner=op)
    assert pages is not None
    rig.pipe.submit(op.ticket, [4], pages)
    rig.pipe.drain()
    assert rig.pipe.promote("cc") and rig.tier.counts.pinned == 1
    entry = rig.tier.entry("cc")
    assert entry is not None
    load = Op(("cc",), load=True)
    rig.pipe.submit(load.ticket, [7], [entry.page])
    rig.pipe.drain()
    assert load.inflight == 0 and rig.tier.counts.pinned == 0
    assert torch.equal(rig.layout.read_page(7), rig.layout.read_page(4))
    assert rig.pipe.counts.pages_loaded == 1 and rig.pipe.counts.pages_promoted == 1


def test_a_bad_page_is_refused_before_the_full_tier_evicts_for_it(rig: Rig) -> None:
    """Scenario: the host tier is full of evictable entries and the store's page for the
    key asked is of another size. Promotion checks the bytes it read before it takes a
    page, so no entry is evicted for a page that cannot be used (before, one was)."""
    tier: HostTier[str] = HostTier(rig.host, refusals=rig.pipe.refusals, keep=True)
    pipe = Transfers(rig.engine, rig.host, rig.store, refusals=rig.pipe.refusals, tier=tier)
    held = [f"{i:02x}" for i in range(rig.host.capacity)]
    for key in held:
        assert tier.insert_ready(key, lambda page: True)
    rig.store.put("t", ["ee"], torch.zeros(1, 3, dtype=torch.float32))
    rig.store.drain()
    before = snapshot(rig)
    assert not pipe.promote("ee")
    assert all(tier.lookup(key) is Lookup.HIT for key in held)
    assert snapshot(rig) == before and tier.counts.evicted == 0


def test_a_page_of_another_size_or_a_store_that_cannot_answer_is_a_miss(rig: Rig) -> None:
    """Promotion verifies: a stored page of another size, or a read that fails, is a miss
    that leaves no entry, no pin and no page behind."""
    rig.store.put("t", ["dd"], torch.zeros(1, 3, dtype=torch.float32))
    rig.store.drain()
    before = snapshot(rig)
    assert rig.pipe.in_store("dd") and not rig.pipe.promote("dd")
    assert rig.tier.lookup("dd") is Lookup.MISS and snapshot(rig) == before

    def broken(key: str) -> bytes:
        raise StoreError("read failed")

    rig.store.get = broken  # type: ignore[method-assign]
    assert not rig.pipe.promote("dd") and snapshot(rig) == before


def test_a_chunk_the_engine_refuses_is_raised_and_its_pages_given_back(rig: Rig) -> None:
    op = Op(("cc",))
    pages = rig.host.alloc(1, owner=op)
    assert pages is not None
    before = snapshot(rig)
    with pytest.raises(EngineError):
        rig.pipe.submit(op.ticket, [99], pages)
    # the engine refused before it held anything: the failed ack settles the op's pages
    assert rig.engine.inflight == 0 and op.inflight == 0
    assert before[1] == 0 and rig.host.num_used == 0
