"""The host page pool: a torch tensor of host pages and an allocator that knows every owner.

One host page is one row of :attr:`HostPagePool.tensor`. An allocation is all ``n`` pages or
nothing (``None``); a page is freed only by its owner (by identity), once, every page checked
before any changes (else :class:`~kvlife.errors.PoolError`). Free pages are a stack, so a
freed chunk's run comes back whole. One thread uses the allocator; see ``docs/engines.md``.
"""

from __future__ import annotations

import math
import mmap
import operator
from collections.abc import Callable, Sequence

import torch

from kvlife._checks import buffer_spec, pin_memory_of
from kvlife.errors import ConfigError, PoolError

__all__ = ["REGISTER_CHUNK_BYTES", "HostPagePool", "page_lock", "page_unlock"]


class HostPagePool:
    """Host pages in one torch tensor, with an allocator that records each page's owner; the
    pages are pinned where CUDA is (``pin_memory``: say so outright; ``True`` without CUDA,
    like sizes or a dtype it cannot use, is a :class:`~kvlife.errors.ConfigError`)."""

    __slots__ = ("_free", "_owner", "tensor")

    def __init__(
        self, num_pages: int, page_numel: int, dtype: torch.dtype, *, pin_memory: bool | None = None
    ) -> None:
        buffer_spec(dtype, num_pages=num_pages, page_numel=page_numel)
        pin = pin_memory_of(pin_memory)
        self._init(torch.zeros((num_pages, page_numel), dtype=dtype, pin_memory=pin))

    @classmethod
    def over(cls, tensor: torch.Tensor) -> HostPagePool:
        """A pool whose pages are the rows of ``tensor`` (a 2-D, contiguous CPU tensor, e.g.
        shared memory another process maps too), all free; its allocator is its own."""
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.dim() != 2
            or tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or tensor.numel() == 0
        ):
            raise ConfigError(
                "HostPagePool.over takes a non-empty, contiguous 2-D CPU tensor (pages x "
                f"elements), got {tensor!r:.80}"
            )
        pool = cls.__new__(cls)
        pool._init(tensor)
        return pool

    def _init(self, tensor: torch.Tensor) -> None:
        num_pages = int(tensor.shape[0])
        #: The host pages, one per row.
        self.tensor = tensor
        # Free pages as a stack: pop() hands out 0, 1, 2, ... on a fresh pool.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owner: list[object | None] = [None] * num_pages

    @property
    def capacity(self) -> int:
        """Number of host pages."""
        return len(self._owner)

    @property
    def num_free(self) -> int:
        """Pages free now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages allocated now."""
        return len(self._owner) - len(self._free)

    @property
    def page_numel(self) -> int:
        """Elements of one host page."""
        return int(self.tensor.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the host pages."""
        return self.tensor.dtype

    @property
    def pinned(self) -> bool:
        """Whether the pages are in pinned (page-locked) memory."""
        return self.tensor.is_pinned()

    def owner_of(self, page: int) -> object | None:
        """The owner of ``page``, or ``None`` if it is free."""
        return self._owner[self._check(page)]

    def owners_of(self, pages: Sequence[int]) -> tuple[object | None, ...]:
        """The owner of each of ``pages`` (checked in range by the caller), in one C call."""
        if len(pages) == 1:
            return (self._owner[pages[0]],)
        return operator.itemgetter(*pages)(self._owner)  # type: ignore[no-any-return]

    def owned_by(self, owner: object) -> list[int]:
        """Pages ``owner`` holds now, ascending (a scan of every page: for tests and reports)."""
        return [page for page, held in enumerate(self._owner) if held is owner]

    def page(self, i: int) -> torch.Tensor:
        """A view of host page ``i`` (no copy)."""
        return self.tensor[self._check(i)]

    def __repr__(self) -> str:
        return (
            f"<HostPagePool {self.num_used}/{self.capacity} used, page_numel={self.page_numel} "
            f"{self.dtype} pinned={self.pinned}>"
        )

    def alloc(self, n: int, owner: object) -> list[int] | None:
        """``n`` free pages, now owned by ``owner``; ``None`` (nothing taken) if fewer are free."""
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise PoolError(f"n must be a positive int, got {n!r}")
        if owner is None:
            raise PoolError("owner must not be None (None marks a free page)")
        free = self._free
        if n > len(free):
            return None
        pages = free[-n:]
        pages.reverse()
        del free[-n:]
        owners = self._owner
        for p in pages:
            owners[p] = owner
        return pages

    def free(self, pages: Sequence[int], owner: object) -> None:
        """Return ``pages`` (all owned by ``owner``) to the pool; every page is checked first."""
        self._check_owner(pages, owner)
        owners, free = self._owner, self._free
        for p in reversed(pages):
            owners[p] = None
            free.append(p)

    def _check_owner(self, pages: Sequence[int], owner: object) -> None:
        """Raise, changing nothing, at the first page not ``owner``'s or named twice."""
        if type(pages) is not list and type(pages) is not tuple and not isinstance(pages, Sequence):
            # a set has no order; a generator, one pass
            raise PoolError(f"pages must be a sequence of ints, got {type(pages).__name__}")
        owners = self._owner
        n = len(owners)
        seen: set[int] | None = set() if len(pages) > 1 else None  # a page named twice
        for p in pages:
            if type(p) is not int or not 0 <= p < n:
                self._check(p)  # raises, unless an int subclass in range
            current = owners[p]
            if current is None or (seen is not None and p in seen):
                raise PoolError(f"host page {p} is already free")
            if current is not owner:
                raise PoolError(f"host page {p} is owned by {current!r}, not {owner!r}")
            if seen is not None:
                seen.add(p)

    def write_bytes(self, page: int, payload: bytes) -> bool:
        """Copy ``payload`` into host page ``page`` if it is one page's bytes; whether it was."""
        row = self.tensor[self._check(page)].view(torch.uint8)
        if len(payload) != row.numel():
            return False
        row.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return True

    def transfer(self, pages: Sequence[int], owner: object, new_owner: object) -> None:
        """Hand ``pages`` (all ``owner``'s, every one checked first) to ``new_owner``."""
        if new_owner is None:
            raise PoolError("new_owner must not be None (None marks a free page)")
        self._check_owner(pages, owner)
        owners = self._owner
        for p in pages:
            owners[p] = new_owner

    def _check(self, page: object) -> int:
        if not isinstance(page, int) or isinstance(page, bool) or not 0 <= page < len(self._owner):
            raise PoolError(f"host page {page!r} out of range [0, {len(self._owner)})")
        return page


#: :func:`page_lock` registers ranges of at most this many bytes, each a whole number of
#: pages, so no copy of one page straddles two registrations (vLLM 0.32 bounds the
#: registrations of its own shared offload region so, for drivers' limits on large ranges).
REGISTER_CHUNK_BYTES = 64 << 30


def page_lock(
    pool: HostPagePool,
    register: Callable[[int, int], bool],
    unregister: Callable[[int], object],
    *,
    chunk_bytes: int = REGISTER_CHUNK_BYTES,
) -> list[int] | None:
    """Page-lock a pool made over memory the caller mapped (:meth:`HostPagePool.over`), so a
    CUDA engine copies from it as from a pinned pool: ``register(address, nbytes)``
    (``cudaHostRegister``; True on success) on ranges of at most ``chunk_bytes`` that end on
    both a pool page and an OS page (the driver rounds a range out to OS pages; two must not
    share one). The registered addresses, for :func:`page_unlock`; or None, every range
    unregistered again, when one is refused or torch still sees no pinned pool (and before
    an exception of ``register`` goes on)."""
    tensor = pool.tensor
    row = int(tensor.stride(0)) * tensor.element_size()
    total = tensor.numel() * tensor.element_size()
    unit = math.lcm(row, mmap.PAGESIZE)  # whole host pages and whole OS pages
    chunk = max(chunk_bytes // unit, 1) * unit
    base = int(tensor.data_ptr())
    done: list[int] = []
    try:
        for offset in range(0, total, chunk):
            if not register(base + offset, min(chunk, total - offset)):
                break
            done.append(base + offset)
        else:
            if tensor.is_pinned():
                return done
    except BaseException:
        page_unlock(done, unregister)
        raise
    page_unlock(done, unregister)
    return None


def page_unlock(addresses: Sequence[int], unregister: Callable[[int], object]) -> None:
    """Undo :func:`page_lock` (once no copy reads or writes the pool), last range first."""
    for address in reversed(addresses):
        unregister(address)
