"""The straw man: offload bookkeeping keyed by rid, the way hand-written runtimes keep it.

One definition, used wherever kvlife is compared with what it replaces:

* :class:`RidKeyedBook` -- one request's lifecycle in dicts keyed by rid (inflight
  counter, chain tail, ``last_hash``, tokens submitted, finished flag, release
  callback). The lifecycle bench's ``dict`` baseline (``bench/lifecycle.py``) and
  the rid-keyed half of the reused-rid race diagram (``tests/docs_gen.py``).
* :class:`RidKeyedManager` -- the same book behind the calls of
  :class:`kvlife.manager.OffloadManager` (stride policy, host allocation, copy
  engine, store hand-off, release). The manager bench's baseline
  (``bench/manager.py``) and the simulator's proof that its checks can fail
  (``tests/test_simulate.py``).

It checks nothing: a reused rid overwrites the old request's entry, and a late
ack is found by rid, so it moves whichever request holds that rid now (or is
dropped when none does). Happy-path cost is what such dicts cost: no lookup is
added for the bad cases (they are caught as ``KeyError``). Not part of kvlife.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvlife import FinishReason, Lifecycle
from kvlife.hashing import PageHasher, sglang_page_hashes

#: A submitted chunk as the book hands it to a copy: (rid, its page keys).
Job = tuple[object, tuple[str, ...]]


class RidKeyedBook:
    """Per-request offload bookkeeping in ``dict[rid, ...]``: fast, unchecked, reused-rid unsafe."""

    def __init__(self, *, page_size: int, hasher: PageHasher = sglang_page_hashes) -> None:
        self.page_size = page_size
        self.hasher = hasher
        self.inflight: dict[object, int] = {}
        self.tokens_submitted: dict[object, int] = {}
        self.chain_tail: dict[object, str | None] = {}
        self.last_hash: dict[object, str | None] = {}
        self.finished: dict[object, bool] = {}
        self.on_release: dict[object, Callable[[object], object] | None] = {}

    def begin(
        self,
        rid: object,
        *,
        on_release: Callable[[object], object] | None = None,
        prior_hash: str | None = None,
    ) -> None:
        """Start tracking ``rid`` (silently overwrites a live request with the same rid)."""
        self.inflight[rid] = 0
        self.tokens_submitted[rid] = 0
        self.chain_tail[rid] = prior_hash
        self.last_hash[rid] = prior_hash
        self.finished[rid] = False
        self.on_release[rid] = on_release

    def submit(self, rid: object, tokens: Sequence[int]) -> Job:
        """Hash the chunk's pages, count it in flight; return the job the copy carries."""
        keys = tuple(self.hasher(tokens, self.page_size, self.chain_tail[rid]))
        self.chain_tail[rid] = keys[-1]
        self.tokens_submitted[rid] += len(tokens)
        self.inflight[rid] += 1
        return (rid, keys)

    def ack(self, job: Job) -> None:
        """One copy completed: found by rid, so a stale ack moves whoever holds the rid now."""
        rid, keys = job
        try:
            left = self.inflight[rid] - 1
        except KeyError:  # released and forgotten: the ack is dropped
            return
        self.inflight[rid] = left
        self.last_hash[rid] = keys[-1]
        if left <= 0 and self.finished[rid]:
            self._release(rid)

    def finish(self, rid: object) -> None:
        """Decoding ended; release now if the counter says nothing is in flight."""
        self.finished[rid] = True
        if self.inflight[rid] <= 0:
            self._release(rid)

    def _release(self, rid: object) -> None:
        callback = self.on_release[rid]
        del self.inflight[rid], self.tokens_submitted[rid], self.chain_tail[rid]
        del self.last_hash[rid], self.finished[rid], self.on_release[rid]
        if callback is not None:
            callback(rid)


# The engine carries a Ticket; this manager ignores its Lifecycle.
_NO_LIFECYCLE = Lifecycle("rid-keyed", page_size=1)


class RidKeyedManager:
    """:class:`RidKeyedBook` behind :class:`kvlife.manager.OffloadManager`'s calls; the handle
    is the rid."""

    def __init__(
        self, engine: Any, host: Any, store: Any, *, page_size: int, stride: int | None = None
    ) -> None:
        self.engine, self.host, self.store = engine, host, store
        self.page_size = page_size
        self.stride = (stride or page_size) // page_size * page_size
        self.book = RidKeyedBook(page_size=page_size)
        self.prefill_len: dict[object, int] = {}
        self.pages: dict[object, Sequence[int]] = {}
        self.jobs: dict[int, tuple[Job, tuple[int, ...]]] = {}
        self.next_job = 0

    def start(
        self, rid: object, prompt: Sequence[int], on_release: Callable[..., object]
    ) -> object:
        prefill = len(prompt) // self.page_size * self.page_size
        prior = sglang_page_hashes(prompt[:prefill], self.page_size, None)[-1] if prefill else None
        # A reused rid overwrites whatever the previous request left here.
        self.book.begin(
            rid, on_release=lambda r: on_release(r, self.pages.pop(r, ())), prior_hash=prior
        )
        self.prefill_len[rid] = prefill
        self.pages[rid] = ()
        return rid

    def offload(self, rid: object, tokens: Sequence[int], device_pages: Sequence[int]) -> object:
        book = self.book
        try:
            start = self.prefill_len[rid] + book.tokens_submitted[rid]
        except KeyError:  # released: guarded, as such code is once it crashed in production
            return None
        self.pages[rid] = device_pages
        n = (len(tokens) - 1 - start) // self.stride * self.stride
        if n <= 0 or book.finished[rid]:
            return None
        first, end = start // self.page_size, (start + n) // self.page_size
        host_pages = self.host.alloc(end - first, owner=self)
        if host_pages is None:
            return None
        job = self.next_job
        self.next_job += 1
        rid_keys = book.submit(rid, tokens[start : start + n])
        self.jobs[job] = (rid_keys, tuple(host_pages))
        ticket = (_NO_LIFECYCLE, job, rid_keys[1], first)
        self.engine.submit(ticket, device_pages[first:end], host_pages)
        return job

    def finish(self, rid: object, reason: FinishReason = FinishReason.FINISHED) -> None:
        if rid in self.book.finished:
            self.book.finish(rid)

    def poll(self) -> None:
        for ack in self.engine.poll():
            self._apply(ack)
        for result in self.store.poll():
            self.host.free(result.token, owner=self)

    def close(self, timeout: float | None = None) -> None:
        for ack in self.engine.drain(timeout):
            self._apply(ack)
        for result in self.store.drain(timeout):
            self.host.free(result.token, owner=self)

    def _apply(self, ack: Any) -> None:
        rid_keys, host_pages = self.jobs.pop(ack.seq)
        if ack.ok:
            first = host_pages[0]
            if len(host_pages) == 1 or all(p == first + i for i, p in enumerate(host_pages)):
                rows = self.host.tensor[first : first + len(host_pages)]
            else:
                rows = self.host.tensor[list(host_pages)]
            self.store.put(host_pages, rid_keys[1], rows)
        else:
            self.host.free(host_pages, owner=self)
        self.book.ack(rid_keys)
