"""The store calls a host's cache tier needs (issue 24 item 3, issue 23 item 6), on every store.

- ``clear()`` removes this namespace's pages and says how many, after the puts
  accepted before it;
- ``put(..., keep_first=True)``: a key already holding a whole page of other bytes
  keeps it, the mismatch is counted, and the new pages of the put are stored;
- a put of a list of pages (any shapes, strides and sizes) is one put, all or none,
  written from the tensors' own memory; ``get_into`` reads into the caller's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvlife.errors import ConfigError, InvalidPut, PageMismatch, StoreClosed
from kvlife.store import LocalDirectoryStore, MemoryStore, StoreStats
from kvlife.store.base import QueuedStore, tensor_segments

KINDS = ["memory", "directory"]


def make(kind: str, tmp_path: Path, namespace: str = "ns", **kw: object) -> QueuedStore:
    if kind == "memory":
        return MemoryStore(**kw)  # type: ignore[arg-type]
    return LocalDirectoryStore(tmp_path / "root", namespace, **kw)  # type: ignore[arg-type]


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[QueuedStore]:
    with make(request.param, tmp_path) as s:
        yield s


def key(i: int) -> str:
    return f"{i:064x}"


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def rows(n: int, numel: int = 32, tag: int = 0) -> torch.Tensor:
    return torch.arange(n * numel, dtype=torch.float32).reshape(n, numel) + 1000 * tag


def put(s: QueuedStore, keys: list[str], pages: object, **kw: object) -> BaseException | None:
    s.put("t", keys, pages, **kw)  # type: ignore[arg-type]
    (result,) = s.drain()
    return result.error


# ----------------------------------------------------------------------------- clear


def test_clear_removes_the_namespaces_pages_and_says_how_many(store: QueuedStore) -> None:
    assert put(store, [key(i) for i in range(5)], rows(5)) is None
    assert store.clear() == 5
    assert list(store.keys()) == []
    assert all(store.get(key(i)) is None for i in range(5))
    assert store.stats().pages_cleared == 5
    assert put(store, [key(1)], rows(1, tag=9)) is None  # a cleared key takes new bytes
    assert store.get(key(1)) == raw(rows(1, tag=9)[0])
    assert store.clear() == 1 and store.clear() == 0


def test_clear_runs_after_the_puts_accepted_before_it(store: QueuedStore) -> None:
    for i in range(20):
        store.put(i, [key(i)], rows(1, tag=i))
    assert store.clear() == 20  # none of them lands after the clear
    assert [r.ok for r in store.drain()] == [True] * 20  # their results are kept for poll
    assert list(store.keys()) == []


def test_clear_leaves_other_namespaces_and_foreign_files(tmp_path: Path) -> None:
    with make("directory", tmp_path, "a") as a, make("directory", tmp_path, "b") as b:
        assert isinstance(a, LocalDirectoryStore)
        assert put(a, [key(1), key(2)], rows(2)) is None
        assert put(b, [key(1)], rows(1)) is None
        note = a.directory / key(1)[:2] / "README"
        note.write_text("not a page")
        assert a.clear() == 2
        assert b.get(key(1)) == raw(rows(1)[0]) and note.exists()


def test_clear_on_a_closed_store_is_refused(tmp_path: Path) -> None:
    s = make("memory", tmp_path)
    s.close()
    with pytest.raises(StoreClosed):
        s.clear()


# ----------------------------------------------------------------------------- keep_first


def test_keep_first_keeps_the_stored_page_counts_it_and_stores_the_new_ones(
    store: QueuedStore,
) -> None:
    assert put(store, [key(2)], rows(1, tag=2)) is None
    batch = rows(3, tag=7)
    keys = [key(1), key(2), key(3)]
    assert isinstance(put(store, keys, batch), PageMismatch)  # the default: all or none
    assert store.get(key(1)) is None and store.get(key(3)) is None
    assert put(store, keys, batch, keep_first=True) is None
    assert store.get(key(1)) == raw(batch[0]) and store.get(key(3)) == raw(batch[2])
    assert store.get(key(2)) == raw(rows(1, tag=2)[0])  # the first value stays
    stats = store.stats()
    assert (stats.page_mismatches, stats.pages_written, stats.puts_failed) == (2, 3, 1)
    assert put(store, keys, batch, keep_first=True) is None  # all held now
    assert store.stats().page_mismatches == 3 and store.stats().pages_deduplicated == 2


# ----------------------------------------------------------------------------- lists of pages


def test_a_put_of_pages_of_different_sizes_is_one_put(store: QueuedStore) -> None:
    """Issue 23 item 6 at the store: pages of different sizes are all or none too."""
    pages = [torch.arange(n, dtype=torch.float32) for n in (8, 16, 4)]
    keys = [key(1), key(2), key(3)]
    assert put(store, keys, pages) is None
    assert [store.get(k) for k in keys] == [raw(p) for p in pages]
    assert store.stats() == StoreStats(puts_ok=1, pages_written=3, bytes_written=4 * 28)
    # One of them held other bytes: none of the put's new pages is stored.
    other = [key(4), key(2)]
    assert isinstance(put(store, other, [pages[0], pages[0] + 1]), PageMismatch)
    assert store.get(key(4)) is None


def test_strided_pages_are_written_from_their_own_memory(store: QueuedStore) -> None:
    """A host pool in a layer-first layout [2, layers, tokens, heads, dim]: a page is a
    strided view, one run per K/V and layer, written without gathering it first."""
    pool = torch.randn(2, 3, 16, 2, 4).to(torch.bfloat16)
    views = [pool[:, :, t : t + 4] for t in (0, 4, 8)]
    assert not views[0].is_contiguous() and len(tensor_segments(views[0])) == 6
    keys = [key(i) for i in range(3)]
    assert put(store, keys, views) is None
    assert [store.get(k) for k in keys] == [raw(v) for v in views]
    into = torch.zeros_like(pool)
    targets = [into[:, :, t : t + 4] for t in (0, 4, 8)]
    got = store.get_batch_into(keys, [tensor_segments(t, writable=True) for t in targets])
    assert got == [True, True, True]
    assert torch.equal(into[:, :, :12], pool[:, :, :12]) and not into[:, :, 12:].any()


def test_bad_lists_of_pages_are_refused_before_anything(store: QueuedStore) -> None:
    for pages, match in [
        ([torch.zeros(4), "not a tensor"], "torch.Tensor"),
        ([torch.zeros(4)], "2 keys for 1 pages"),
        ([torch.zeros(4), torch.zeros(0)], "empty"),
        ([torch.zeros(4), torch.zeros(4).to_sparse()], "dense host"),
        ({"a": 1}, "a list of them"),
    ]:
        with pytest.raises(InvalidPut, match=match):
            store.put("t", [key(1), key(2)], pages)  # type: ignore[arg-type]
    assert store.pending == 0 and store.stats() == StoreStats()


def test_get_into_a_view_that_is_not_addressable_is_refused() -> None:
    t = torch.zeros(4, 4).t()  # last dimension strided
    with pytest.raises(InvalidPut, match="in place"):
        tensor_segments(t, writable=True)
    assert len(tensor_segments(t)) == 1  # for a write it is copied


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "64"])
def test_a_bad_max_page_bytes_is_refused(tmp_path: Path, bad: object) -> None:
    for kind in KINDS:
        with pytest.raises(ConfigError, match="max_page_bytes"):
            make(kind, tmp_path, max_page_bytes=bad)
    assert not (tmp_path / "root").exists()  # refused before any directory was made
