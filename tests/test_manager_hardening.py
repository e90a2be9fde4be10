"""Defects found by adversarial use of the manager, the Lifecycle and the pool (issue 13).

Each test is named after the defect it reproduces and fails on the code before
its fix. The whole state compared before and after a refusal includes the
request's device page table (``device_pages``), which ``snapshot()`` leaves out.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kvlife import ConfigError, KVLifeError, Lifecycle, State
from kvlife.engine.cpu import CpuCopyEngine
from kvlife.errors import HashingError, InvalidChunk, ManagerError, PoolError
from kvlife.hashing import sglang_page_hashes
from kvlife.layout import LayerFirstLayout
from kvlife.manager import OffloadManager, OffloadRequest
from kvlife.pool import HostPagePool
from kvlife.store.base import StoreResult
from kvlife.store.memory import MemoryStore
from kvlife.testing.scripted import ScriptedEngine as ScriptedCopyEngine

PAGE = 4

#: ``lifecycles_by_state`` once the one life of a test released.
ONE_RELEASED = {"IDLE": 0, "OFFLOADING": 0, "LOADING": 0, "FINISHED": 0, "RELEASED": 1}


def tokens_for(n: int, salt: int = 0) -> list[int]:
    return [(salt * 7919 + i) % 50_000 for i in range(n)]


class Parts:
    """A small runtime's real offload parts; ``close()`` checks nothing leaked."""

    def __init__(self, engine: Any = None, store: Any = None, host_pages: int = 16) -> None:
        self.layout = LayerFirstLayout.zeros(
            num_layers=2,
            num_pages=64,
            page_size=PAGE,
            num_heads=2,
            head_dim=4,
            dtype=torch.float32,
        )
        self.host = HostPagePool(host_pages, self.layout.page_numel, torch.float32)
        self.engine = engine or CpuCopyEngine(self.layout, self.host, copy_delay=0.01)
        self.store = store if store is not None else MemoryStore()
        self.manager = OffloadManager(self.engine, self.host, self.store, page_size=PAGE)
        self.released: list[tuple[OffloadRequest, tuple[int, ...]]] = []

    def on_release(self, lc: OffloadRequest, pages: Sequence[int]) -> None:
        self.released.append((lc, tuple(pages)))

    def whole_state(self, lc: OffloadRequest) -> tuple[object, ...]:
        m = self.manager.metrics().as_dict()
        return (lc.snapshot(), tuple(lc.device_pages), self.host.num_used, m)

    def close(self) -> None:
        self.manager.close(timeout=10)
        self.engine.close()
        self.store.close()


@pytest.fixture
def parts() -> Iterator[Parts]:
    p = Parts()
    yield p
    p.close()


# ---------------------------------------------------------------- defect 1


class _BrokenHasher:
    """A custom hasher with a bug: it raises something that is not a HashingError."""

    def __call__(self, tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
        if tokens:
            raise ZeroDivisionError("hasher bug")
        return sglang_page_hashes(tokens, page_size, prior)


def test_defect1_offload_frees_host_pages_on_any_exception_before_submit(parts: Parts) -> None:
    """Scenario: a hasher bug (or Ctrl-C) strikes between allocating host pages and submitting.

    The pages went back to the pool: the pool does not fill up with lost pages.
    """
    m = OffloadManager(
        CpuCopyEngine(parts.layout, parts.host),
        parts.host,
        MemoryStore(),
        page_size=PAGE,
        hasher=_BrokenHasher(),
    )
    lc = m.start("r", [], parts.on_release)
    for _ in range(parts.host.capacity + 1):  # more tries than the pool has pages
        with pytest.raises(ZeroDivisionError):
            m.offload(lc, tokens_for(PAGE + 1), [0, 1])
    assert parts.host.num_used == 0 and lc.inflight == 0
    m.finish(lc)
    m.close()
    m.engine.close()


def test_defect1_tokens_in_a_deque_are_offloaded(parts: Parts) -> None:
    """A deque has len() and indexing but no slicing: it is still an ordered sequence."""
    m = parts.manager
    lc = m.start("r", [], parts.on_release)
    ticket = m.offload(lc, deque(tokens_for(2 * PAGE + 1)), [0, 1, 2])
    assert ticket is not None and ticket[2] == tuple(
        sglang_page_hashes(tokens_for(2 * PAGE), PAGE, None)
    )


# ---------------------------------------------------------------- defect 2 and 6


def test_defect2_a_refused_offload_keeps_the_page_table(parts: Parts) -> None:
    m = parts.manager
    lc = m.start("r", [], parts.on_release)
    m.offload(lc, tokens_for(PAGE), [7])
    before = parts.whole_state(lc)
    with pytest.raises(ManagerError, match="device pages cannot hold"):
        m.offload(lc, tokens_for(3 * PAGE + 1), [8])  # one page cannot hold 12 tokens
    with pytest.raises(KVLifeError):
        m.offload(lc, tokens_for(PAGE + 1), [10_000])  # out of the device pool
    after = parts.whole_state(lc)
    assert after[:3] == before[:3]  # the Lifecycle, the page table, the host pool
    m.finish(lc)
    m.close()
    assert parts.released == [(lc, (7,))]


def test_defect6_a_page_table_shorter_than_the_offloaded_pages_is_refused(parts: Parts) -> None:
    m = parts.manager
    lc = m.start("r", [], parts.on_release)
    assert m.offload(lc, tokens_for(2 * PAGE + 1), [3, 4, 5]) is not None
    before = parts.whole_state(lc)
    with pytest.raises(ManagerError, match="device pages cannot hold"):
        m.offload(lc, tokens_for(2 * PAGE + 2), [])  # no chunk due, but 2 pages are offloaded
    assert parts.whole_state(lc)[:3] == before[:3]
    m.finish(lc)
    m.close()
    assert parts.released == [(lc, (3, 4, 5))]


# ---------------------------------------------------------------- defect 3


class _PollDrains(MemoryStore):
    """Polling waits for every put, so both results surely come back in one poll."""

    def poll(self) -> list[StoreResult]:
        return self.drain(5)


class _InterruptedAfterFree(HostPagePool):
    """Ctrl-C arrives right after one free returns (an interleaving no real part can force)."""

    armed = False

    def free(self, pages: Sequence[int], owner: object) -> None:
        super().free(pages, owner)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


def _scripted_parts(store: Any = None, host_cls: type[HostPagePool] = HostPagePool) -> Parts:
    p = Parts.__new__(Parts)
    p.layout = LayerFirstLayout.zeros(
        num_layers=2, num_pages=64, page_size=PAGE, num_heads=2, head_dim=4, dtype=torch.float32
    )
    p.host = host_cls(16, p.layout.page_numel, torch.float32)
    p.engine = ScriptedCopyEngine(p.layout, p.host)
    p.store = store if store is not None else MemoryStore()
    p.manager = OffloadManager(p.engine, p.host, p.store, page_size=PAGE)
    p.released = []
    return p


def test_defect3_an_exception_applying_a_store_result_drops_no_other(parts: Parts) -> None:
    """Scenario: two store results arrive in one poll; applying the first is interrupted.

    The second result stays with the manager and the next poll applies it: its
    host pages are freed and counted as stored.
    """
    p = _scripted_parts(_PollDrains(), _InterruptedAfterFree)
    m = p.manager
    a, b = m.start("a", [], p.on_release), m.start("b", [], p.on_release)
    m.offload(a, tokens_for(PAGE + 1, 1), [1])
    m.offload(b, tokens_for(PAGE + 1, 2), [2])
    for copy in p.engine.in_flight():
        p.engine.complete(copy)
    p.host.armed = True  # type: ignore[attr-defined]
    with pytest.raises(KeyboardInterrupt):
        m.poll()
    m.poll()
    assert p.host.num_used == 0
    assert m.metrics().pages_stored == 1  # b's; a's result was interrupted after its free
    p.close()


# ---------------------------------------------------------------- defect 4


def test_defect4_a_release_callback_raising_keyboardinterrupt_leaves_no_half_applied_ack() -> None:
    """Scenario: the last ack releases a finished request; its callback raises KeyboardInterrupt.

    The interrupt reaches the runtime, but the ack is whole: the chunk's host
    pages went to the store and are freed, and the counters agree.
    """
    p = _scripted_parts()
    m = p.manager

    def interrupted(lc: OffloadRequest, pages: Sequence[int]) -> None:
        raise KeyboardInterrupt

    lc = m.start("r", [], interrupted)
    m.offload(lc, tokens_for(PAGE + 1), [5])
    m.finish(lc)
    p.engine.complete(p.engine.in_flight()[0])
    with pytest.raises(KeyboardInterrupt):
        m.poll()
    assert lc.state is State.RELEASED
    p.close()
    metrics = m.metrics()
    assert p.host.num_used == 0 and metrics.pages_stored == 1 and metrics.chunks_in_flight == 0
    assert metrics.lifecycles_by_state == ONE_RELEASED
    assert p.store.contains(tokens_key(tokens_for(PAGE)))


def tokens_key(tokens: list[int]) -> str:
    return sglang_page_hashes(tokens, PAGE, None)[-1]


# ---------------------------------------------------------------- defect 5


def test_defect5_managers_sharing_an_engine_and_a_store_lose_no_ack(parts: Parts) -> None:
    """Scenario: two managers share one engine and one store; each polls only itself.

    An ack or a store result one manager's poll takes for the other's Lifecycle
    is handed over, never dropped: every life releases and no host page leaks.
    """
    one = parts.manager
    two = OffloadManager(parts.engine, parts.host, parts.store, page_size=PAGE)
    lives = []
    for i, m in enumerate((one, two, one, two)):
        lc = m.start(f"r{i}", [], parts.on_release)
        m.offload(lc, tokens_for(PAGE + 1, i), [i])
        m.finish(lc)
        lives.append(lc)
    deadline = time.monotonic() + 5
    while parts.engine.inflight:  # only one manager polls: it takes every ack, the other's too
        assert time.monotonic() < deadline, "copies did not complete"
        one.poll()
    assert two.metrics().chunks_acked == 0  # not applied yet: handed over, waiting in `two`
    two.close(timeout=5)
    one.close(timeout=5)
    assert all(lc.state is State.RELEASED for lc in lives)
    assert parts.host.num_used == 0 and len(parts.released) == 4
    assert one.metrics().refused_events == two.metrics().refused_events == {}
    assert one.metrics().pages_stored + two.metrics().pages_stored == 4


# ---------------------------------------------------------------- defect 7


def test_defect7_close_drains_work_a_release_callback_starts(parts: Parts) -> None:
    """Scenario: during close, a release callback admits the next request and offloads it."""
    m = parts.manager
    later: list[OffloadRequest] = []

    def admit_next(lc: OffloadRequest, pages: Sequence[int]) -> None:
        nxt = m.start("next", [], parts.on_release)
        m.offload(nxt, tokens_for(PAGE + 1, 9), [30])
        later.append(nxt)

    lc = m.start("r", [], admit_next)
    m.offload(lc, tokens_for(PAGE + 1), [1])
    m.finish(lc)
    m.close(timeout=10)
    assert later and later[0].inflight == 0
    assert parts.engine.inflight == 0 and parts.store.pending == 0
    assert m.metrics().chunks_in_flight == 0 and m.metrics().pages_stored == 2


# ---------------------------------------------------------------- defect 8


class _PollsFromAnotherThread:
    """A hasher during whose run a second thread polls the manager (a runtime's helper
    thread): the interleaving two threads can produce, forced."""

    def __init__(self) -> None:
        self.manager: OffloadManager | None = None
        self.errors: list[BaseException] = []

    def __call__(self, tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
        if tokens and self.manager is not None:
            helper = threading.Thread(target=self.poll, args=(self.manager,))
            helper.start()
            helper.join()
        return sglang_page_hashes(tokens, page_size, prior)

    def poll(self, manager: OffloadManager) -> None:
        try:
            manager.poll()
        except BaseException as exc:
            self.errors.append(exc)


def test_defect8_a_second_thread_is_refused_and_corrupts_nothing() -> None:
    """Scenario: a helper thread polls while the scheduler thread is inside offload.

    The first chunk's ack is ready; on the old code the poll applied it in the
    middle of the second chunk's submit and the request never released. The
    manager is bound to the thread that drives it: the helper's poll is
    refused loudly, before anything changes, and the request drains and
    releases once, with no gauge negative and no host page leaked.
    """
    p = _scripted_parts()
    hasher = _PollsFromAnotherThread()
    m = OffloadManager(p.engine, p.host, p.store, page_size=PAGE, hasher=hasher)
    lc = m.start("r", [], p.on_release)
    m.offload(lc, tokens_for(PAGE + 1), [0, 1])
    p.engine.complete(p.engine.in_flight()[0])
    hasher.manager = m
    m.offload(lc, tokens_for(2 * PAGE + 1), [0, 1])
    hasher.manager = None
    assert [type(e) for e in hasher.errors] == [ManagerError]
    assert "one thread" in str(hasher.errors[0])
    m.finish(lc)
    m.close(timeout=5)
    metrics = m.metrics()
    assert lc.state is State.RELEASED and lc.inflight == 0 and len(p.released) == 1
    assert metrics.lifecycles_by_state == ONE_RELEASED
    assert metrics.chunks_in_flight == 0 and p.host.num_used == 0
    assert metrics.refused_events == {"ManagerError": 1}


def test_defect8_a_manager_passes_to_another_thread_once_its_own_has_ended() -> None:
    p = _scripted_parts()
    m = p.manager
    started: list[OffloadRequest] = []
    worker = threading.Thread(target=lambda: started.append(m.start("r", [], p.on_release)))
    worker.start()
    worker.join()
    m.finish(started[0])  # the scheduler thread ended: this one takes over
    assert p.released == [(started[0], ())]


# ---------------------------------------------------------------- defect 15-17


@pytest.mark.parametrize("value", [True, 2.5, float("nan"), float("inf"), 0, -4, "4", None])
def test_defect15_page_size_and_stride_must_be_whole_numbers(parts: Parts, value: Any) -> None:
    for kwargs in ({"page_size": value}, {"page_size": PAGE, "stride": value}):
        if kwargs.get("stride", 0) is None:
            continue  # stride=None means one page
        with pytest.raises(ConfigError):
            OffloadManager(parts.engine, parts.host, parts.store, **kwargs)
    with pytest.raises(ConfigError):
        Lifecycle("r", page_size=value)


def test_defect15_numpy_integers_are_ints(parts: Parts) -> None:
    m = OffloadManager(
        parts.engine, parts.host, parts.store, page_size=np.int64(PAGE), stride=np.int32(2 * PAGE)
    )
    assert (m.page_size, m.stride) == (PAGE, 2 * PAGE)
    assert type(m.page_size) is int and type(m.stride) is int


def test_defect16_an_offload_refused_with_invalid_chunk_is_counted(parts: Parts) -> None:
    m = OffloadManager(
        parts.engine,
        parts.host,
        MemoryStore(),
        page_size=PAGE,
        hasher=lambda t, p, prior: [],  # a hasher giving no key: the Lifecycle refuses
    )
    lc = m.start("r", [], parts.on_release)
    with pytest.raises(InvalidChunk):
        m.offload(lc, tokens_for(PAGE + 1), [0])
    assert m.metrics().refused_events == {"InvalidChunk": 1}
    assert parts.host.num_used == 0


@pytest.mark.parametrize(
    "tokens", [None, (i for i in range(4)), {1, 2, 3, 4}, {1: 0, 2: 0, 3: 0, 4: 0}]
)
def test_defect17_lifecycle_submit_refuses_what_is_not_a_token_sequence(tokens: Any) -> None:
    lc = Lifecycle("r", page_size=PAGE)
    before = lc.snapshot()
    with pytest.raises(InvalidChunk):
        lc.submit(tokens)
    assert lc.snapshot() == before


def test_defect17_a_prior_hash_that_is_not_a_digest_is_typed(parts: Parts) -> None:
    with pytest.raises(HashingError):
        Lifecycle("r", page_size=PAGE, prior_hash=5)  # type: ignore[arg-type]
    with pytest.raises(ManagerError, match="cannot start rid='r'"):
        parts.manager.start("r", [], prior_hash=5)  # type: ignore[arg-type]
    with pytest.raises(ManagerError, match="cannot start rid='r'"):
        parts.manager.start("r", None)  # type: ignore[arg-type]
    assert parts.manager.metrics().lifecycles_started == 0


def test_defect17_offload_of_a_generator_is_typed_and_changes_nothing(parts: Parts) -> None:
    lc = parts.manager.start("r", [], parts.on_release)
    before = parts.whole_state(lc)
    with pytest.raises(ManagerError, match="must be sequences"):
        parts.manager.offload(lc, (t for t in tokens_for(PAGE + 1)), [0])  # type: ignore[arg-type]
    assert parts.whole_state(lc)[:3] == before[:3]


@pytest.mark.parametrize("kind", ["generator", "set"])
def test_defect17_pool_free_of_a_generator_or_set_is_typed(kind: str) -> None:
    pool = HostPagePool(4, 8, torch.float32)
    pages = pool.alloc(2, owner="a")
    assert pages is not None
    arg = (p for p in pages) if kind == "generator" else set(pages)
    with pytest.raises(PoolError, match="pages must be a sequence of ints"):
        pool.free(arg, owner="a")  # type: ignore[arg-type]
    assert pool.num_used == 2 and pool.owned_by("a") == sorted(pages)
