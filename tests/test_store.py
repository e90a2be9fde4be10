"""The storage tier on real threads, real files and real processes.

Every store is exercised through the protocol: put host pages, collect results
with poll/drain, read the bytes back. The directory store is also checked on
disk (file names, temporary files) and against a writer process killed with
SIGKILL in the middle of a page.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvlife.errors import ConfigError, DrainTimeout, KVLifeError
from kvlife.store import (
    InlineStore,
    InvalidPut,
    LocalDirectoryStore,
    MemoryStore,
    PageMismatch,
    Store,
    StoreClosed,
    StoreError,
    StoreResult,
    StoreStats,
)
from kvlife.store.base import Payload, QueuedStore, Written, frame_page, unframe_page
from kvlife.store.directory import PAGES_DIR
from kvlife.testing.faults import FaultyDirectoryStore, FaultyMemoryStore, FaultyStore

REPO = Path(__file__).resolve().parents[1]
KINDS = ["memory", "directory"]


def make_store(kind: str, tmp_path: Path, **kw: object) -> QueuedStore:
    """A fresh store of ``kind``; directory stores live under ``tmp_path/root``."""
    if kind == "memory":
        return MemoryStore(**kw)  # type: ignore[arg-type]
    return LocalDirectoryStore(tmp_path / "root", "model/rank0", **kw)  # type: ignore[arg-type]


def make_faulty(kind: str, tmp_path: Path, **kw: object) -> FaultyStore:
    """:func:`make_store`'s store with fault injection (``fail_rate``, ``seed``, ``fail_next``)."""
    if kind == "memory":
        return FaultyMemoryStore(**kw)
    return FaultyDirectoryStore(tmp_path / "root", "model/rank0", **kw)


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[QueuedStore]:
    s = make_store(request.param, tmp_path)
    yield s
    s.close()


@pytest.fixture(params=KINDS)
def faulty(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FaultyStore]:
    s = make_faulty(request.param, tmp_path)
    yield s
    s.close()


def key(i: int, salt: int = 0) -> str:
    """A distinct 64-hex-digit key, like a SHA-256 page hash."""
    return f"{salt:08x}{i:056x}"


def pages_of(
    n: int, numel: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, numel, generator=gen).to(dtype)
    return torch.randint(-100, 100, (n, numel), generator=gen).to(dtype)


def raw(page: torch.Tensor) -> bytes:
    """The bytes a page must be stored as (computed independently of the store)."""
    return bytes(page.contiguous().view(torch.uint8).tolist())


def disk_files(s: QueuedStore) -> list[str]:
    """Every file under a directory store's pages directory, relative names, sorted."""
    assert isinstance(s, LocalDirectoryStore)
    return sorted(str(p.relative_to(s.directory)) for p in s.directory.rglob("*") if p.is_file())


class Gate:
    """Holds a store's writer thread at the start of each put until opened."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()


class Gated(QueuedStore):
    """A real store (mixed in before it) whose writer waits for a gate before each put."""

    def __init__(self, gate: Gate, *args: object, **kw: object) -> None:
        self.gate = gate
        super().__init__(*args, **kw)  # type: ignore[arg-type]

    def _store_pages(
        self,
        keys: tuple[str, ...],
        pages: Sequence[Payload],
        kept: list[str] | None = None,
    ) -> Written:
        self.gate.entered.set()
        self.gate.opened.wait()
        return super()._store_pages(keys, pages, kept)  # type: ignore[safe-super]


class GatedMemoryStore(Gated, MemoryStore):
    """The real MemoryStore, gated."""


class GatedDirectoryStore(Gated, LocalDirectoryStore):
    """The real LocalDirectoryStore, gated."""


@pytest.fixture(params=KINDS)
def gated(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[QueuedStore, Gate]]:
    gate = Gate()
    s: QueuedStore
    if request.param == "memory":
        s = GatedMemoryStore(gate)
    else:
        s = GatedDirectoryStore(gate, tmp_path / "root", "gated")
    yield s, gate
    gate.opened.set()
    s.close()


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
def test_round_trip_keeps_every_byte(store: QueuedStore, dtype: torch.dtype) -> None:
    pages = pages_of(5, 48, dtype)
    keys = [key(i) for i in range(5)]
    store.put("chunk", keys, pages)
    assert store.drain() == [StoreResult("chunk", tuple(keys))]
    for i, k in enumerate(keys):
        stored = store.get(k)
        assert stored == raw(pages[i])
        back = torch.frombuffer(bytearray(stored), dtype=dtype)
        assert torch.equal(back.view(torch.uint8), pages[i].view(torch.uint8))
        assert store.contains(k)
    assert sorted(store.keys()) == sorted(keys)
    assert store.pending == 0
    assert store.stats() == StoreStats(
        puts_ok=1, pages_written=5, bytes_written=5 * 48 * pages.element_size()
    )


def test_non_contiguous_pages_store_each_row(store: QueuedStore) -> None:
    base = pages_of(16, 6)
    pages = base.t()[:, ::2]  # [6, 8], rows are strided
    assert not pages.is_contiguous()
    keys = [key(i) for i in range(6)]
    store.put(None, keys, pages)
    assert store.drain()[0].ok
    assert [store.get(k) for k in keys] == [raw(pages[i]) for i in range(6)]


def test_stores_follow_the_protocol(store: QueuedStore) -> None:
    assert isinstance(store, Store)
    assert store.get(key(1)) is None
    assert not store.contains(key(1))
    assert list(store.keys()) == []


# ----------------------------------------------------------------------------- asynchrony


def test_put_returns_before_the_writer_stores(gated: tuple[QueuedStore, Gate]) -> None:
    """Scenario: the writer is busy; put returns, nothing is visible, poll is empty."""
    s, gate = gated
    pages = pages_of(2)
    s.put("t", [key(1), key(2)], pages)
    gate.entered.wait()
    # The writer holds the put: not visible, not reported, but pending.
    assert s.poll() == []
    assert s.pending == 1
    assert not s.contains(key(1))
    assert s.get(key(2)) is None
    # Opening the gate lets it finish; drain reports it exactly once.
    gate.opened.set()
    assert s.drain() == [StoreResult("t", (key(1), key(2)))]
    assert s.pending == 0
    assert s.poll() == []
    assert s.get(key(2)) == raw(pages[1])


def test_writer_reads_pages_lazily_and_never_after_the_result(
    gated: tuple[QueuedStore, Gate],
) -> None:
    """Scenario: the caller changes its host pages before and after the result.

    Before the result the pages still belong to the store (it reads them late);
    after it, changing them must not change what is stored.
    """
    s, gate = gated
    pages = torch.zeros(1, 32, dtype=torch.bfloat16)
    s.put("t", [key(7)], pages)
    gate.entered.wait()
    pages.fill_(3.0)  # still owned by the store: it may read these bytes
    gate.opened.set()
    (result,) = s.drain()
    assert result.ok
    assert s.get(key(7)) == raw(torch.full((32,), 3.0, dtype=torch.bfloat16))
    pages.fill_(-1.0)  # freed by the caller after the result: stored bytes stay
    assert s.get(key(7)) == raw(torch.full((32,), 3.0, dtype=torch.bfloat16))


def test_drain_timeout_consumes_nothing(gated: tuple[QueuedStore, Gate]) -> None:
    s, gate = gated
    s.put("first", [key(1)], pages_of(1))
    gate.entered.wait()
    with pytest.raises(DrainTimeout):
        s.drain(timeout=0.01)
    assert s.pending == 1
    gate.opened.set()
    assert [r.token for r in s.drain()] == ["first"]


def test_results_arrive_once_in_put_order_through_poll(store: QueuedStore) -> None:
    n = 40
    for i in range(n):
        store.put(i, [key(i)], pages_of(1, 16, seed=i))
    seen: list[StoreResult] = []
    while len(seen) < n:
        got = store.poll()
        seen += got
        if not got:
            seen += store.drain(timeout=60)
    assert [r.token for r in seen] == list(range(n))
    assert all(r.ok and r.keys == (key(r.token),) for r in seen)  # type: ignore[arg-type]
    assert store.pending == 0
    assert store.poll() == [] and store.drain() == []


def test_close_finishes_queued_puts_and_refuses_new_ones(store: QueuedStore) -> None:
    for i in range(5):
        store.put(i, [key(i)], pages_of(1, seed=i))
    store.close()
    store.close()  # idempotent
    assert store.closed
    assert [r.token for r in store.poll()] == [0, 1, 2, 3, 4]
    with pytest.raises(StoreClosed):
        store.put(9, [key(9)], pages_of(1))
    assert store.pending == 0
    assert sorted(store.keys()) == [key(i) for i in range(5)]


# ----------------------------------------------------------------------------- refusals


BAD_KEY = "is not 2 to 128 lowercase hex digits"

BAD_PUTS: list[tuple[str, Callable[[], tuple[object, object]], str]] = [
    ("fewer keys than pages", lambda: ([key(1)], pages_of(2)), "one key per page"),
    ("more keys than pages", lambda: ([key(1), key(2)], pages_of(1)), "one key per page"),
    ("uppercase key", lambda: (["ABCD"], pages_of(1)), BAD_KEY),
    ("key with a separator", lambda: (["ab/cd"], pages_of(1)), BAD_KEY),
    ("key that climbs", lambda: (["../ab"], pages_of(1)), BAD_KEY),
    ("key too short", lambda: (["a"], pages_of(1)), BAD_KEY),
    ("key too long", lambda: (["a" * 129], pages_of(1)), BAD_KEY),
    ("key not a str", lambda: ([1234], pages_of(1)), BAD_KEY),
    ("keys as one string", lambda: ("abcd", pages_of(4)), "not one string"),
    ("duplicate key", lambda: ([key(1), key(1)], pages_of(2)), "appears twice"),
    ("no pages", lambda: ([], pages_of(0)), "at least one page"),
    ("1-D pages", lambda: ([key(1)], torch.zeros(8)), "must be 2-D"),
    ("3-D pages", lambda: ([key(1)], torch.zeros(1, 2, 4)), "must be 2-D"),
    ("empty pages", lambda: ([key(1)], torch.zeros(1, 0)), "must not be empty"),
    ("not a tensor", lambda: ([key(1)], [[1.0, 2.0]]), "must be a torch.Tensor"),
    ("not host memory", lambda: ([key(1)], torch.zeros(1, 4, device="meta")), "dense host"),
    # Lazily conjugated: its bytes are not what it shows; the writer could not view them
    # (before, the put was accepted and its result an untyped RuntimeError).
    ("conjugate bit", lambda: ([key(1)], torch.ones(1, 4, dtype=torch.complex64).conj()), "own"),
    ("a conjugate page", lambda: ([key(1)], [torch.ones(4, dtype=torch.complex64).conj()]), "own"),
]


def injected(error: BaseException | None) -> bool:
    """Whether ``error`` is the StoreError a store's fault injection made."""
    return type(error) is StoreError and "injected" in str(error)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("why", "make", "match"), BAD_PUTS, ids=[b[0] for b in BAD_PUTS])
def test_refused_put_changes_nothing(
    tmp_path: Path,
    kind: str,
    why: str,
    make: Callable[[], tuple[object, object]],
    match: str,
) -> None:
    with make_faulty(kind, tmp_path) as s:
        s.put("before", [key(100)], pages_of(1))
        s.drain()
        s.fail_next(1)
        before = (s.stats(), sorted(s.keys()), s.pending)
        files = disk_files(s) if kind == "directory" else []
        keys, pages = make()
        with pytest.raises(InvalidPut, match=match) as info:
            s.put("bad", keys, pages)  # type: ignore[arg-type]
        assert type(info.value) is InvalidPut and isinstance(info.value, ValueError)
        assert (s.stats(), sorted(s.keys()), s.pending) == before
        assert s.poll() == []
        if kind == "directory":
            assert disk_files(s) == files
        # The injected fault was not consumed by the refused put: the next put takes it.
        s.put("next", [key(101)], pages_of(1))
        (result,) = s.drain()
        assert injected(result.error)


@pytest.mark.parametrize("kind", KINDS)
def test_refused_puts_draw_no_faults(tmp_path: Path, kind: str) -> None:
    """Two stores with one seed agree on which puts fail, whatever refusals come between."""
    a = make_faulty(kind, tmp_path / "a", fail_rate=0.5, seed=7)
    b = make_faulty(kind, tmp_path / "b", fail_rate=0.5, seed=7)
    with a, b:
        for i in range(30):
            a.put(i, [key(i)], pages_of(1))
            with pytest.raises(InvalidPut):
                b.put("bad", [key(i)], pages_of(2))
            b.put(i, [key(i)], pages_of(1))
        assert [r.ok for r in a.drain()] == [r.ok for r in b.drain()]
        assert 0 < a.stats().puts_failed < 30


def test_bad_keys_are_refused_on_reads_too(store: QueuedStore) -> None:
    for bad in ["../etc", "AB", "", "x" * 3]:
        with pytest.raises(InvalidPut, match=BAD_KEY):
            store.get(bad)
        with pytest.raises(InvalidPut, match=BAD_KEY):
            store.contains(bad)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_fault_settings_are_refused(tmp_path: Path, kind: str) -> None:
    for rate in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError):
            make_faulty(kind, tmp_path, fail_rate=rate)
    with make_faulty(kind, tmp_path) as s:
        for n in (-1, 1.5, True):
            with pytest.raises(ConfigError):
                s.fail_next(n)  # type: ignore[arg-type]
        s.put(0, [key(0)], pages_of(1))
        assert s.drain()[0].ok  # no fault was recorded by the refusals


# ----------------------------------------------------------------------------- failures


def test_fail_next_fails_exactly_that_many_puts(faulty: FaultyStore) -> None:
    store = faulty
    store.fail_next(2)
    for i in range(4):
        store.put(i, [key(i)], pages_of(1, seed=i))
    results = store.drain()
    assert [r.ok for r in results] == [False, False, True, True]
    assert all(injected(r.error) for r in results[:2])
    assert sorted(store.keys()) == [key(2), key(3)]
    assert store.stats().puts_failed == 2 and store.stats().puts_ok == 2


class GatedFaultyStore(Gated, FaultyMemoryStore):
    """The faulty MemoryStore, gated."""


def test_fault_settings_apply_to_the_puts_accepted_after_them() -> None:
    """fail_next and fail_rate are decided at put: a put accepted before the call keeps
    its outcome even while the writer has not started it."""
    gate = Gate()
    with GatedFaultyStore(gate) as s:
        s.put("writing", [key(0)], pages_of(1))
        assert gate.entered.wait(10)
        s.put("queued", [key(1)], pages_of(1))
        s.fail_next(1)
        s.put("failed", [key(2)], pages_of(1))
        s.fail_rate = 1.0
        s.put("failed too", [key(3)], pages_of(1))
        s.fail_rate = 0.0
        s.put("after", [key(4)], pages_of(1))
        gate.opened.set()
        results = {r.token: r for r in s.drain()}
        assert [results[t].ok for t in ("writing", "queued", "failed", "failed too", "after")] == [
            True,
            True,
            False,
            False,
            True,
        ]
        assert injected(results["failed"].error) and injected(results["failed too"].error)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_put_leaves_none_of_its_pages(tmp_path: Path, kind: str) -> None:
    """Scenario: every put fails, at every internal step (temporary writes and renames).

    Each put has four pages, one of which was already stored with the same bytes.
    After each failure exactly the page stored before remains, byte for byte, and
    the directory holds no temporary file.
    """
    with make_faulty(kind, tmp_path, seed=3) as s:
        shared = pages_of(1, seed=99)
        s.put("shared", [key(0, salt=9)], shared)
        assert s.drain()[0].ok
        s.fail_rate = 1.0
        files = disk_files(s) if kind == "directory" else []
        messages = set()
        for p in range(60):
            keys = [key(3 * p + j, salt=1) for j in range(3)]
            own = pages_of(3, seed=p)
            pages = torch.cat([own[:2], shared, own[2:]])
            s.put(p, [*keys[:2], key(0, salt=9), keys[2]], pages)
            (result,) = s.drain()
            assert injected(result.error)
            messages.add(str(result.error))
            assert list(s.keys()) == [key(0, salt=9)]
            assert s.get(key(0, salt=9)) == raw(shared[0])
            if kind == "directory":
                assert disk_files(s) == files
        # The seeded draws reached every step, so every rollback path ran.
        if kind == "directory":
            expected = {
                f"injected failure before {what} page {i} (4 pages)"
                for what in ("writing", "linking")
                for i in range(4)
            }
        else:
            expected = {f"injected failure before page {i} (4 pages)" for i in range(4)}
            expected.add("injected failure before committing (4 pages)")
        assert messages == expected
        assert s.stats().puts_failed == 60 and s.stats().pages_written == 1


def test_failed_put_keeps_pages_that_were_stored_before(tmp_path: Path) -> None:
    """A failed put removes only the pages it created, never a page already stored."""
    with FaultyDirectoryStore(tmp_path, "ns", fail_rate=1.0, seed=1) as s:
        s.fail_next(0)
        old = pages_of(1, seed=5)
        # Store the old page with fault injection off: use a second store on the same files.
        with LocalDirectoryStore(tmp_path, "ns") as writer:
            writer.put(0, [key(5)], old)
            assert writer.drain()[0].ok
        for p in range(30):
            s.put(p, [key(50 + p), key(5)], torch.cat([pages_of(1, seed=p), old]))
            assert not s.drain()[0].ok
            assert list(s.keys()) == [key(5)]
            assert s.get(key(5)) == raw(old[0])


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_failures_all_or_nothing_per_put(tmp_path: Path, kind: str) -> None:
    with make_faulty(kind, tmp_path, fail_rate=0.4, seed=11) as s:
        expected: dict[str, bytes] = {}
        outcomes = {}
        for p in range(40):
            keys = [key(4 * p + j) for j in range(4)]
            pages = pages_of(4, 16, torch.bfloat16, seed=p)
            s.put((p, keys, pages), keys, pages)
        for r in s.drain():
            p, keys, pages = r.token  # type: ignore[misc]
            outcomes[p] = r.ok
            if r.ok:
                expected.update({k: raw(pages[j]) for j, k in enumerate(keys)})
        assert 0 < sum(outcomes.values()) < 40
        assert sorted(s.keys()) == sorted(expected)
        assert all(s.get(k) == v for k, v in expected.items())
        if kind == "directory":
            assert not [f for f in disk_files(s) if f.endswith(".tmp")]


def test_real_io_error_rolls_back_the_whole_put(tmp_path: Path) -> None:
    """Scenario: the second page's directory cannot be made (a file is in its way)."""
    with LocalDirectoryStore(tmp_path, "ns") as s:
        (s.directory / "cd").write_bytes(b"not a directory")
        keys = ["ab" + "0" * 62, "cd" + "0" * 62]
        s.put("t", keys, pages_of(2))
        (result,) = s.drain()
        assert isinstance(result.error, OSError)
        assert list(s.keys()) == []
        assert disk_files(s) == ["cd"]
        assert s.stats().puts_failed == 1


@pytest.mark.parametrize("kind", KINDS)
def test_same_key_other_bytes_is_a_mismatch_and_keeps_the_stored_page(
    tmp_path: Path, kind: str
) -> None:
    with make_store(kind, tmp_path) as s:
        first = pages_of(1, seed=1)
        s.put("first", [key(1)], first)
        s.put("same", [key(1)], first.clone())
        assert [r.ok for r in s.drain()] == [True, True]
        assert s.stats().pages_deduplicated == 1 and s.stats().pages_written == 1
        # Other bytes under the stored key, in a chunk with a new key.
        s.put("other", [key(2), key(1)], pages_of(2, seed=2))
        (result,) = s.drain()
        assert isinstance(result.error, PageMismatch) and result.error.key == key(1)
        assert s.get(key(1)) == raw(first[0])
        assert not s.contains(key(2))
        assert s.stats().page_mismatches == 1
        if kind == "directory":
            assert disk_files(s) == [str(Path(key(1)[:2]) / f"{key(1)}.page")]


# ----------------------------------------------------------------------------- directory layout


def test_namespaces_isolate_keys(tmp_path: Path) -> None:
    a = LocalDirectoryStore(tmp_path, "llama-7b/rank0")
    b = LocalDirectoryStore(tmp_path, "llama-7b/rank1")
    c = LocalDirectoryStore(tmp_path, "llama-7b")
    with a, b, c:
        pa, pb = pages_of(1, seed=1), pages_of(1, seed=2)
        a.put("a", [key(1)], pa)
        b.put("b", [key(1)], pb)  # same key, other bytes: no mismatch across namespaces
        assert a.drain()[0].ok and b.drain()[0].ok
        assert a.get(key(1)) == raw(pa[0]) and b.get(key(1)) == raw(pb[0])
        assert not c.contains(key(1)) and list(c.keys()) == []
        assert a.path(key(1)) == (
            tmp_path / "llama-7b" / "rank0" / "@pages" / key(1)[:2] / f"{key(1)}.page"
        )
        # A fresh store on the same namespace sees the stored pages.
        with LocalDirectoryStore(tmp_path, "llama-7b/rank0") as again:
            assert list(again.keys()) == [key(1)]
            assert again.get(key(1)) == raw(pa[0])


@pytest.mark.parametrize(
    "namespace",
    ["", "/abs", "a/../b", "..", "a//b", "a/", ".hidden", "a\\b", "@pages", "c:x", "a b", 3],
)
def test_unsafe_namespaces_are_refused_before_touching_disk(
    tmp_path: Path, namespace: object
) -> None:
    root = tmp_path / "root"
    with pytest.raises(ConfigError, match="namespace"):
        LocalDirectoryStore(root, namespace)  # type: ignore[arg-type]
    assert not root.exists()


def test_keys_lists_exactly_the_stored_pages(tmp_path: Path) -> None:
    with LocalDirectoryStore(tmp_path, "ns") as s:
        stored = set()
        for p in range(10):
            keys = [f"{(p * 7 + j) * 2654435761 % 2**64:016x}" for j in range(5)]
            s.put(p, keys, pages_of(5, 8, seed=p))
            stored.update(keys)
        assert all(r.ok for r in s.drain())
        # Things in the directory that are not pages: a live writer's temporary file,
        # a stray file, a page file in the wrong shard, a directory named like a page.
        shard = s.directory / "ab"
        shard.mkdir(exist_ok=True)
        live_temp = shard / f".{'ab' * 8}.{os.getpid()}.0123abcd.tmp"
        live_temp.write_bytes(b"half")
        (s.directory / "README").write_text("not a page")
        (shard / f"{'cd' * 8}.page").write_bytes(b"misplaced")
        (shard / f"{'ab' * 9}.page").mkdir()
        assert sorted(s.keys()) == sorted(stored)
        assert not s.contains("ab" * 8)
        assert s.get("ab" * 8) is None
        assert s.clean_stale_temps() == 0  # its writer (this process) is alive
        assert live_temp.exists()


def test_opening_a_store_removes_temporaries_of_dead_writers(tmp_path: Path) -> None:
    with LocalDirectoryStore(tmp_path, "ns") as s:
        directory = s.directory
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    shard = directory / "ef"
    shard.mkdir()
    stale = shard / f".{'ef' * 32}.{dead.pid}.0badcafe.tmp"
    stale.write_bytes(b"partial")
    with LocalDirectoryStore(tmp_path, "ns") as fresh:
        assert not stale.exists()
        assert list(fresh.keys()) == []


@pytest.mark.parametrize("fsync", [False, True])
def test_fsync_writes_the_same_pages(tmp_path: Path, fsync: bool) -> None:
    with LocalDirectoryStore(tmp_path, "ns", fsync=fsync) as s:
        pages = pages_of(3, 32, torch.float16)
        s.put("t", [key(i) for i in range(3)], pages)
        assert s.drain()[0].ok
        assert [s.get(key(i)) for i in range(3)] == [raw(pages[i]) for i in range(3)]
        assert not [f for f in disk_files(s) if f.endswith(".tmp")]


# ----------------------------------------------------------------------------- killed writers

# A writer process whose store writes half of the second put's page, flushes it to
# the temporary file, says so, and then waits (for the SIGKILL that will come).
HALF_WRITER = textwrap.dedent(
    """
    import sys, torch
    from kvlife.store import LocalDirectoryStore

    class HalfWriter(LocalDirectoryStore):
        armed = False
        def _write_page(self, file, page):
            if not self.armed:
                return super()._write_page(file, page)
            file.write(page[: len(page) // 2])
            file.flush()
            print("HALF", flush=True)
            sys.stdin.read()  # blocks until killed

    root, whole_key, cut_key = sys.argv[1:4]
    store = HalfWriter(root, "model/rank0")
    page = torch.arange(1 << 16, dtype=torch.float32).reshape(1, -1)
    store.put("whole", [whole_key], page)
    assert store.drain()[0].ok
    print("WHOLE", flush=True)
    store.armed = True
    store.put("cut", [cut_key], page + 1)
    store.drain()
    """
)


def test_writer_killed_mid_page_leaves_no_partial_page(tmp_path: Path) -> None:
    """Scenario: a writer process is SIGKILLed with half a page written.

    A fresh store sees the page written before the kill complete, does not see
    the half-written page under its key, and removes the dead writer's temporary.
    """
    whole, cut = key(1), key(2)
    proc = subprocess.Popen(
        [sys.executable, "-c", HALF_WRITER, str(tmp_path), whole, cut],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "WHOLE"
        assert proc.stdout.readline().strip() == "HALF"
        # The half page is on disk, in a temporary file only.
        pages_dir = tmp_path / "model" / "rank0" / "@pages"
        temps = list(pages_dir.rglob("*.tmp"))
        header = len(frame_page(cut, b"", "model/rank0"))
        assert len(temps) == 1 and temps[0].stat().st_size == header + (1 << 16) * 4 // 2
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with LocalDirectoryStore(tmp_path, "model/rank0") as fresh:
        assert not fresh.contains(cut)
        assert fresh.get(cut) is None
        assert list(fresh.keys()) == [whole]
        expected = torch.arange(1 << 16, dtype=torch.float32)
        assert fresh.get(whole) == raw(expected)
        assert list(pages_dir.rglob("*.tmp")) == []


# A writer process that stores big multi-page puts as fast as it can; page j of
# put i is filled with the float value i * 8 + j, so every page's bytes are known.
BUSY_WRITER = textwrap.dedent(
    """
    import sys, torch
    from kvlife.store import LocalDirectoryStore

    store = LocalDirectoryStore(sys.argv[1], "busy")
    numel = 1 << 16  # 256 KiB pages
    for i in range(64):
        keys = [f"{i:08x}{j:056x}" for j in range(8)]
        pages = (torch.arange(8, dtype=torch.float32) + i * 8).unsqueeze(1).expand(8, numel)
        store.put(i, keys, pages.contiguous())
        assert store.drain()[0].ok
        if i == 0:
            print("STORED", flush=True)
    """
)


def test_writer_killed_at_any_moment_leaves_only_whole_pages(tmp_path: Path) -> None:
    """Scenario: a busy writer process is SIGKILLed wherever it happens to be.

    Every page a fresh store sees holds exactly the bytes its key was written with.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY_WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "STORED"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    with LocalDirectoryStore(tmp_path, "busy") as fresh:
        keys = sorted(fresh.keys())
        assert len(keys) >= 8
        for k in keys:
            i, j = int(k[:8], 16), int(k[8:], 16)
            value = torch.tensor([i * 8 + j], dtype=torch.float32)
            assert fresh.get(k) == raw(value) * (1 << 16), k
        assert list(fresh.directory.rglob("*.tmp")) == []


# ----------------------------------------------------------------------------- hardening (issue 13)


def tree(path: Path) -> dict[str, bytes | None]:
    """Everything under ``path``: each file's bytes, None for a directory."""
    return {
        str(p.relative_to(path)): (None if p.is_dir() else p.read_bytes())
        for p in sorted(path.rglob("*"))
    }


# Ways a stored page file can be damaged: (its bytes, another key's whole page file) -> new bytes.
DAMAGES: dict[str, Callable[[bytes, bytes], bytes]] = {
    "truncated_to_5_bytes": lambda data, other: data[:5],
    "cut_in_the_payload": lambda data, other: data[:-1],
    "emptied": lambda data, other: b"",
    "extended": lambda data, other: data + b"\0",
    "bit_flipped_in_the_payload": lambda data, other: (
        data[:-3] + bytes([data[-3] ^ 0x10]) + data[-2:]
    ),
    "another_keys_page": lambda data, other: other,
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_defect9_truncated_page_is_a_miss_and_repaired_by_next_put(
    tmp_path: Path, damage: str
) -> None:
    """Scenario: a stored 32-byte page file is damaged behind the store's back.

    The page is never served (get None, contains False; also for a fresh store,
    i.e. another process), each bad read is counted, and the next put of the
    correct page replaces it.
    """
    page, other = pages_of(1, 8, seed=1), pages_of(1, 8, seed=2)  # 32-byte payloads
    with LocalDirectoryStore(tmp_path, "ns") as s:
        s.put("first", [key(1), key(2)], torch.cat([page, other]))
        assert s.drain()[0].ok
        file = s.path(key(1))
        file.write_bytes(DAMAGES[damage](file.read_bytes(), s.path(key(2)).read_bytes()))
        assert s.get(key(1)) is None
        assert not s.contains(key(1))
        assert s.get(key(2)) == raw(other[0])  # the other page is untouched
        assert s.stats().pages_corrupt == 2
        with LocalDirectoryStore(tmp_path, "ns") as fresh:
            assert fresh.get(key(1)) is None and fresh.stats().pages_corrupt == 1
        # The correct page repairs it (not a PageMismatch).
        s.put("repair", [key(1)], page)
        (result,) = s.drain()
        assert result.ok, result.error
        assert s.get(key(1)) == raw(page[0]) and s.contains(key(1))
        assert s.stats() == StoreStats(
            puts_ok=2, pages_written=3, bytes_written=3 * 32, pages_corrupt=3
        )
        assert disk_files(s) == sorted(str(Path(k[:2]) / f"{k}.page") for k in (key(1), key(2)))


def test_defect9_memory_store_verifies_its_pages_too(tmp_path: Path) -> None:
    """The memory store keeps the same page format: a damaged page is a miss, then repaired."""
    page = pages_of(1, 8, seed=1)
    with MemoryStore() as s:
        s.put("first", [key(1)], page)
        assert s.drain()[0].ok
        s._pages[key(1)] = s._pages[key(1)][:5]  # damage it in place
        assert s.get(key(1)) is None and not s.contains(key(1))
        s.put("repair", [key(1)], page)
        assert s.drain()[0].ok
        assert s.get(key(1)) == raw(page[0])
        assert s.stats().pages_corrupt == 3 and s.stats().pages_written == 2


def test_defect9_page_format_checks_length_crc_and_key() -> None:
    payload = bytes(range(32))
    stored = frame_page(key(1), payload) + payload
    assert stored[:4] == b"KVLP"
    assert unframe_page(key(1), stored) == payload
    assert unframe_page(key(2), stored) is None  # another key's page
    for damage in DAMAGES.values():
        assert unframe_page(key(1), damage(stored, b"")) is None


def test_defect9_mismatch_against_a_whole_page_changes_nothing(tmp_path: Path) -> None:
    """A put of other bytes under a whole stored page is refused; the disk is unchanged."""
    with LocalDirectoryStore(tmp_path, "ns") as s:
        s.put("first", [key(1)], pages_of(1, 8, seed=1))
        assert s.drain()[0].ok
        before, stats = tree(tmp_path), s.stats()
        s.put("other", [key(3), key(1)], pages_of(2, 8, seed=2))
        (result,) = s.drain()
        assert isinstance(result.error, PageMismatch)
        assert tree(tmp_path) == before
        assert s.stats() == StoreStats(
            puts_ok=stats.puts_ok,
            puts_failed=1,
            pages_written=stats.pages_written,
            page_mismatches=1,
            bytes_written=stats.bytes_written,
        )


# A writer process whose store writes a whole page of the value argv[3] to its temporary
# file, says so, and waits for a line on stdin before naming it and reporting the result.
GATED_WRITER = textwrap.dedent(
    """
    import sys, torch
    from kvlife.store import LocalDirectoryStore

    class Gated(LocalDirectoryStore):
        def _write_page(self, file, page):
            super()._write_page(file, page)
            file.flush()
            print("WRITTEN", flush=True)
            sys.stdin.readline()

    root, key, value = sys.argv[1], sys.argv[2], float(sys.argv[3])
    with Gated(root, "shared") as store:
        store.put("p", [key], torch.full((1, 1024), value))
        (result,) = store.drain()
        print("ok" if result.ok else type(result.error).__name__, flush=True)
    """
)


def writer_process(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.parametrize("same_bytes", [False, True])
def test_defect10_first_complete_page_of_a_key_wins_across_processes(
    tmp_path: Path, same_bytes: bool
) -> None:
    """Scenario: two processes both hold a complete page of one key, neither has named it.

    The one that names it first wins; the other gets PageMismatch (other bytes)
    or a deduplicated success (same bytes), and the first page stays stored.
    """
    k = key(7)
    values = [1.0, 1.0 if same_bytes else 2.0]
    procs = [writer_process(GATED_WRITER, str(tmp_path), k, str(v)) for v in values]
    outcomes = []
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "WRITTEN"
        for proc in procs:  # let them name their pages one after the other
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
            outcomes.append(proc.stdout.readline().strip())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert outcomes == ["ok", "ok" if same_bytes else "PageMismatch"]
    with LocalDirectoryStore(tmp_path, "shared") as s:
        assert list(s.keys()) == [k]
        assert s.get(k) == raw(torch.full((1024,), values[0]))
        assert list(s.directory.rglob("*.tmp")) == []


# A writer process that, once told to go, puts one page per key for 200 keys, every page
# filled with its own value argv[2], and prints each put's outcome.
RACING_WRITER = textwrap.dedent(
    """
    import sys, torch
    from kvlife.store import LocalDirectoryStore

    with LocalDirectoryStore(sys.argv[1], "race") as store:
        print("READY", flush=True)
        sys.stdin.readline()
        for i in range(200):
            store.put(i, [f"{i:064x}"], torch.full((1, 256), float(sys.argv[2])))
        for r in store.drain():
            print(r.token, "ok" if r.ok else type(r.error).__name__, flush=True)
    """
)


def test_defect10_racing_writers_store_exactly_one_page_per_key(tmp_path: Path) -> None:
    """Scenario: three processes race to store other bytes under the same 200 keys.

    For each key exactly one process is told ok, the others PageMismatch, and
    the stored page is the winner's.
    """
    procs = [writer_process(RACING_WRITER, str(tmp_path), str(v)) for v in range(3)]
    winners: dict[int, list[int]] = {i: [] for i in range(200)}
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
        for v, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=120)
            lines = [line.split() for line in out.splitlines()]
            assert len(lines) == 200 and {o for _, o in lines} <= {"ok", "PageMismatch"}
            for i, outcome in lines:
                if outcome == "ok":
                    winners[int(i)].append(v)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    with LocalDirectoryStore(tmp_path, "race") as s:
        for i, won in winners.items():
            assert len(won) == 1, (i, won)
            assert s.get(f"{i:064x}") == raw(torch.full((256,), float(won[0])))
        assert s.stats().pages_corrupt == 0


def long_namespace(root: Path, length: int) -> str:
    """A namespace of 100-character components making ``root/ns/@pages`` about ``length``."""
    room = length - len(os.fsencode(os.path.abspath(root / PAGES_DIR)))
    return "/".join(["n" * 100] * (room // 101))


@pytest.mark.parametrize(
    "case",
    [
        "root_is_a_file",
        "root_under_a_file",
        "root_component_too_long",
        "namespace_too_long",
        "namespace_leaves_no_room_for_page_files",
    ],
)
def test_defect17_unusable_root_or_namespace_is_a_typed_error_and_changes_nothing(
    tmp_path: Path, case: str
) -> None:
    """Scenario: the store's directory cannot be made, or its page paths would be too long.

    The constructor raises a KVLifeError subclass (never a bare OSError) and
    creates nothing: not even the parents it could have made.
    """
    (tmp_path / "file").write_bytes(b"keep")
    match: str | None = None  # the root's own errors say what is wrong with it
    namespace = "ns"
    if case == "root_is_a_file":
        root = tmp_path / "file"
    elif case == "root_under_a_file":
        root = tmp_path / "file" / "sub"
    elif case == "root_component_too_long":
        root = tmp_path / "new" / ("x" * 300)  # NAME_MAX is 255: "new" could be made first
    else:
        root = tmp_path / "new"
        match = "the namespace is too long"
        namespace = long_namespace(root, 4200 if case == "namespace_too_long" else 4050)
    before = tree(tmp_path)
    with pytest.raises(ConfigError, match=match) as info:
        LocalDirectoryStore(root, namespace)
    assert isinstance(info.value, KVLifeError)
    assert tree(tmp_path) == before


def test_inline_store_all_or_nothing_and_mismatch() -> None:
    store = InlineStore()
    rows = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    store.put("a", ["aa", "bb"], rows)
    (result,) = store.poll()
    assert result.ok and store.get("aa") == rows[0].numpy().tobytes()
    store.put("b", ["cc", "bb"], rows + 1)  # bb with other bytes: the whole put fails
    (result,) = store.drain()
    assert isinstance(result.error, PageMismatch) and not store.contains("cc")
    assert sorted(store.keys()) == ["aa", "bb"] and store.pending == 0
