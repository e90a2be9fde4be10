"""The manager's load half on real parts: a torch KV pool, the threaded CPU engine, a store.

A returning prompt's prefix is looked up and loaded back into fresh device pages, and the
loaded values are compared with what the first life's pages held, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvlife import FinishReason, State
from kvlife.engine.cpu import CpuCopyEngine
from kvlife.errors import EngineError, ManagerError
from kvlife.layout import LayerFirstLayout
from kvlife.manager import OffloadManager, OffloadRequest
from kvlife.pool import HostPagePool
from kvlife.store.directory import LocalDirectoryStore
from kvlife.store.memory import MemoryStore

PAGE = 4


class Rig:
    def __init__(self, store: object, *, keep_on_host: bool = False, delay: float = 0.0) -> None:
        self.layout = LayerFirstLayout.zeros(
            num_layers=2, num_pages=32, page_size=PAGE, num_heads=2, head_dim=4,
            dtype=torch.float32,
        )  # fmt: skip
        self.host = HostPagePool(8, self.layout.page_numel, torch.float32)
        self.engine = CpuCopyEngine(self.layout, self.host, copy_delay=delay)
        self.store = store
        self.manager = OffloadManager(
            self.engine,
            self.host,
            store,
            page_size=PAGE,
            keep_on_host=keep_on_host,  # type: ignore[arg-type]
        )
        self.released: list[OffloadRequest] = []

    def on_release(self, req: OffloadRequest, pages: object) -> None:
        self.released.append(req)

    def fill(self, pages: list[int], tag: int) -> list[torch.Tensor]:
        values = []
        for i, page in enumerate(pages):
            row = torch.arange(self.layout.page_numel, dtype=torch.float32) + tag * 1e4 + i * 1e2
            self.layout.write_page(page, row)
            values.append(row)
        return values

    def first_life(self, prompt: list[int], decoded: int) -> list[torch.Tensor]:
        """A life that offloads ``decoded`` tokens' pages after its prompt, then finishes."""
        m = self.manager
        req = m.start("r", prompt, self.on_release)
        tokens = prompt + list(range(1000, 1000 + decoded))
        n_pages = (len(tokens) + PAGE - 1) // PAGE
        pages = list(range(n_pages))
        values = self.fill(pages, tag=1)
        m.offload(req, [*tokens, 0], pages)
        m.finish(req)
        m.close()
        return values

    def close(self) -> None:
        self.manager.close()
        self.engine.close()


@pytest.fixture(params=["memory", "directory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[object]:
    s: object = MemoryStore() if request.param == "memory" else LocalDirectoryStore(tmp_path, "ns")
    yield s
    s.close()  # type: ignore[attr-defined]


def test_scenario_a_returning_prompt_loads_its_prefix_bit_for_bit(store: object) -> None:
    """Scenario: a conversation decodes 8 tokens past a 1-page prompt; its 2 offloaded pages
    are stored. It returns (a new life, the same rid) with a prompt that extends the first
    one: lookup finds 3 pages loadable, the load copies them into fresh device pages, and
    they hold exactly what the first life's pages held."""
    rig = Rig(store)
    prompt = [1, 2, 3, 4]
    # prompt page 0 came from the prefill side; store it as the prefill side would
    rig.manager.start("p", [], None)
    first = rig.first_life(prompt, 8)
    first_prompt_page = rig.layout.read_page(0).clone()
    rig.store.put(("prefill",), [rig.manager.lookup(prompt).keys[0]], first_prompt_page[None])  # type: ignore[attr-defined]
    rig.store.drain()  # type: ignore[attr-defined]
    returning = prompt + list(range(1000, 1008)) + [7]
    found = rig.manager.lookup(returning)
    assert (found.ready, found.pending) == (3, False)
    req = rig.manager.start("r", returning, rig.on_release)
    fresh = [20, 21, 22]
    ticket = rig.manager.load(req, fresh)
    assert ticket is not None and ticket.keys == found.keys[:3]
    assert req.loading and req.state is State.LOADING
    rig.manager.close()
    assert not req.loading and req.loaded_pages == 3 and req.state is State.IDLE
    assert torch.equal(rig.layout.read_page(20), first_prompt_page)
    for page, expected in zip(fresh[1:], first[1:3], strict=True):
        assert torch.equal(rig.layout.read_page(page), expected)
    m = rig.manager.metrics()
    assert (m.loads_started, m.pages_loaded, m.pages_promoted) == (1, 3, 3)
    assert rig.manager.tier.counts.pinned == 0 and rig.host.num_used == 0  # staging: freed
    rig.close()


def test_keep_on_host_serves_a_load_from_the_host_tier_without_the_store() -> None:
    store = MemoryStore()
    rig = Rig(store, keep_on_host=True)
    first = rig.first_life([], 8)
    assert rig.manager.tier.counts.entries == 2 and rig.host.num_used == 2  # kept, cached
    store.clear()  # the store lost everything: the host tier still has the pages
    returning = [*list(range(1000, 1008)), 5]
    assert rig.manager.lookup(returning).ready == 2
    req = rig.manager.start("r", returning, None)
    assert rig.manager.load(req, [30, 31]) is not None
    rig.manager.close()
    assert req.loaded_pages == 2 and rig.manager.metrics().pages_promoted == 0
    assert torch.equal(rig.layout.read_page(30), first[0])
    rig.close()
    store.close()


@pytest.mark.parametrize("reason", list(FinishReason))
def test_scenario_finish_during_a_load_releases_only_after_its_ack(reason: FinishReason) -> None:
    """Scenario: a request aborted (or retracted) while its load still writes its device
    pages (vllm-ascend #16662, LMCache #4939): its pages go back only after the load's ack."""
    store = MemoryStore()
    rig = Rig(store, keep_on_host=True, delay=0.2)
    rig.first_life([], 8)
    rig.released.clear()
    returning = [*list(range(1000, 1008)), 5]
    req = rig.manager.start("r", returning, rig.on_release)
    assert rig.manager.load(req, [30, 31]) is not None
    rig.manager.finish(req, reason)
    rig.manager.poll()
    assert rig.released == [] and req.state is State.FINISHED  # the load still writes
    assert rig.manager.tier.counts.pinned == 2  # and its host pages stay pinned
    rig.manager.close()
    assert rig.released == [req] and req.state is State.RELEASED
    assert rig.manager.tier.counts.pinned == 0
    rig.close()
    store.close()


def test_a_page_still_being_written_is_reported_pending_never_loaded() -> None:
    store = MemoryStore()
    rig = Rig(store, keep_on_host=True, delay=0.3)
    req = rig.manager.start("r", [], None)
    tokens = list(range(1000, 1008))
    rig.fill([0, 1], tag=1)
    rig.manager.offload(req, [*tokens, 0], [0, 1])  # the copy takes 0.3 s
    found = rig.manager.lookup([*tokens, 5])
    assert (found.ready, found.pending) == (0, True)
    other = rig.manager.start("o", [*tokens, 5], None)
    assert rig.manager.load(other, [30, 31]) is None  # nothing ready: nothing loaded
    assert other.state is State.IDLE
    rig.manager.close()
    assert rig.manager.lookup([*tokens, 5]) == (found.keys, 2, False)
    rig.close()
    store.close()


def test_a_damaged_store_page_is_a_miss_and_the_load_stops_before_it(tmp_path: Path) -> None:
    store = LocalDirectoryStore(tmp_path, "ns")
    rig = Rig(store)
    rig.first_life([], 8)
    returning = [*list(range(1000, 1008)), 5]
    keys = rig.manager.lookup(returning).keys
    victim = next(p for p in tmp_path.rglob("*") if p.is_file() and keys[1] in p.name)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert rig.manager.lookup(returning).ready == 1
    req = rig.manager.start("r", returning, None)
    ticket = rig.manager.load(req, [30, 31])
    assert ticket is not None and ticket.keys == keys[:1]
    rig.manager.close()
    assert req.loaded_pages == 1
    rig.close()
    store.close()


def test_a_refused_load_changes_nothing() -> None:
    store = MemoryStore()
    rig = Rig(store, keep_on_host=True)
    rig.first_life([], 8)
    req = rig.manager.start("r", [*list(range(1000, 1008)), 5], None)
    before = req.snapshot(), rig.manager.tier.counts, rig.host.num_used
    for bad in ([30], None, [30, 10_000]):
        with pytest.raises((ManagerError, EngineError)):
            rig.manager.load(req, bad)  # type: ignore[arg-type]
        assert (req.snapshot(), rig.manager.tier.counts, rig.host.num_used) == before
    rig.manager.finish(req)
    with pytest.raises(ManagerError, match="decoding has ended"):
        rig.manager.load(req, [30, 31])
    rig.close()
    store.close()


def test_a_full_host_pool_evicts_cached_pages_for_a_due_chunk() -> None:
    store = MemoryStore()
    rig = Rig(store, keep_on_host=True)
    for rid in range(5):  # 5 lives x 2 pages through an 8-page pool
        req = rig.manager.start(rid, [], None)
        tokens = list(range(rid * 100, rid * 100 + 8))
        rig.manager.offload(req, [*tokens, 0], [0, 1])
        rig.manager.finish(req)
        rig.manager.close()
        time.sleep(0)
    m = rig.manager.metrics()
    assert m.host_pool_exhausted == 0 and m.pages_stored == 10
    assert m.host_tier_evicted == 2 and rig.host.num_used == 8
    rig.close()
    store.close()


def test_scenario_two_requests_load_one_host_page_at_once() -> None:
    """Scenario (found by the kit's Return event): two returning conversations load the same
    prefix page while the first load is still in flight. Two reads of one host page do not
    conflict; the manager checked the load as if it were a store (the engine refused it,
    PageBusy, and the runtime saw an exception)."""
    store = MemoryStore()
    rig = Rig(store, keep_on_host=True, delay=0.2)
    first = rig.first_life([], 8)
    returning = [*range(1000, 1008), 5]
    a = rig.manager.start("a", returning, None)
    b = rig.manager.start("b", returning, None)
    assert rig.manager.load(a, [30, 31]) is not None
    assert rig.manager.load(b, [28, 29]) is not None  # the same host pages, read twice
    assert rig.manager.tier.counts.pinned == 4
    rig.manager.close()
    assert a.loaded_pages == b.loaded_pages == 2 and rig.manager.tier.counts.pinned == 0
    assert torch.equal(rig.layout.read_page(28), first[0])
    rig.close()
    store.close()
