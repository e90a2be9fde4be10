"""The host tier: host pages held under their keys, for stores in flight, loads and reuse.

Theory of operation
===================

A host tier maps a page's key (its hash-chain key) to a host page of a
:class:`~kvlife.pool.HostPagePool`. Each :class:`HostEntry` is either
*pending* (a store copy is writing its page: never a hit) or *ready*; a ready
entry has a pin *count*, one per reader in flight (a load copying the page to a
device, a store write reading it). An entry is evictable only when it is ready,
unpinned and not one of the keys the same store offers. "Is anything evictable"
is a count; the victims come least recent first (below), with no scan of the index.

Completions are per key, as vLLM's contract is: ``complete_store(keys)`` settles
each named key's pending store, ``complete_load(keys)`` drops one pin per named
key. A key with nothing in flight is a refusal (:class:`~kvlife.errors.TierError`
through :class:`~kvlife.refusals.Refusals`) that changes nothing, so no
combination of completions leaves a key pending or pinned with nothing in flight,
and none drives a pin count below zero. In strict mode every key is checked
before any is settled.

Recency keeps what a lookup can reach: a lookup stops at the first miss, so the
tier should lose a request's prefix from its tail, not its head. Every held key,
pending, pinned or idle, has a *rank*, its logical recency, and a place in the
eviction order by rank that it keeps while a store writes it or a reader pins it
(eviction passes over those): a new key is ranked when its store is prepared (in
the order offered), :meth:`HostTier.finished` and :meth:`touch` re-rank a
request's keys in prefix order with the head the most recent, and :meth:`rank`
raises keys to ranks the runtime gives (a running request's keys by token
position, tail below head). So the order a copy's completions arrive in (a set's
order follows Python's hash seed) never changes which key goes first: a request
that finished before its stores completed still loses its tail first, and an old
request's late completion never outranks a newer request's keys (vLLM's CPU
manager keeps recency the same way). A key made the most recent joins the end of
an insertion-ordered *lane*; a key given any other rank goes to a heap; the
victim is the lesser of their heads, so pins, completions and new keys move
nothing in a heap.

A pending store may carry a deadline (``pending_timeout``): :meth:`expire` fails
a store not completed in time. Its key stops being a hit at once, but its page
is still being written (or may be), so the entry moves to *orphans*: not in the
index, its page held, and its key not stored again, until the late completion
(or :meth:`abandon`, when the runtime knows no copy runs any more) frees it.
:meth:`reset` does the same to every entry a copy still touches and drops the rest.

Events (:class:`TierEvent`: keys stored, keys removed) are queued in the order
they happen, a removal before the store that reuses its page, and drained with
:meth:`take_events`. The counts (:class:`TierCounts`) are plain ints kept as the
events happen, so reading them is O(1) and never iterates a dict another thread
mutates. One thread (the scheduler's) drives a tier.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, NamedTuple, TypeVar

from kvlife.errors import ConfigError, TierError
from kvlife.pool import HostPagePool
from kvlife.refusals import Refusals

__all__ = ["HostEntry", "HostTier", "Lookup", "Rank", "StorePlan", "TierCounts", "TierEvent"]

K = TypeVar("K", bound=Hashable)

#: A key's logical recency: higher is more recent. ``(n, 0)`` for a rank taken from the
#: tier's counter; ``(request, -position)`` for a running request's key (see
#: :meth:`HostTier.rank`).
Rank = tuple[int, int]

#: The deadline of an entry no pending store times out.
_NO_DEADLINE = float("inf")


class Lookup(Enum):
    """What the host tier holds under a key."""

    #: Nothing (or an expired store's orphan): recompute, or read another tier.
    MISS = "miss"
    #: Ready: a load may copy it now.
    HIT = "hit"
    #: A store copy is still writing it: not loadable yet.
    PENDING = "pending"


class HostEntry:
    """One key's host page: pending while a store writes it, then ready; ``pins`` readers."""

    __slots__ = ("deadline", "page", "pending", "pins", "rank", "seq")

    def __init__(self, page: int, deadline: float, rank: Rank | None, pending: bool = True) -> None:
        #: The host page (a row of the pool's tensor).
        self.page = page
        #: A store copy is writing the page: not a hit, never evicted.
        self.pending = pending
        #: Readers in flight (loads, store writes); never evicted while > 0.
        self.pins = 0
        #: When the pending store is failed (``inf``: no deadline).
        self.deadline = deadline
        #: The key's recency in the tier's heap; ``None`` in its lane (read
        #: :meth:`HostTier.rank_of`).
        self.rank = rank
        #: The sequence number of the key's live heap item (0 in the lane).
        self.seq = 0

    def __repr__(self) -> str:
        what = "pending" if self.pending else f"ready pins={self.pins}"
        return f"HostEntry(page={self.page}, {what})"


class StorePlan(NamedTuple, Generic[K]):
    """What :meth:`HostTier.prepare_store` decided: the new keys to copy, their pages, and
    the keys evicted to make room (announced as removed before these are stored)."""

    keys: list[K]
    pages: list[int]
    evicted: list[K]


class TierEvent(NamedTuple, Generic[K]):
    """Keys that became ready on the host tier (``removed`` False) or left it (True);
    ``source``: what the caller of :meth:`HostTier.complete_store` named (its request)."""

    keys: tuple[K, ...]
    removed: bool
    source: object = None


@dataclass(slots=True)
class TierCounts:
    """The host tier's counters (events so far) and gauges (now), kept in O(1)."""

    stored: int = 0  #: keys whose store completed: ready now
    store_failures: int = 0  #: keys whose store completed unsuccessfully
    expired: int = 0  #: pending stores failed by their deadline
    late_completions: int = 0  #: completions of expired or reset stores (their pages freed)
    loads: int = 0  #: pins taken by loads
    evicted: int = 0  #: ready keys evicted to make room
    no_room: int = 0  #: stores refused: every page pending or pinned
    dropped: int = 0  #: ready keys dropped without eviction (reset, not kept)
    entries: int = 0  #: keys held (pending or ready)
    pending: int = 0  #: keys a store is writing
    pinned: int = 0  #: pins held (loads and store writes in flight)
    evictable: int = 0  #: ready, unpinned keys
    orphans: int = 0  #: pages of expired or reset stores still being written


class HostTier(Generic[K]):
    """Keys to host pages: pending/ready entries, pin counts, per-key completion,
    prefix-aware LRU, a deadline on pending stores, and stored/removed events.

    ``pool`` holds the pages (the tier owns every page it allocates). ``keep``: whether an
    entry stays on the host once idle (a cache); without it an entry is freed as soon as
    its store completed and no pin is left (a staging buffer). ``pending_timeout``:
    seconds a store may stay pending before :meth:`expire` fails it (None: never).
    ``events``: whether to queue events (:class:`TierEvent`) for :meth:`take_events`; a host
    that never takes them (the :class:`~kvlife.OffloadManager`) says ``False``, so none pile up.
    """

    def __init__(
        self,
        pool: HostPagePool,
        *,
        keep: bool = True,
        pending_timeout: float | None = None,
        refusals: Refusals | None = None,
        clock: Callable[[], float] = time.monotonic,
        events: bool = True,
    ) -> None:
        if pending_timeout is not None and (
            isinstance(pending_timeout, bool)
            or not isinstance(pending_timeout, (int, float))
            or not 0 < pending_timeout < float("inf")
        ):
            raise ConfigError(
                f"pending_timeout must be a positive number of seconds, got {pending_timeout!r}"
            )
        self.pool = pool
        self.keep = bool(keep)
        self.pending_timeout = pending_timeout
        self.refusals = refusals if refusals is not None else Refusals()
        self._clock = clock
        self._index: dict[K, HostEntry] = {}
        self._next_rank = 0
        # Every held key's place in the eviction order: the lane (key -> the counter's rank
        # it was made the most recent with, in that order), or the heap of (rank, seq, key)
        # (an item whose seq is not its entry's is stale, skipped lazily).
        self._lane: OrderedDict[K, int] = OrderedDict()
        self._heap: list[tuple[Rank, int, K]] = []
        self._seq = 0
        self._orphans: dict[K, HostEntry] = {}
        self._deadlines: deque[tuple[float, K, HostEntry]] = deque()  # in deadline order
        self._events: list[TierEvent[K]] = []
        self._record_events = bool(events)
        #: The counters; read them from any thread.
        self.counts = TierCounts()

    # ---------------------------------------------------------------- reading

    @property
    def capacity(self) -> int:
        """Host pages of the pool."""
        return self.pool.capacity

    def lookup(self, key: K) -> Lookup:
        """HIT if ready, PENDING while a store writes it, else MISS. O(1), changes nothing."""
        entry = self._index.get(key)
        if entry is None:
            return Lookup.MISS
        return Lookup.PENDING if entry.pending else Lookup.HIT

    def entry(self, key: K) -> HostEntry | None:
        """The entry held under ``key`` (not an orphan), for the runtime's page index."""
        return self._index.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def held(self) -> list[K]:
        """Keys held, pending and ready (a copy)."""
        return list(self._index)

    # ---------------------------------------------------------------- stores

    def prepare_store(
        self, keys: Iterable[K], *, protected: Iterable[K] = ()
    ) -> StorePlan[K] | None:
        """Pages for the keys of ``keys`` the tier does not hold, evicting idle entries if
        needed (never a key of ``keys`` or ``protected``); the new entries are pending.

        Keys already held are made recent, not stored again; an orphan's key is skipped
        until its late copy ends. ``None`` when the room cannot be made (every other page
        pending or pinned): nothing changed, counted as ``no_room``.
        """
        index, orphans = self._index, self._orphans
        new: list[K] = []
        seen: set[K] = set()
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            if key in index:
                self._make_recent(key, index[key])
            elif key not in orphans:
                new.append(key)
        if not new:
            return StorePlan([], [], [])
        evicted = self._victims(len(new) - self.pool.num_free, seen.union(protected))
        if evicted is None:
            self.counts.no_room += 1
            return None
        self._evict(evicted)
        pages = self.pool.alloc(len(new), self)
        assert pages is not None  # the room was made above
        deadline = self._deadline()
        for key, page in zip(new, pages, strict=True):
            entry = index[key] = HostEntry(page, deadline, None)
            self._make_recent(key, entry)
            if self.pending_timeout is not None:
                self._deadlines.append((deadline, key, entry))
        c = self.counts
        c.entries += len(new)
        c.pending += len(new)
        return StorePlan(new, pages, evicted)

    def complete_store(
        self, keys: Iterable[K], *, success: bool = True, source: object = None
    ) -> list[K]:
        """Settle each named key's pending store: ready (success) or gone, its page freed.
        A key that became ready goes idle at its rank, whatever the order ``keys`` name it.

        A late completion of an orphan frees its page. A key with nothing pending is
        refused (counted; raised when strict, before any key is settled). Returns the keys
        that became ready (announced stored with ``source``).
        """
        named = list(keys)
        index, orphans = self._index, self._orphans
        named_once: set[K] = set()

        def pending_once(key: K) -> bool:  # a key named twice has nothing left the second time
            first = key not in named_once
            named_once.add(key)
            held = index.get(key) or orphans.get(key)
            return first and held is not None and held.pending

        self._check_each(named, pending_once, "complete_store")
        ready: list[K] = []
        freed: list[int] = []
        c = self.counts
        for key in named:
            entry = index.get(key)
            if entry is not None and entry.pending:
                entry.pending = False
                c.pending -= 1
                if success:
                    ready.append(key)
                else:
                    freed.append(self._drop(key))
                    c.store_failures += 1
            elif key in orphans and orphans[key].pending:
                orphans[key].pending = False
                c.late_completions += 1
                self._release_orphan(key, freed)
            else:
                self._refuse_key(key, "complete_store")
        c.stored += len(ready)
        if ready:  # announced before any removal an idle, not-kept entry makes below
            self._announce(ready, False, source)
        for key in ready:
            self._settled(key, index[key], freed)
        if freed:
            self.pool.free(freed, self)
        return ready

    def adopt(self, keys: Sequence[K], pages: Sequence[int], owner: object) -> list[K]:
        """Keep pages that already hold these keys' bytes (a chunk's staged copy the store
        has written): ownership passes from ``owner`` to the tier and each key is ready at
        once, the most recent; a key already held (or an orphan's) gives its page back to
        the pool instead. Returns the keys adopted."""
        if len(keys) != len(pages):
            raise ValueError(f"adopt: {len(keys)} keys for {len(pages)} pages")
        self.pool.transfer(pages, owner, self)  # every page checked before any changes hands
        index, orphans, lane = self._index, self._orphans, self._lane
        taken: list[K] = []
        freed: list[int] = []
        for key, page in zip(keys, pages, strict=True):
            if key in index or key in orphans:
                freed.append(page)
            else:
                index[key] = HostEntry(page, _NO_DEADLINE, None, False)
                self._next_rank += 1  # _make_recent, inlined for a new key
                lane[key] = self._next_rank
                taken.append(key)
        if taken:
            self._add_ready(taken, freed)
        if freed:
            self.pool.free(freed, self)
        return taken

    def make_room(self, n: int, *, protected: Iterable[K] = ()) -> bool:
        """Evict idle entries (least recent first, never a ``protected`` key) until ``n``
        pages of the pool are free. ``False``, with nothing evicted, when that cannot be done;
        O(1) when nothing is evictable."""
        victims = self._victims(n - self.pool.num_free, set(protected))
        if victims is None:
            return False
        self._evict(victims)
        return True

    def insert_ready(self, key: K, fill: Callable[[int], bool], *, pin: bool = False) -> bool:
        """Promote ``key`` from another tier: take a page (evicting if needed), let ``fill``
        write and verify its bytes; on ``True`` the key is ready (and pinned once, with
        ``pin``, for the load that asked), else the page goes back. ``False`` when the key
        is held already, there is no room, or ``fill`` failed."""
        if key in self._index or key in self._orphans or not self.make_room(1):
            return False
        pages = self.pool.alloc(1, self)
        assert pages is not None  # room made just above
        try:
            filled = fill(pages[0])
        except BaseException:
            self.pool.free(pages, self)
            raise
        if not filled:
            self.pool.free(pages, self)
            return False
        entry = self._index[key] = HostEntry(pages[0], _NO_DEADLINE, None, False)
        self._make_recent(key, entry)
        if pin:  # the load's pin, taken before the entry can go idle
            entry.pins = 1
            self.counts.pinned += 1
            self.counts.loads += 1
        freed: list[int] = []
        self._add_ready([key], freed)
        if freed:
            self.pool.free(freed, self)
        return True

    def expire(self, now: float | None = None) -> list[K]:
        """Fail every pending store past its deadline: no longer a hit, its page kept (as an
        orphan) until its copy is known over. Returns the keys expired."""
        if self.pending_timeout is None:
            return []
        now = self._clock() if now is None else now
        queue, index = self._deadlines, self._index
        expired: list[K] = []
        while queue and queue[0][0] <= now:
            _, key, entry = queue.popleft()
            if index.get(key) is entry and entry.pending:
                del index[key]
                self._lane.pop(key, None)
                self._orphans[key] = entry
                expired.append(key)
        c = self.counts
        c.expired += len(expired)
        c.entries -= len(expired)
        c.pending -= len(expired)
        c.orphans += len(expired)
        return expired

    # ---------------------------------------------------------------- loads and readers

    def prepare_load(self, keys: Sequence[K]) -> list[int] | None:
        """Pin each key (one pin per occurrence) and return its pages, in order; every key
        must be ready. Refused as a whole (nothing pinned) otherwise: ``None``."""
        index = self._index
        for key in keys:
            entry = index.get(key)
            if entry is None or entry.pending:
                what = "pending" if entry is not None else "not held"
                self.refusals.refuse(
                    "prepare_load",
                    TierError(f"cannot load key {_short(key)}: {what}", key=key),
                )
                return None
        return self.pin_ready(keys)

    def pin_ready(self, keys: Sequence[K]) -> list[int]:
        """Pin the leading ready keys for a load (one pin per occurrence), up to the first
        key that is not ready; their pages, in order."""
        index, c = self._index, self.counts
        pages: list[int] = []
        for key in keys:
            entry = index.get(key)
            if entry is None or entry.pending:
                break
            if not entry.pins:
                c.evictable -= 1
            entry.pins += 1
            pages.append(entry.page)
        c.pinned += len(pages)
        c.loads += len(pages)
        return pages

    def pin(self, keys: Iterable[K]) -> None:
        """Hold ready keys for a reader other than a load (a store write reading the page)."""
        c = self.counts
        for key in keys:
            entry = self._index.get(key)
            if entry is not None and not entry.pending:
                if not entry.pins:
                    c.evictable -= 1
                entry.pins += 1
                c.pinned += 1

    def complete_load(self, keys: Iterable[K]) -> None:
        """Drop one pin per named key (a load, or another reader, is over). A key with no
        pin left to drop is refused (counted; raised when strict, before any is dropped)."""
        self.unpin(keys, "complete_load")

    def unpin(self, keys: Iterable[K], what: str = "unpin") -> None:
        """Drop one pin per named key; an idle entry that is not kept is freed."""
        named = list(keys)
        index, orphans = self._index, self._orphans
        if self.refusals.strict:  # every key checked before any pin is dropped
            dropped: dict[K, int] = {}
            for key in named:
                n = dropped[key] = dropped.get(key, 0) + 1
                entry = index.get(key) or orphans.get(key)
                if entry is None or entry.pins < n:
                    self._refuse_key(key, what)
        freed: list[int] = []
        c = self.counts
        for key in named:
            entry = index.get(key)
            orphan = entry is None
            if orphan:
                entry = orphans.get(key)
            if entry is None or entry.pins <= 0:
                self._refuse_key(key, what)
                continue
            entry.pins -= 1
            c.pinned -= 1
            if entry.pins:
                continue
            if orphan:
                self._release_orphan(key, freed)
            else:
                self._settled(key, entry, freed)
        if freed:
            self.pool.free(freed, self)

    # ---------------------------------------------------------------- recency

    def new_rank(self) -> Rank:
        """The next rank of the tier's counter: more recent than every rank before it.
        Its first number also serves as a request's rank for :meth:`rank`."""
        self._next_rank += 1
        return (self._next_rank, 0)

    def touch(self, keys: Sequence[K]) -> None:
        """A request used ``keys`` (in prefix order): the head becomes the most recent.
        Every held key is re-ranked, pending and pinned ones too: each goes idle later at
        this rank, whenever and in whatever order its copy completes."""
        index = self._index
        for key in reversed(keys):
            entry = index.get(key)
            if entry is not None:
                self._make_recent(key, entry)

    def finished(self, keys: Sequence[K]) -> None:
        """A request whose prefix is ``keys`` (in order) finished: its tail goes first,
        now and for keys whose copies complete later."""
        self.touch(keys)

    def rank(self, ranks: Iterable[tuple[K, Rank]], *, lower: bool = False) -> None:
        """Raise held keys to the ranks given (a key already more recent keeps its own;
        with ``lower``, the rank is set either way: keys a request just stored): a running
        request's keys as ``(request, -position)``, one ``request`` number from
        :meth:`new_rank` per request, so its tail ranks below its head and the request
        below every later one."""
        index = self._index
        for key, rank in ranks:
            entry = index.get(key)
            if entry is not None and (lower or rank > self._rank(key, entry)):
                self._lane.pop(key, None)
                entry.rank = rank
                seq = entry.seq = self._seq = self._seq + 1
                heapq.heappush(self._heap, (rank, seq, key))
        if len(self._heap) > 64 + 2 * len(index):  # mostly stale: rebuilt from the entries
            self._heap = [(e.rank, e.seq, k) for k, e in index.items() if e.rank is not None]
            heapq.heapify(self._heap)

    def rank_of(self, key: K) -> Rank | None:
        """A held key's rank (None when not held)."""
        entry = self._index.get(key)
        return None if entry is None else self._rank(key, entry)

    def eviction_order(self) -> list[K]:
        """The idle keys, the next victim first (a sorted copy, for tests and reports)."""
        index = self._index
        idle = [k for k, e in index.items() if not e.pending and not e.pins]
        return sorted(idle, key=lambda k: self._rank(k, index[k]))

    # ---------------------------------------------------------------- events, reset

    def take_events(self) -> list[TierEvent[K]]:
        """The stored/removed events since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Drop every entry: idle ones now (announced removed), the ones a copy still touches
        become orphans (freed by their completions or :meth:`abandon`)."""
        index, self._index = self._index, {}
        self._lane.clear()
        self._heap.clear()
        self._deadlines.clear()
        freed: list[int] = []
        removed: list[K] = []
        c = self.counts
        for key, entry in index.items():
            if not entry.pending:
                removed.append(key)
            if entry.pending or entry.pins:
                self._orphans[key] = entry
                c.orphans += 1
            else:
                freed.append(entry.page)
        c.dropped += len(removed)
        c.entries = c.pending = c.evictable = 0
        if removed:
            self._announce(removed, True)
        if freed:
            self.pool.free(freed, self)

    def abandon(self) -> int:
        """Free every orphan's page: the runtime knows no copy writes or reads them any
        more (it stopped, or it said no completion will come). Returns the pages freed."""
        orphans, self._orphans = self._orphans, {}
        c = self.counts
        c.pinned -= sum(entry.pins for entry in orphans.values())
        c.orphans = 0
        pages = [entry.page for entry in orphans.values()]
        if pages:
            self.pool.free(pages, self)
        return len(pages)

    # ---------------------------------------------------------------- internals

    def _victims(self, need: int, guard: set[K]) -> list[K] | None:
        """The ``need`` least recent idle entries not in ``guard`` (none when ``need`` <= 0),
        or ``None`` when there are fewer: O(1) when nothing is evictable."""
        if need <= 0:
            return []
        index = self._index

        def idle(key: K) -> bool:
            entry = index.get(key)
            return entry is not None and not entry.pending and not entry.pins

        if need > self.counts.evictable - sum(1 for k in guard if idle(k)):
            return None
        # Enough idle keys outside the guard: the loop finds them, merging the lane and the
        # heap by rank; a victim's heap item goes, guarded, pending or pinned ones go back.
        lane, heap = self._lane, self._heap
        in_lane = (key for key in lane if key not in guard and idle(key))
        head = next(in_lane, None)
        victims: list[K] = []
        kept: list[tuple[Rank, int, K]] = []
        while len(victims) < need:
            while heap:
                _, seq, key = heap[0]
                entry = index.get(key)
                if entry is not None and entry.seq == seq:
                    if not (entry.pending or entry.pins or key in guard):
                        break
                    kept.append(heap[0])
                heapq.heappop(heap)  # stale (re-ranked or gone), or set aside above
            if head is not None and (not heap or (lane[head], 0) <= heap[0][0]):
                victims.append(head)
                head = next(in_lane, None)
            else:
                victims.append(heapq.heappop(heap)[2])
        for item in kept:
            heapq.heappush(heap, item)
        return victims

    def _rank(self, key: K, entry: HostEntry) -> Rank:
        return entry.rank if entry.rank is not None else (self._lane[key], 0)

    def _make_recent(self, key: K, entry: HostEntry) -> None:
        """``key`` becomes the most recent: the end of the lane (a heap item it had is stale)."""
        entry.rank = None
        entry.seq = 0
        self._next_rank += 1
        lane = self._lane
        lane[key] = self._next_rank
        lane.move_to_end(key)

    def _add_ready(self, keys: list[K], freed: list[int]) -> None:
        """``keys`` were just indexed as ready entries on pages already the tier's: counted,
        announced stored, then each settled (idle ones cached, or their pages into ``freed``)."""
        c, index = self.counts, self._index
        c.entries += len(keys)
        c.stored += len(keys)
        self._announce(keys, False)
        for key in keys:
            self._settled(key, index[key], freed)

    def _announce(self, keys: Sequence[K], removed: bool, source: object = None) -> None:
        """Queue one event for :meth:`take_events` (where events are taken at all)."""
        if self._record_events:
            self._events.append(TierEvent(tuple(keys), removed, source))

    def _deadline(self) -> float:
        timeout = self.pending_timeout
        return _NO_DEADLINE if timeout is None else self._clock() + timeout

    def _settled(self, key: K, entry: HostEntry, freed: list[int]) -> None:
        """A ready entry went idle (its store or last reader ended): cached or freed."""
        if entry.pins:
            return
        if self.keep:
            self.counts.evictable += 1
        else:
            freed.append(self._drop(key))
            self.counts.dropped += 1
            self._announce((key,), True)

    def _evict(self, keys: list[K]) -> None:
        """Evict idle entries: announced removed, their pages freed."""
        if not keys:
            return
        freed = [self._drop(key) for key in keys]
        self.counts.evicted += len(keys)
        self.counts.evictable -= len(keys)
        self._announce(keys, True)
        self.pool.free(freed, self)

    def _drop(self, key: K) -> int:
        """Take an entry out of the index and the order; its page, for the caller to free."""
        entry = self._index.pop(key)
        self._lane.pop(key, None)
        self.counts.entries -= 1
        return entry.page

    def _release_orphan(self, key: K, freed: list[int]) -> None:
        entry = self._orphans[key]
        if entry.pending or entry.pins:
            return
        del self._orphans[key]
        self.counts.orphans -= 1
        freed.append(entry.page)

    def _check_each(self, keys: list[K], allowed: Callable[[K], bool], what: str) -> None:
        """Strict: refuse the whole call before anything changes if any key is not allowed."""
        if not self.refusals.strict:
            return
        for key in keys:
            if not allowed(key):
                self._refuse_key(key, what)

    def _refuse_key(self, key: K, what: str) -> None:
        self.refusals.refuse(
            what, TierError(f"{what}: key {_short(key)} has nothing in flight", key=key)
        )


def _short(key: object) -> str:
    text = key.hex() if isinstance(key, bytes) else str(key)
    return text[:16]
