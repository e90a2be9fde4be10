"""MemoryStore: pages in a dict, written by a real writer thread.

It completes asynchronously, exactly like the directory store: ``put`` queues,
the writer thread copies the pages' bytes out of the host tensor and commits
them, and the result appears at the next ``poll`` after that. So tests that use
it see the same interleavings (a result arriving between two polls, pages read
after ``put`` returned) as with files.

All-or-nothing: the writer copies every page of a put first and commits them to
the dict in one step under the lock; a failure (injected, or a key already
holding different bytes) happens before the commit, so nothing of that put is
ever visible.

Pages are kept in the shared page format (``frame_page``: a header with the
key, length and CRC32) and checked on every read like files are, so a page
damaged in memory is a miss, counted in ``stats().pages_corrupt``, and the
next put of its key replaces it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from kvlife.store.base import (
    InjectedStoreFailure,
    PageMismatch,
    QueuedStore,
    Written,
    check_key,
    frame_page,
    unframe_page,
)

__all__ = ["MemoryStore"]


class MemoryStore(QueuedStore):
    """An in-process store: a dict of page bytes behind a writer thread (tests, simulator)."""

    def __init__(self, *, fail_rate: float = 0.0, seed: int = 0) -> None:
        self._pages: dict[str, bytes] = {}  # key -> framed page (header + payload)
        self._pages_lock = threading.Lock()
        super().__init__(fail_rate=fail_rate, seed=seed, name="memory-store")

    def _fault_steps(self, n_pages: int) -> int:
        # A fault can strike before copying any page, or after the last: n + 1 steps.
        return n_pages + 1

    def _store_pages(
        self, keys: tuple[str, ...], pages: Sequence[memoryview], fault_at: int | None
    ) -> Written:
        framed: list[bytes] = []
        for i, key in enumerate(keys):
            if fault_at == i:
                raise InjectedStoreFailure(f"injected failure before page {i} of {len(keys)}")
            framed.append(frame_page(key, pages[i]) + pages[i])
        if fault_at == len(keys):
            raise InjectedStoreFailure(f"injected failure before committing {len(keys)} pages")
        new: dict[str, bytes] = {}
        with self._pages_lock:
            for i, key in enumerate(keys):
                held = self._verified(key)
                if held is None:
                    new[key] = framed[i]
                elif held != pages[i]:
                    raise PageMismatch(
                        f"key {key} is stored with different bytes; the stored page is kept",
                        key=key,
                    )
            self._pages.update(new)
        return Written(len(new), len(keys) - len(new), len(new) * len(pages[0]))

    def _verified(self, key: str) -> bytes | None:
        """The payload stored under ``key`` if it is whole; None (a bad one counted) if not."""
        framed = self._pages.get(key)
        if framed is None:
            return None
        payload = unframe_page(key, framed)
        if payload is None:
            self._count_corrupt()
        return payload

    def get(self, key: str) -> bytes | None:
        """The stored payload bytes of a page, or None when no whole page is stored under it."""
        check_key(key)
        with self._pages_lock:
            return self._verified(key)

    def contains(self, key: str) -> bool:
        """Whether a whole, verified page is stored under ``key``."""
        return self.get(key) is not None

    def keys(self) -> Iterator[str]:
        """Every stored key (a snapshot taken at the call)."""
        with self._pages_lock:
            return iter(list(self._pages))
