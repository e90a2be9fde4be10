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
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from kvlife.store.base import (
    InjectedStoreFailure,
    PageBytes,
    PageMismatch,
    QueuedStore,
    Written,
    check_key,
)

__all__ = ["MemoryStore"]


class MemoryStore(QueuedStore):
    """An in-process store: a dict of page bytes behind a writer thread (tests, simulator)."""

    def __init__(self, *, fail_rate: float = 0.0, seed: int = 0) -> None:
        self._pages: dict[str, bytes] = {}
        self._pages_lock = threading.Lock()
        super().__init__(fail_rate=fail_rate, seed=seed, name="memory-store")

    def _fault_steps(self, n_pages: int) -> int:
        # A fault can strike before copying any page, or after the last: n + 1 steps.
        return n_pages + 1

    def _store_pages(
        self, keys: tuple[str, ...], pages: PageBytes, fault_at: int | None
    ) -> Written:
        copies: dict[str, bytes] = {}
        for i, key in enumerate(keys):
            if fault_at == i:
                raise InjectedStoreFailure(f"injected failure before page {i} of {len(keys)}")
            copies[key] = bytes(pages.page(i))
        if fault_at == len(keys):
            raise InjectedStoreFailure(f"injected failure before committing {len(keys)} pages")
        with self._pages_lock:
            for key, page in copies.items():
                held = self._pages.get(key)
                if held is not None and held != page:
                    raise PageMismatch(
                        f"key {key} is stored with different bytes; the stored page is kept",
                        key=key,
                    )
            new = {k: v for k, v in copies.items() if k not in self._pages}
            self._pages.update(new)
        return Written(len(new), len(copies) - len(new), sum(map(len, new.values())))

    def get(self, key: str) -> bytes | None:
        """The stored bytes of a page, or None when the key is not stored."""
        check_key(key)
        with self._pages_lock:
            return self._pages.get(key)

    def contains(self, key: str) -> bool:
        """Whether a page is stored under ``key``."""
        check_key(key)
        with self._pages_lock:
            return key in self._pages

    def keys(self) -> Iterator[str]:
        """Every stored key (a snapshot taken at the call)."""
        with self._pages_lock:
            return iter(list(self._pages))
