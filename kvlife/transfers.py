"""The one copy pipeline: every host's copies, from the engine's ack to each host page's fate
(``docs/design.md``, "One copy pipeline"). Only the scheduler thread drives a pipeline, as it
drives the engine.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvlife._lifecycle import LoadTicket, Ticket
from kvlife.engine.base import Ack, page_index
from kvlife.errors import (
    CopyFault,
    DrainTimeout,
    EngineError,
    LifecycleError,
    ManagerError,
    ReleaseCallbackError,
    StoreError,
)
from kvlife.refusals import Refusals

if TYPE_CHECKING:
    from kvlife.engine.base import CopyEngine
    from kvlife.host_tier import HostTier
    from kvlife.manager import Agreement
    from kvlife.pool import HostPagePool
    from kvlife.store.base import Store, StoreResult

__all__ = ["TicketOwner", "TransferCounts", "Transfers", "promote_pages"]


class TicketOwner(Protocol):
    """What a ticket's owner offers the pipeline (a :class:`~kvlife.Lifecycle` has both):
    ``ack`` settles a ticket, or raises LifecycleError, nothing changed, if not in flight."""

    @property
    def inflight(self) -> int: ...

    def ack(self, ticket: Any) -> None: ...


@dataclass
class TransferCounts:
    """What a pipeline counts, by name (a host may pass its own object with these fields)."""

    chunks_acked: int = 0
    pages_offloaded: int = 0
    copy_failures: int = 0
    pages_stored: int = 0
    store_failures: int = 0
    pages_loaded: int = 0
    load_failures: int = 0
    pages_promoted: int = 0
    release_callback_errors: int = 0
    ack_latency_count: int = 0
    ack_latency_sum_s: float = 0.0
    ack_latency_max_s: float = 0.0


#: Where an ack's owner belongs: the pipeline that applies it and the object its host
#: pages are allocated to; ``None`` for an owner no pipeline of this host knows (forged).
Route = Callable[[Any], "tuple[Transfers, object] | None"]
#: The host's hook for each store result: the pages' owner and the result.
StoredHook = Callable[[object, "StoreResult"], object]
#: The host's hook for each ack applied and settled: the pages' owner and the ack.
AckedHook = Callable[[object, Ack], object]


class Transfers:
    """The copy pipeline of one host. ``owns_pages``: the host allocated the chunks' pages
    (to the owner ``route`` names) and the pipeline frees them once settled; else (the vLLM
    worker) the store gets a private copy and nothing is freed. ``tier``: where loads' pins
    are dropped, written pages kept (if it keeps them), store pages promoted to. ``route``:
    which pipeline applies an owner's acks (default: this one); ``acked`` and ``stored``: the
    host's hooks for each settled ack and store result."""

    def __init__(
        self,
        engine: CopyEngine,
        host: HostPagePool,
        store: Store | None,
        *,
        refusals: Refusals,
        tier: HostTier[Any] | None = None,
        agreement: Agreement | None = None,
        counts: Any = None,
        owns_pages: bool = True,
        route: Route | None = None,
        stored: StoredHook | None = None,
        acked: AckedHook | None = None,
    ) -> None:
        self.engine = engine
        self.host = host
        self.store = store
        self.tier = tier
        self.agreement = agreement
        self.refusals = refusals
        #: Counters by name (:class:`TransferCounts` or the host's own, same fields).
        self.counts: Any = TransferCounts() if counts is None else counts
        self.owns_pages = owns_pages
        self._route: Route = route if route is not None else (lambda owner: (self, owner))
        self._stored = stored
        self._acked = acked
        self._acks: deque[Ack] = deque()  # taken from the engine, not yet applied
        self._results: deque[StoreResult] = deque()  # taken from the store, not yet applied
        self._writing: dict[object, tuple[Any, ...]] = {}  # store writes in flight: keys
        #: Errors raised by release callbacks, newest last (bounded), for the host to log.
        self.callback_errors: list[ReleaseCallbackError] = []

    def submit(
        self,
        ticket: Ticket | LoadTicket,
        device_pages: Sequence[int],
        host_pages: Sequence[int],
        *,
        checked: bool = True,
    ) -> object:
        """Hand a chunk to the engine; return its completion handle. ``checked``: it passed
        the engine's checks and its owner holds the ticket, so an engine failing to take it is
        a failed copy, settled here and raised; else (its owner counts it once this returns)
        nothing is settled: a refusal is raised as it is, any other error as a
        :class:`~kvlife.errors.CopyFault` made of it (both ``EngineError``)."""
        try:
            handle = self.engine.submit(ticket, device_pages, host_pages)
        except BaseException as exc:
            what = "load" if type(ticket) is LoadTicket else "chunk"
            fault = CopyFault(f"the engine failed to take {what} {ticket[1]}: {exc!r}")
            if not checked:
                if isinstance(exc, EngineError) or not isinstance(exc, Exception):
                    raise  # refused (or interrupted): nothing changed, nothing to settle
                raise fault from exc
            self.apply(Ack(ticket, tuple(device_pages), tuple(host_pages), fault))
            raise
        if self.agreement is not None:
            self.agreement.submitted(ticket)
        return handle

    def poll(self) -> None:
        """Apply completed copies and store writes (agreed first); one raising loses none."""
        acks = self.engine.poll()
        if self.agreement is not None:
            acks = self.agreement.agree(acks)
        self.apply_acks(acks)
        if self.store is not None:
            self.apply_results(self.store.poll())

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every copy and store write and apply them; ``timeout`` bounds the whole
        call (:class:`~kvlife.errors.DrainTimeout`, nothing lost: a later call applies the rest)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        agreement, store = self.agreement, self.store
        while True:
            try:
                acks = self.engine.drain(_left(deadline))
                while True:  # with an agreement, until every rank completed its copies
                    self.apply_acks(acks if agreement is None else agreement.agree(acks))
                    if agreement is None or not agreement.pending:
                        break
                    if deadline is not None and time.monotonic() > deadline:
                        raise DrainTimeout(
                            f"{agreement.pending} chunks not yet complete on every rank "
                            f"after {timeout} s"
                        )
                    acks = []
            finally:
                if store is not None:
                    self.apply_results(store.drain(_left(deadline)))
            if self.idle:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise DrainTimeout(f"work still in flight after {timeout} s")

    def apply_acks(self, acks: Sequence[Ack]) -> None:
        """Apply ``acks`` (and any an earlier call left) in order."""
        pending = self._acks
        pending.extend(acks)
        while pending:
            self.apply(pending.popleft())

    def apply(self, ack: Ack) -> None:
        """Apply one ack to its ticket's owner and settle its pages (or hand it over)."""
        ticket = ack.ticket
        owner: TicketOwner = ticket[0]
        found = self._route(owner)
        if found is None:  # forged: no owner of this host's to touch
            self.refusals.refuse(
                "ManagerError", ManagerError(f"an ack of no owner of this host: {owner!r:.80}")
            )
            return
        pipeline, pages_owner = found
        if pipeline is not self:  # an engine shared with another host: hand it over
            pipeline._acks.append(ack)
            return
        inflight = owner.inflight
        try:
            owner.ack(ticket)
        except ReleaseCallbackError as exc:
            self.record_callback_error(exc)
        except LifecycleError as exc:  # a duplicate ack from the engine: its pages are not ours
            self.refusals.refuse(type(exc).__name__, exc)
            return
        except BaseException:  # applied if it moved the owner (a release callback's Ctrl-C)
            if owner.inflight != inflight:
                self._settle(ack, pages_owner)
            raise
        self._settle(ack, pages_owner)

    def _settle(self, ack: Ack, owner: object) -> None:
        """An applied ack's pages: a load's pins dropped, a store's pages written or freed."""
        if type(ack.ticket) is LoadTicket:
            self._settle_load(ack)
        else:
            self._settle_store(ack, owner)
        if self._acked is not None:
            self._acked(owner, ack)

    def _settle_load(self, ack: Ack) -> None:
        """An applied load: the host tier's pins on its keys go."""
        keys = ack.ticket[2]
        if self.tier is not None:
            self.tier.complete_load(keys)
        if ack.error is None:
            self.counts.pages_loaded += len(keys)
        else:
            self.counts.load_failures += 1

    def _settle_store(self, ack: Ack, owner: object) -> None:
        """An applied store's host pages: freed if the copy failed, else written to the store."""
        m, pages = self.counts, ack.host_pages
        m.chunks_acked += 1
        latency = ack.completed_at - ack.submitted_at
        m.ack_latency_count += 1
        m.ack_latency_sum_s += latency
        if latency > m.ack_latency_max_s:
            m.ack_latency_max_s = latency
        if ack.error is not None:
            m.copy_failures += 1
        else:
            m.pages_offloaded += len(pages)  # on the host now, whatever the store does
        if ack.error is not None or self.store is None:
            self._give_back(pages, owner)
            return
        try:
            first, tensor = pages[0], self.host.tensor
            if not self.owns_pages:
                rows = tensor.index_select(0, page_index(pages))
            elif len(pages) == 1 or pages == tuple(range(first, first + len(pages))):
                rows = tensor[first : first + len(pages)]
            else:
                rows = tensor[list(pages)]
            token = (self, owner, pages)
            self.store.put(token, ack.ticket[2], rows)
            self._writing[token] = ack.ticket[2]
        except BaseException as exc:  # refused or broken at once: never stored
            m.store_failures += 1
            self._give_back(pages, owner)
            if not isinstance(exc, StoreError):
                raise
            self.refusals.refuse(type(exc).__name__, exc)

    def _give_back(self, pages: Sequence[int], owner: object) -> None:
        if self.owns_pages:
            self.host.free(pages, owner=owner)

    def apply_results(self, results: Sequence[StoreResult]) -> None:
        """Apply store results (and any an earlier call left): pages freed or kept."""
        pending, writing, counts = self._results, self._writing, self.counts
        tier = self.tier if self.tier is not None and self.tier.keep else None
        pending.extend(results)
        while pending:
            result = pending.popleft()
            token = result.token
            if type(token) is not tuple or len(token) != 3 or type(token[0]) is not Transfers:
                continue  # another writer's put to a shared store (a prefill side): not ours
            pipeline, owner, pages = token
            if pipeline is not self:  # a store shared with another host
                pipeline._results.append(result)
                continue
            keys = writing.pop(token, ())
            ok = result.error is None
            if ok and tier is not None and len(keys) == len(pages):
                tier.adopt(keys, pages, owner)  # a cache now, evicted for room
            else:
                self._give_back(pages, owner)
            if ok:
                counts.pages_stored += len(result.keys)
            else:
                counts.store_failures += 1
            if self._stored is not None:
                self._stored(owner, result)

    def pin_for_load(self, keys: Sequence[Any]) -> list[int]:
        """Pin the leading ``keys`` for a load, ready or promoted from the store (room made
        for one never evicts a page pinned before it), up to the first neither holds; the
        pinned pages, in order (``tier.complete_load`` drops the pins of any not loaded)."""
        tier = self.tier
        assert tier is not None, "a load pins pages of a host tier"
        pages = tier.pin_ready(keys)
        while len(pages) < len(keys):
            key = keys[len(pages)]
            if key in tier or not self.promote(key):  # pending, or not in the store either
                break
            entry = tier.entry(key)
            assert entry is not None  # promoted and pinned just now
            pages.append(entry.page)
            pages += tier.pin_ready(keys[len(pages) :])
        return pages

    def promote(self, key: Any) -> bool:
        """Read ``key``'s store page into the host tier, verified and pinned; whether it is."""
        assert self.tier is not None, "promotion needs a host tier"
        try:
            payload = None if self.store is None else self.store.get(key)
        except (StoreError, OSError):
            return False
        if not promote_pages(self.tier, key, [self.host], [payload], pin=True):
            return False
        self.counts.pages_promoted += 1
        return True

    def in_store(self, key: Any) -> bool:
        """Whether the store holds a whole page under ``key`` (not if it cannot answer now)."""
        try:
            return self.store is not None and self.store.contains(key)
        except (StoreError, OSError):
            return False

    def writing(self, key: Any) -> bool:
        """Whether a store write of ``key`` is in flight."""
        return any(key in keys for keys in self._writing.values())

    @property
    def idle(self) -> bool:
        """Nothing in flight: no copy, no ack or result waiting, no store write."""
        store, agreement = self.store, self.agreement
        return not (
            self.engine.inflight
            or self._acks
            or self._results
            or (store is not None and store.pending)
            or (agreement is not None and agreement.pending)
        )

    def record_callback_error(self, exc: ReleaseCallbackError) -> None:
        """Count a release callback's error and keep it (the newest 100) for the host."""
        self.counts.release_callback_errors += 1
        self.callback_errors.append(exc)
        del self.callback_errors[:-100]


def promote_pages(
    tier: HostTier[Any],
    key: Any,
    pools: Sequence[HostPagePool],
    payloads: Sequence[bytes | None] | None,
    *,
    pin: bool,
) -> bool:
    """The one promotion: ``key`` becomes a ready host entry whose page holds, in each of
    ``pools`` (one per rank, the same page index), that pool's payload read back from the
    persistent tier (pinned once for a load with ``pin``). Every payload is checked first,
    so a bad one evicts nothing; ``False``, nothing changed, if one is bad, the key is held
    or there is no room."""
    pairs = [
        (pool, payload)
        for pool, payload in zip(pools, payloads or (), strict=False)
        if payload is not None and len(payload) == pool.page_numel * pool.dtype.itemsize
    ]
    if payloads is None or not len(payloads) == len(pairs) == len(pools):
        return False
    return tier.insert_ready(
        key, lambda page: all(pool.write_bytes(page, b) for pool, b in pairs), pin=pin
    )


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (never negative), or ``None`` for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
