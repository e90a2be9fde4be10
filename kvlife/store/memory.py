"""Pages in a dict: :class:`MemoryStore` behind a real writer thread, :class:`InlineStore`
on the caller's thread (see ``docs/store.md``).

``MemoryStore`` completes asynchronously exactly like the directory store, so
tests see the same interleavings. Its writer frames every page of a put first
and commits them to the dict in one step under the lock; a failure (one
:mod:`kvlife.testing.faults` injects, or a key holding other bytes) strikes before
the commit, so nothing of that put is ever visible. Pages are kept framed and
checked on every read like files.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from kvlife.errors import PageMismatch
from kvlife.store.base import (
    DEFAULT_MAX_PAGE_BYTES,
    Payload,
    QueuedStore,
    StoreResult,
    Written,
    _check_put,
    check_held,
    check_key,
    frame_page,
    page_views,
)

if TYPE_CHECKING:
    import torch

__all__ = ["InlineStore", "MemoryStore"]


class MemoryStore(QueuedStore):
    """An in-process store: a dict of page bytes behind a writer thread (tests, simulator)."""

    def __init__(
        self,
        *,
        max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
    ) -> None:
        self._pages: dict[str, bytes] = {}  # key -> framed page (header + payload)
        self._pages_lock = threading.Lock()
        super().__init__(name="memory-store", max_page_bytes=max_page_bytes)

    def _store_pages(
        self,
        keys: tuple[str, ...],
        pages: Sequence[Payload],
        kept: list[str] | None = None,
    ) -> Written:
        framed: list[bytes] = []
        for i, key in enumerate(keys):  # steps 0 to n - 1, then n: before the commit
            self._step(i, f"before page {i}")
            framed.append(b"".join((frame_page(key, pages[i], self._page_namespace), *pages[i])))
        self._step(len(keys), "before committing")
        new: dict[str, bytes] = {}
        written: list[Payload] = []
        with self._pages_lock:
            for i, key in enumerate(keys):
                held = self._verify(key, self._pages.get(key))
                if not check_held(key, held, pages[i], kept):
                    new[key] = framed[i]
                    written.append(pages[i])
            self._pages.update(new)
        return Written.of(written, pages, kept or ())

    def _clear(self) -> int:
        with self._pages_lock:
            removed = len(self._pages)
            self._pages.clear()
        return removed

    def get(self, key: str) -> bytes | None:
        """The stored payload bytes of a page, or None when no whole page is stored under it."""
        with self._pages_lock:
            return self._verify(key, self._pages.get(check_key(key)))

    def keys(self) -> Iterator[str]:
        """Every stored key (a snapshot taken at the call)."""
        with self._pages_lock:
            return iter(list(self._pages))


class InlineStore:
    """A :class:`~kvlife.store.Store` that writes each put at once, on the caller's thread.

    Pages in a dict, all-or-nothing, same refusals and mismatch rule as
    :class:`MemoryStore`; results come at the next poll, so every write is
    complete at each poll. No thread, so a run is cheap and deterministic (the
    testing kit's default store; the exhaustive checker builds one per
    interleaving).
    """

    def __init__(self) -> None:
        self._pages: dict[str, bytes] = {}
        self._done: list[StoreResult] = []

    def put(self, token: object, keys: Sequence[str], pages: torch.Tensor) -> None:
        """Store every page under its key now, or none; the result comes at the next poll."""
        checked = _check_put(keys, pages)
        views = page_views(pages)
        copies = {key: b"".join(page) for key, page in zip(checked, views, strict=True)}
        error: PageMismatch | None = None
        try:
            for key, page in copies.items():
                check_held(key, self._pages.get(key), (memoryview(page),))
            self._pages.update(copies)
        except PageMismatch as exc:
            error = exc
        self._done.append(StoreResult(token, checked, error))

    def poll(self) -> list[StoreResult]:
        """Results of the puts since the last poll or drain."""
        done, self._done = self._done, []
        return done

    def drain(self, timeout: float | None = None) -> list[StoreResult]:
        """Same as :meth:`poll`: every put is already complete."""
        return self.poll()

    def get(self, key: str) -> bytes | None:
        """The stored bytes under ``key``."""
        return self._pages.get(check_key(key))

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """:meth:`get` of each key, in order."""
        return [self.get(key) for key in keys]

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored."""
        return check_key(key) in self._pages

    def keys(self) -> Iterator[str]:
        """Every stored key."""
        return iter(list(self._pages))

    def close(self) -> None:
        """Nothing to stop."""

    @property
    def pending(self) -> int:
        """Results not yet returned by poll or drain."""
        return len(self._done)
