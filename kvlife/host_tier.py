"""The host tier: host pages held under their keys, for stores in flight, loads and reuse.

The rules are ``docs/design.md``'s "The host tier": pending and ready entries, pins, per-key
completions (a key with nothing in flight is a :class:`~kvlife.errors.TierError` refusal that
changes nothing), prefix-aware eviction, deadlines and orphans, events in order, O(1) counts.
Every held key has a *rank* (:meth:`HostTier.rank`) and keeps its place in the eviction order
while a store writes it or a reader pins it (eviction passes over those), so neither a
completion nor a pin moves anything: a key made the most recent joins the end of an
insertion-ordered *lane*, one given any other rank a heap, and the victim is the lesser of
the two heads. One thread drives a tier.
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


class Lookup(Enum):
    """What the host tier holds under a key."""

    #: Nothing (or an expired store's orphan): recompute, or read another tier.
    MISS = "miss"
    #: Ready: a load may copy it now.
    HIT = "hit"
    #: A store copy is still writing it: not loadable yet.
    PENDING = "pending"


class HostEntry:
    """One key's host page (a row of the pool's tensor): ``pending`` while a store copy
    writes it, then ready; ``pins``: its readers in flight. ``rank`` and ``seq``: its place
    in the tier's heap (``None`` and 0 in the lane; :meth:`HostTier.rank_of` reads it)."""

    __slots__ = ("page", "pending", "pins", "rank", "seq")

    def __init__(self, page: int, pending: bool) -> None:
        self.page = page
        self.pending = pending
        self.pins = 0
        self.rank: Rank | None = None
        self.seq = 0

    def __repr__(self) -> str:
        what = "pending" if self.pending else f"ready pins={self.pins}"
        return f"HostEntry(page={self.page}, {what})"


class StorePlan(NamedTuple, Generic[K]):
    """What :meth:`HostTier.prepare_store` decided: new keys, their pages, keys evicted."""

    keys: list[K]
    pages: list[int]
    evicted: list[K]


class TierEvent(NamedTuple, Generic[K]):
    """Keys now ready (``removed`` False) or gone; ``source``: the completion's request."""

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
    """Keys to host pages of ``pool`` (the tier owns every page it allocates). ``keep``: an
    idle entry stays (a cache), else it is freed once its store and pins are over (staging).
    ``pending_timeout``: seconds a store may stay pending before :meth:`expire` fails it.
    ``events``: queue :class:`TierEvent` for :meth:`take_events` (not for a host that never
    takes them)."""

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
        # Every held key's place in the eviction order: the lane (key -> its counter rank),
        # or the heap of (rank, seq, key), an item whose seq is not its entry's stale.
        self._lane: OrderedDict[K, int] = OrderedDict()
        self._heap: list[tuple[Rank, int, K]] = []
        self._seq = 0
        self._orphans: dict[K, HostEntry] = {}
        self._deadlines: deque[tuple[float, K, HostEntry]] = deque()  # in deadline order
        self._events: list[TierEvent[K]] = []
        self._record_events = bool(events)
        #: The counters; read them from any thread.
        self.counts = TierCounts()

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

    def prepare_store(
        self, keys: Iterable[K], *, protected: Iterable[K] = ()
    ) -> StorePlan[K] | None:
        """Pages for the keys of ``keys`` the tier does not hold, evicting idle entries if
        needed (never a key of ``keys`` or ``protected``); the new entries are pending. Keys
        held are made recent, an orphan's skipped. ``None`` when the room cannot be made
        (every other page pending or pinned): nothing changed, counted as ``no_room``."""
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
        timeout = self.pending_timeout
        deadline = None if timeout is None else self._clock() + timeout
        for key, page in zip(new, pages, strict=True):
            entry = index[key] = HostEntry(page, True)
            self._make_recent(key, entry)
            if deadline is not None:
                self._deadlines.append((deadline, key, entry))
        c = self.counts
        c.entries += len(new)
        c.pending += len(new)
        return StorePlan(new, pages, evicted)

    def complete_store(
        self, keys: Iterable[K], *, success: bool = True, source: object = None
    ) -> list[K]:
        """Settle each named key's pending store: ready (success, idle at its rank) or gone,
        its page freed; an orphan's late completion frees its page. A key with nothing
        pending is refused. Returns the keys that became ready (announced with ``source``)."""
        named = list(keys)
        index, orphans = self._index, self._orphans
        if self.refusals.strict:  # every key checked first; one named twice has nothing left
            seen: set[K] = set()
            for key in named:
                held = index.get(key) or orphans.get(key)
                if key in seen or held is None or not held.pending:
                    self._refuse_key(key, "complete_store")
                seen.add(key)
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
        """Take ``owner``'s pages that hold these keys' bytes (a chunk the store wrote): each
        key is ready at once, the most recent; a key held (or an orphan's) frees its page
        instead. Returns the keys adopted."""
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
                index[key] = HostEntry(page, False)
                self._next_rank += 1  # _make_recent, inlined for a new key
                lane[key] = self._next_rank
                taken.append(key)
        self._add_ready(taken, freed)
        return taken

    def make_room(self, n: int, *, protected: Iterable[K] = ()) -> bool:
        """Evict idle entries (least recent first, never a ``protected`` key) until ``n``
        pages are free; ``False``, nothing evicted, when that cannot be done."""
        victims = self._victims(n - self.pool.num_free, set(protected))
        if victims is None:
            return False
        self._evict(victims)
        return True

    def insert_ready(self, key: K, fill: Callable[[int], bool], *, pin: bool = False) -> bool:
        """Promote ``key`` from another tier: take a page (evicting if needed) that ``fill``
        writes and verifies; then the key is ready (pinned once with ``pin``, for the load
        that asked). ``False``, the page back, if the key is held, no room, or ``fill`` fails."""
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
        entry = self._index[key] = HostEntry(pages[0], False)
        self._make_recent(key, entry)
        if pin:  # the load's pin, taken before the entry can go idle
            entry.pins = 1
            self.counts.pinned += 1
            self.counts.loads += 1
        self._add_ready([key], [])
        return True

    def expire(self, now: float | None = None) -> list[K]:
        """Fail every pending store past its deadline (its page an orphan); the keys expired."""
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

    def prepare_load(self, keys: Sequence[K]) -> list[int] | None:
        """Pin each key (once per occurrence) and return its pages, in order; ``None``,
        refused with nothing pinned, unless every key is ready."""
        index = self._index
        for key in keys:
            entry = index.get(key)
            if entry is None or entry.pending:
                what = "pending" if entry is not None else "not held"
                self.refusals.refuse(
                    "prepare_load", TierError(f"cannot load key {_short(key)}: {what}", key=key)
                )
                return None
        return self.pin_ready(keys)

    def pin_ready(self, keys: Sequence[K]) -> list[int]:
        """Pin the leading ready keys for a load (once per occurrence); their pages."""
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
        """Drop one pin per named key (a load is over); a key with no pin left is refused."""
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
            orphan = key not in index
            entry = orphans.get(key) if orphan else index[key]
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

    def new_rank(self) -> Rank:
        """The tier's next rank, the most recent yet (its first number: a request's)."""
        self._next_rank += 1
        return (self._next_rank, 0)

    def touch(self, keys: Sequence[K]) -> None:
        """A request used ``keys`` (in prefix order): the head becomes the most recent. Every
        held key is re-ranked, pending and pinned ones too (they go idle later at this rank)."""
        index = self._index
        for key in reversed(keys):
            entry = index.get(key)
            if entry is not None:
                self._make_recent(key, entry)

    def finished(self, keys: Sequence[K]) -> None:
        """A request whose prefix is ``keys`` (in order) finished: its tail goes first."""
        self.touch(keys)

    def rank(self, ranks: Iterable[tuple[K, Rank]], *, lower: bool = False) -> None:
        """Raise held keys to the ranks given (a key more recent keeps its own; ``lower``
        sets them either way): a running request's keys as ``(request, -position)``, one
        ``request`` number from :meth:`new_rank` each, its tail below its head."""
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

    def take_events(self) -> list[TierEvent[K]]:
        """The stored/removed events since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Drop every entry: idle ones now, the ones a copy still touches as orphans."""
        index, self._index = self._index, {}
        self._lane.clear()
        self._heap.clear()
        self._deadlines.clear()
        freed: list[int] = []
        removed = [key for key, entry in index.items() if not entry.pending]
        c = self.counts
        for key, entry in index.items():
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
        """Free every orphan's page, once the runtime knows no copy touches them; how many."""
        orphans, self._orphans = self._orphans, {}
        c = self.counts
        c.pinned -= sum(entry.pins for entry in orphans.values())
        c.orphans = 0
        pages = [entry.page for entry in orphans.values()]
        if pages:
            self.pool.free(pages, self)
        return len(pages)

    def _victims(self, need: int, guard: set[K]) -> list[K] | None:
        """The ``need`` least recent idle keys not in ``guard``, or ``None`` if fewer."""
        if need <= 0:
            return []
        index = self._index

        def idle(key: K) -> bool:
            entry = index.get(key)
            return entry is not None and not entry.pending and not entry.pins

        if need > self.counts.evictable - sum(1 for k in guard if idle(k)):
            return None
        # Enough idle keys outside the guard: merge the lane and the heap by rank (a
        # victim's heap item goes; guarded, pending or pinned ones go back).
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
        """``keys`` were just indexed as ready: counted, announced, each settled; then the
        pages of ``freed`` (and of any settled entry not kept) are freed."""
        c, index = self.counts, self._index
        if keys:
            c.entries += len(keys)
            c.stored += len(keys)
            self._announce(keys, False)
        for key in keys:
            self._settled(key, index[key], freed)
        if freed:
            self.pool.free(freed, self)

    def _announce(self, keys: Sequence[K], removed: bool, source: object = None) -> None:
        """Queue one event for :meth:`take_events` (where events are taken at all)."""
        if self._record_events:
            self._events.append(TierEvent(tuple(keys), removed, source))

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

    def _refuse_key(self, key: K, what: str) -> None:
        self.refusals.refuse(
            what, TierError(f"{what}: key {_short(key)} has nothing in flight", key=key)
        )


def _short(key: object) -> str:
    text = key.hex() if isinstance(key, bytes) else str(key)
    return text[:16]
