"""Pages in a dict: :class:`MemoryStore` behind a real writer thread, :class:`InlineStore`
on the caller's thread (see ``docs/store.md``). A put's pages are framed first and
committed to the dict in one step under the lock, so a failure leaves nothing of it visible;
pages are kept framed and checked on every read like files.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from kvlife.store.base import (
    DEFAULT_MAX_PAGE_BYTES,
    Payload,
    QueuedStore,
    Written,
    check_held,
    check_key,
    frame_page,
)

__all__ = ["InlineStore", "MemoryStore"]


class MemoryStore(QueuedStore):
    """An in-process store: a dict of page bytes behind a writer thread (tests, simulator)."""

    def __init__(self, *, max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES) -> None:
        self._pages: dict[str, bytes] = {}  # key -> framed page (header + payload)
        self._pages_lock = threading.Lock()
        super().__init__(name="memory-store", max_page_bytes=max_page_bytes)

    def _store_pages(
        self, keys: tuple[str, ...], pages: Sequence[Payload], kept: list[str] | None = None
    ) -> Written:
        framed: list[bytes] = []
        for i, key in enumerate(keys):  # steps 0 to n - 1, then n: before the commit
            self._step(i, f"before page {i}")
            framed.append(b"".join((frame_page(key, pages[i], self._namespace), *pages[i])))
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
        return written

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


class InlineStore(MemoryStore):
    """A :class:`MemoryStore` that writes each put at once, on the caller's thread.

    Same pages, refusals and mismatch rule; results come at the next poll, so every
    write is complete at each poll. No thread, so a run is cheap and deterministic (the
    testing kit's default store; the exhaustive checker builds one per interleaving).
    """

    _inline = True
