"""The host page pool: all-or-nothing allocation, owner-checked frees, refusals change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.errors import ConfigError, KVLifeError, PoolError
from kvlife.pool import HostPagePool, page_lock, page_unlock


class Owner:
    """A stand-in for a chunk's ticket: compared by identity only."""

    def __eq__(self, other: object) -> bool:  # equal to every Owner: identity must still win
        return isinstance(other, Owner)

    __hash__ = object.__hash__


def state(pool: HostPagePool) -> tuple[object, ...]:
    """Everything observable about the allocator, for whole-state comparisons."""
    owners = tuple(
        id(pool.owner_of(p)) if pool.owner_of(p) is not None else None for p in range(pool.capacity)
    )
    return (pool.num_free, pool.num_used, owners)


def test_fresh_pool_hands_out_consecutive_pages() -> None:
    pool = HostPagePool(8, 4, torch.float32, pin_memory=False)
    a = Owner()
    assert (pool.capacity, pool.num_free, pool.num_used) == (8, 8, 0)
    assert pool.alloc(3, a) == [0, 1, 2]
    assert pool.alloc(2, a) == [3, 4]
    assert (pool.num_free, pool.num_used) == (3, 5)
    assert pool.owned_by(a) == [0, 1, 2, 3, 4]
    assert [pool.owner_of(p) is a for p in range(8)] == [True] * 5 + [False] * 3
    assert pool.tensor.shape == (8, 4) and pool.tensor.dtype == torch.float32
    assert not pool.pinned


def test_freed_run_comes_back_in_order() -> None:
    """Scenario: a chunk's pages are freed; the next chunk of that size gets the same run."""
    pool = HostPagePool(8, 4, torch.float32, pin_memory=False)
    a, b = Owner(), Owner()
    pool.alloc(2, a)
    run = pool.alloc(3, b)
    assert run == [2, 3, 4]
    pool.free(run, b)
    assert pool.owned_by(b) == []
    assert pool.alloc(3, a) == [2, 3, 4]


def test_page_is_a_view_of_the_tensor() -> None:
    pool = HostPagePool(4, 3, torch.float16, pin_memory=False)
    pool.page(2).fill_(7)
    assert torch.equal(pool.tensor[2], torch.full((3,), 7, dtype=torch.float16))
    assert pool.tensor[1].abs().sum() == 0


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    pool = HostPagePool(4, 2, torch.float32, pin_memory=False)
    a, b = Owner(), Owner()
    pool.alloc(3, a)
    before = state(pool)
    assert pool.alloc(2, b) is None
    assert state(pool) == before
    assert pool.owned_by(b) == []
    assert pool.alloc(1, b) == [3]


def test_double_free_is_refused_and_changes_nothing() -> None:
    pool = HostPagePool(4, 2, torch.float32, pin_memory=False)
    a = Owner()
    pages = pool.alloc(2, a)
    assert pages is not None
    pool.free(pages, a)
    before = state(pool)
    with pytest.raises(PoolError, match="host page 0 is already free"):
        pool.free(pages, a)
    assert state(pool) == before


def test_page_twice_in_one_free_is_a_double_free() -> None:
    pool = HostPagePool(4, 2, torch.float32, pin_memory=False)
    a = Owner()
    pool.alloc(2, a)
    before = state(pool)
    with pytest.raises(PoolError, match="host page 0 is already free"):
        pool.free([0, 1, 0], a)
    assert state(pool) == before


def test_foreign_free_is_refused_even_for_an_equal_owner() -> None:
    pool = HostPagePool(4, 2, torch.float32, pin_memory=False)
    a, b = Owner(), Owner()
    assert a == b  # equal, but not the same owner
    pool.alloc(2, a)
    before = state(pool)
    with pytest.raises(PoolError, match="host page 0 is owned by"):
        pool.free([0], b)
    assert state(pool) == before
    assert pool.owned_by(a) == [0, 1]


def test_free_checks_every_page_before_freeing_any() -> None:
    """Scenario: the last page of a free is bad; the earlier, good pages stay allocated."""
    pool = HostPagePool(6, 2, torch.float32, pin_memory=False)
    a, b = Owner(), Owner()
    pool.alloc(2, a)
    pool.alloc(2, b)
    before = state(pool)
    for pages, why in (
        ([0, 1, 2], "host page 2 is owned by"),
        ([0, 1, 5], "host page 5 is already free"),
        ([0, 1, 6], r"host page 6 out of range \[0, 6\)"),
        ([0, 1, -1], r"host page -1 out of range"),
        ([0, True], r"host page True out of range"),
    ):
        with pytest.raises(PoolError, match=why):
            pool.free(pages, a)
        assert state(pool) == before
    assert pool.owned_by(a) == [0, 1]


def test_errors_are_kvlife_errors() -> None:
    assert issubclass(PoolError, KVLifeError) and issubclass(PoolError, ValueError)


@pytest.mark.parametrize("n", [0, -1, 1.0, True, "2"])
def test_bad_alloc_size_is_refused(n: object) -> None:
    pool = HostPagePool(4, 2, torch.float32, pin_memory=False)
    before = state(pool)
    with pytest.raises(PoolError, match="n must be a positive int"):
        pool.alloc(n, Owner())  # type: ignore[arg-type]
    assert state(pool) == before


def test_none_owner_is_refused() -> None:
    pool = HostPagePool(4, 2, torch.float32, pin_memory=False)
    with pytest.raises(PoolError, match="owner must not be None"):
        pool.alloc(1, None)
    assert pool.num_free == 4


@pytest.mark.parametrize(
    ("num_pages", "page_numel", "dtype"),
    [(0, 4, torch.float32), (4, 0, torch.float32), (4, 4, "float32"), (True, 4, torch.float32)],
)
def test_bad_pool_shape_is_refused(num_pages: object, page_numel: object, dtype: object) -> None:
    with pytest.raises(ConfigError, match=r"must be a positive int|must be a torch\.dtype"):
        HostPagePool(num_pages, page_numel, dtype)  # type: ignore[arg-type]


def test_reading_an_out_of_range_page_is_refused() -> None:
    pool = HostPagePool(4, 2, torch.float32, pin_memory=False)
    for bad in (4, -1, 1.5):
        with pytest.raises(PoolError, match="out of range"):
            pool.owner_of(bad)  # type: ignore[arg-type]
        with pytest.raises(PoolError, match="out of range"):
            pool.page(bad)  # type: ignore[arg-type]


def test_pinned_by_default_only_with_cuda() -> None:
    pool = HostPagePool(2, 2, torch.float32)
    assert pool.pinned == torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA does")
def test_issue23_pinning_without_cuda_is_a_config_error_naming_pin_memory() -> None:
    """It was torch's RuntimeError ("no pinned memory allocator"), from inside torch.zeros."""
    with pytest.raises(ConfigError, match="pin_memory=True needs CUDA"):
        HostPagePool(2, 2, torch.float32, pin_memory=True)


@pytest.mark.parametrize("pin", ["no", 1, 0.0])
def test_issue23_pin_memory_is_a_bool_or_none(pin: object) -> None:
    """``bool("no")`` is True: anything but a bool or None is refused, not truth-tested."""
    with pytest.raises(ConfigError, match="pin_memory"):
        HostPagePool(2, 2, torch.float32, pin_memory=pin)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "foreign"]), st.integers(1, 5), st.integers(0, 3)
        ),
        max_size=40,
    )
)
def test_pool_agrees_with_a_model(ops: list[tuple[str, int, int]]) -> None:
    """Random alloc/free sequences against a plain model: same answers, same owners, no leak."""
    pool = HostPagePool(10, 1, torch.float32, pin_memory=False)
    owners = [Owner() for _ in range(4)]
    model: dict[int, int] = {}  # page -> owner index
    held: list[tuple[int, list[int]]] = []  # allocations not yet freed
    for op, n, who in ops:
        before = state(pool)
        if op == "alloc":
            pages = pool.alloc(n, owners[who])
            if 10 - len(model) < n:
                assert pages is None and state(pool) == before
            else:
                assert pages is not None and len(set(pages)) == n
                assert not set(pages) & set(model)
                model.update(dict.fromkeys(pages, who))
                held.append((who, pages))
        elif held:
            owner_index, pages = held[n % len(held)]
            if op == "foreign":
                with pytest.raises(PoolError, match="is owned by"):
                    pool.free(pages, owners[(owner_index + 1) % 4])
                assert state(pool) == before
            else:
                pool.free(pages, owners[owner_index])
                held.remove((owner_index, pages))
                for p in pages:
                    del model[p]
        assert pool.num_used == len(model)
        for i, owner in enumerate(owners):
            assert pool.owned_by(owner) == sorted(p for p, o in model.items() if o == i)


def test_a_pool_over_a_shared_mapping_sees_another_mappings_bytes_with_its_own_allocator(
    tmp_path: Path,
) -> None:
    """Two pools over one shared file (as a vLLM worker's and the scheduler side's are):
    bytes one writes, the other reads; each allocates apart; bad tensors are refused."""
    path = tmp_path / "pool"
    path.write_bytes(bytes(4 * 8))
    a, b = (
        HostPagePool.over(
            torch.from_file(str(path), shared=True, size=32, dtype=torch.int8).view(4, 8)
        )
        for _ in range(2)
    )
    assert (a.capacity, a.page_numel, a.num_free) == (4, 8, 4)
    assert a.alloc(4, owner="worker") is not None and b.num_free == 4
    assert b.write_bytes(2, bytes(range(8)))
    assert a.page(2).tolist() == list(range(8))
    for bad in (torch.zeros(8), torch.zeros(2, 4).t(), torch.zeros(0, 4), "rows"):
        with pytest.raises(ConfigError, match=r"HostPagePool\.over"):
            HostPagePool.over(bad)  # type: ignore[arg-type]


class Registrar:
    """cudaHostRegister's part, recorded: the ranges registered now, in order; a range
    starting at ``refuse`` is refused."""

    def __init__(self, refuse: int | None = None) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []
        self.refuse = refuse

    def register(self, address: int, nbytes: int) -> bool:
        self.calls.append(("register", address, nbytes))
        if address == self.refuse:
            return False
        assert address not in self.live
        self.live[address] = nbytes
        return True

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address, self.live.pop(address)))


def _shared_pool(tmp_path: Path, pages: int, row: int) -> HostPagePool:
    path = tmp_path / "pool"
    path.write_bytes(b"")
    raw = torch.from_file(str(path), shared=True, size=pages * row, dtype=torch.int8)
    return HostPagePool.over(raw.view(pages, row))


def test_page_lock_registers_whole_pages_in_chunks_and_unlocks_last_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seven pages of 8 KiB in chunks of at most 3 pages: three ranges that cover the pool
    exactly, each ending on a page. (No GPU here: torch is told the pool is pinned, as it
    is after cudaHostRegister; bench/gpu_check.py checks that part for real.)"""
    pool = _shared_pool(tmp_path, 7, 8192)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    reg = Registrar()
    locked = page_lock(pool, reg.register, reg.unregister, chunk_bytes=3 * 8192 + 100)
    base = pool.tensor.data_ptr()
    assert locked == [base, base + 3 * 8192, base + 6 * 8192]
    assert list(reg.live.items()) == [(base, 24576), (base + 24576, 24576), (base + 49152, 8192)]
    page_unlock(locked, reg.unregister)
    assert not reg.live
    assert [c[1] for c in reg.calls if c[0] == "unregister"] == locked[::-1]


def test_page_lock_ranges_end_on_os_pages_when_pool_pages_do_not(tmp_path: Path) -> None:
    """Pages of 6 KiB: a range of 2 pages would end inside an OS page that the next range
    also covers (the driver rounds ranges out to OS pages): ranges are 12 KiB-aligned."""
    pool = _shared_pool(tmp_path, 8, 6144)
    reg = Registrar()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "is_pinned", lambda self: True)
        locked = page_lock(pool, reg.register, reg.unregister, chunk_bytes=20000)
    assert locked is not None
    sizes = [reg.live[a] for a in locked]
    assert sizes == [12288, 12288, 12288, 12288] and sum(sizes) == 8 * 6144


@pytest.mark.parametrize("refused", [0, 1, 2])
def test_page_lock_refused_anywhere_leaves_nothing_registered(tmp_path: Path, refused: int) -> None:
    pool = _shared_pool(tmp_path, 6, 8192)
    reg = Registrar(refuse=pool.tensor.data_ptr() + refused * 2 * 8192)
    before = state(pool)
    assert page_lock(pool, reg.register, reg.unregister, chunk_bytes=2 * 8192) is None
    assert not reg.live and state(pool) == before
    assert sum(1 for c in reg.calls if c[0] == "register") == refused + 1


def test_page_lock_of_memory_torch_still_sees_unpinned_is_undone(tmp_path: Path) -> None:
    """Every range registered, but the tensor is not pinned for torch (no CUDA here): the
    engine would refuse the pool, so nothing stays registered."""
    pool = _shared_pool(tmp_path, 4, 8192)
    reg = Registrar()
    assert page_lock(pool, reg.register, reg.unregister) is None
    assert not reg.live and [c[0] for c in reg.calls] == ["register", "unregister"]


def test_page_lock_undoes_what_it_registered_before_an_error_goes_on(tmp_path: Path) -> None:
    pool = _shared_pool(tmp_path, 6, 8192)
    reg = Registrar()
    second = pool.tensor.data_ptr() + 2 * 8192

    def register(address: int, nbytes: int) -> bool:
        if address == second:
            raise RuntimeError("driver gone")
        return reg.register(address, nbytes)

    with pytest.raises(RuntimeError, match="driver gone"):
        page_lock(pool, register, reg.unregister, chunk_bytes=2 * 8192)
    assert not reg.live and [c[0] for c in reg.calls] == ["register", "unregister"]
