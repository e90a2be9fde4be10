"""The scheduler side: :class:`KVLifeOffloadingManager`, vLLM's ``OffloadingManager`` on
kvlife's core host tier (``docs/vllm.md``)."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, fields
from operator import itemgetter
from typing import Any, TypeVar, cast

# vLLM is an optional dependency: mypy runs without it, hence the ignores.
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # type: ignore[import-not-found]
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from kvlife import FinishReason, Lifecycle, LoadTicket, State, Ticket
from kvlife.errors import LifecycleError, ManagerError, StoreError
from kvlife.host_tier import HostTier, Lookup
from kvlife.integrations.vllm._common import (
    FROM_STORE,
    HostBlocksSpec,
    PersistentTier,
    _Live,
    _write_report,
    page_namer,
    shut_down,
)
from kvlife.manager import ManagerMetrics
from kvlife.pool import HostPagePool
from kvlife.refusals import Refusals
from kvlife.store.directory import LocalDirectoryStore
from kvlife.transfers import promote_pages

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_CPU = Medium.CPU  # the medium of the host tier's KV events
# vLLM 0.34's OffloadingEvent carries the storing request (req_context) and says a stored
# key may be removed later (removal_expected); 0.32's has neither field.
_EVENT_FIELDS = frozenset(f.name for f in fields(OffloadingEvent))
_STORED_EXTRAS = "req_context" in _EVENT_FIELDS
_REMOVAL_EXPECTED = "removal_expected" in _EVENT_FIELDS


@dataclass(slots=True)
class _Job:
    """One prepared store or load of one request life: its ticket and the keys not yet
    completed (vLLM completes per key: any subset, any grouping)."""

    lifecycle: Lifecycle
    ticket: Ticket | LoadTicket | None
    left: int


@dataclass(slots=True)
class _Seen:
    """The keys one request life used (prepare_store, prepare_load, touch), first use first,
    and its request rank once it ranked a key by position (vLLM 0.33+ ranks a running
    request's keys so, tail below head)."""

    keys: dict[OffloadKey, None] = field(default_factory=dict)
    rank: int | None = None


def _hex_keys(tokens: Sequence[OffloadKey], page_size: int, prior: str | None) -> list[str]:
    """The Lifecycles' hasher: vLLM names each block by its ``OffloadKey`` (bytes); a
    Lifecycle records keys as hex ``str`` (one key type per ticket)."""
    return [key.hex() for key in tokens]


def _prefix_order(keys: Iterable[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
    """A request's keys head to tail as vLLM's CPU manager orders them: per KV cache group
    (its index: a key's last four bytes), each group by token position when every key of it
    has one, then all by position when every key has one (a stable sort)."""
    groups: dict[int, list[OffloadKey]] = {}
    for key in keys:
        groups.setdefault(int.from_bytes(key[-4:], "big"), []).append(key)
    ordered: list[OffloadKey] = []
    known = True
    for index in sorted(groups):
        group = groups[index]
        positions = [ctx.get_offload_key_position(k) for k in group]
        if None in positions:
            known = False
        else:
            group = [k for _, k in sorted(zip(positions, group, strict=True), key=itemgetter(0))]
        ordered += group
    if known and len(groups) > 1:
        ordered.sort(key=lambda k: cast(int, ctx.get_offload_key_position(k)))
    return ordered


@dataclass(slots=True)
class _Counts:
    """The backend's own counts; the host tier's are in ``HostTier.counts``."""

    loaded: int = 0
    loaded_from_store: int = 0  # blocks the worker read from the persistent tier itself
    promoted: int = 0  # persistent-tier pages read, verified and made host entries
    store_unavailable: int = 0  # persistent-tier reads the store could not answer
    promote_misses: int = 0  # pages found at lookup, damaged or gone by the read: misses
    store_failed: int = 0
    abandoned_jobs: int = 0
    lifecycles_started: int = 0
    loads_started: int = 0  # prepare_load calls (one job each)
    lookups_pending: int = 0  # lookups answered HIT_PENDING (a store or a promotion in flight)
    lifecycles_released: int = 0
    finished_at_shutdown: int = 0
    shutdown_errors: int = 0  # shutdown steps that failed (logged, never raised in vLLM)
    preemptions: int = 0  # requests vLLM preempted (seen at the end of each step)


#: Metric name -> (kind, documentation). Counters are deltas per ``get_stats``.
METRICS: dict[str, tuple[str, str]] = {
    "vllm:kvlife_stored_blocks": ("counter", "Blocks whose store to the host tier completed."),
    "vllm:kvlife_loaded_blocks": ("counter", "Blocks loaded back to the device."),
    "vllm:kvlife_loaded_from_store_blocks": (
        "counter",
        "Blocks loaded from the persistent tier (host miss).",
    ),
    "vllm:kvlife_promoted_blocks": (
        "counter",
        "Persistent-tier pages read and verified into the host tier before a hit.",
    ),
    "vllm:kvlife_promote_misses": (
        "counter",
        "Persistent-tier pages found, then damaged or gone (or no room) at the read: misses.",
    ),
    "vllm:kvlife_evicted_blocks": ("counter", "Host blocks evicted (LRU) to make room."),
    "vllm:kvlife_dropped_host_full": (
        "counter",
        "prepare_store calls refused because every host page was pinned or pending.",
    ),
    "vllm:kvlife_refused": ("counter", "Lifecycle refusals and calls naming no known job."),
    "vllm:kvlife_pending_blocks": ("gauge", "Host blocks whose store is in flight."),
    "vllm:kvlife_host_usage_perc": ("gauge", "Fraction of host pages in use."),
}


#: The labels of ``vllm:kv_offload_config_info`` (vLLM 0.33+): the spec declares them,
#: :meth:`KVLifeOffloadingManager.config_info` fills them.
CONFIG_INFO_KEYS = ("backend", "host_pages", "page_bytes", "persistent_tier", "promotes")
#: Seconds every lookup misses after the persistent tier failed to answer.
_DOWN_SECONDS = 5.0
#: Scheduled steps after a reset until the workers flushed its jobs (vLLM 0.32).
_FLUSH_STEPS = 2


class KVLifeOffloadingManager(OffloadingManager):  # type: ignore[misc]
    """vLLM's scheduler-side manager on kvlife's :class:`~kvlife.host_tier.HostTier` (keys,
    pins, recency): each request life is a :class:`~kvlife.Lifecycle` whose stores and loads
    are tickets, settled key by key as vLLM completes them (docs/vllm.md, "The call
    sequence"). ``pool``: the host tier's pages; ``disk``: the persistent tier, read side, or
    None. ``holds_bytes``: the pool's rows are the host tier's bytes, so a persistent-tier
    page is promoted (read on a thread, verified, written into every rank's pool: the other
    ranks' tiers ``other_ranks`` into ``rank_pools``) before ``lookup`` answers HIT; else a
    load reads it in the worker (docs/design.md, "A hit always loads")."""

    def __init__(
        self,
        pool: HostPagePool,
        *,
        strict: bool = False,
        disk: PersistentTier | None = None,
        report_dir: str | None = None,
        pending_timeout: float | None = None,
        holds_bytes: bool = True,
        page_bytes: int | None = None,
        other_ranks: Sequence[PersistentTier] = (),
        rank_pools: Sequence[HostPagePool] = (),
    ) -> None:
        if holds_bytes and disk is not None and len(rank_pools) != len(other_ranks):
            raise ManagerError(
                f"{len(rank_pools)} rank pools for {len(other_ranks)} other ranks: a promotion "
                "writes every rank's page"
            )
        self.refusals = Refusals(strict=strict, logger=logger)
        self.tier: HostTier[OffloadKey] = HostTier(
            pool, keep=True, pending_timeout=pending_timeout, refusals=self.refusals
        )
        #: The host tier's pool (its allocator; its bytes too where ``holds_bytes``).
        self.pool = pool
        #: Whether this side holds the host tier's bytes (one process, or the workers' pools
        #: mapped from shared memory): a persistent-tier hit is then promoted first.
        self.holds_bytes = disk is not None and holds_bytes
        self._page_bytes = pool.page_numel if page_bytes is None else page_bytes
        self._disk = disk
        self._report_dir = report_dir
        # Every rank's namespace, read side (``disk``'s first); a hit needs each one's page.
        self._ranks = [(d, page_namer(d.namespace)) for d in (disk, *other_ranks) if d]
        self._rank_pools = [pool, *rank_pools]  # rank i's page bytes, by the same index
        self._reads: dict[OffloadKey, Future[list[bytes] | None]] = {}  # promotions in flight
        self._down_until = 0.0  # the persistent tier failed: every lookup misses until then
        self._held: dict[OffloadKey, None] = {}  # hits of this step, pinned to its end
        self._reader = (
            ThreadPoolExecutor(1, thread_name_prefix="kvlife-promote") if self.holds_bytes else None
        )
        self._live: set[Lifecycle] = set()  # not yet released (each on its ReqContext)
        # Per key, the jobs in flight that name it, oldest first (two identical loads: two).
        self._stores: dict[OffloadKey, _Job] = {}
        self._loads: dict[OffloadKey, list[_Job]] = {}
        self._order: dict[Lifecycle, _Seen] = {}  # keys per life, first use first
        self._on_release = self._released  # one bound method for every Lifecycle
        self.counts = _Counts()
        self._last_stats: dict[str, float] | None = None
        self._flush_steps = 0  # steps until a reset's orphans are free (vLLM 0.32)
        self._shut = False
        _LIVE_MANAGERS.add(self)

    def metrics(self) -> ManagerMetrics:
        """The core's metrics record, read now from any thread (O(1) counts; the live
        Lifecycles copied in one C call): the fields ``OffloadManager`` has, so one
        collector (:class:`~kvlife.metrics.ManagerCollector`) exposes both."""
        c, counts, disk = self.tier.counts, self.counts, self._disk
        by_state = Counter(lifecycle.state.name for lifecycle in tuple(self._live))
        by_state[State.RELEASED.name] = counts.lifecycles_released
        offloaded = c.stored - counts.promoted
        return ManagerMetrics(
            lifecycles_started=counts.lifecycles_started,
            lifecycles_by_state=dict(by_state),
            chunks_submitted=offloaded + counts.store_failed + c.pending,
            chunks_in_flight=c.pending,
            chunks_acked=offloaded + counts.store_failed,
            pages_offloaded=offloaded,
            bytes_offloaded=offloaded * self._page_bytes,
            store_writes_pending=disk.pending if disk is not None else 0,
            host_pages_used=self.pool.num_used,
            host_pool_exhausted=c.no_room,
            store_failures=counts.store_failed,
            loads_started=counts.loads_started,
            pages_loaded=counts.loaded,
            pages_promoted=counts.promoted,
            lookups_pending=counts.lookups_pending,
            host_tier_keys=c.entries,
            host_tier_evicted=c.evicted,
            refused_events=self.refusals.snapshot(),
        )

    def accounting(self) -> dict[str, int]:
        """Counters and gauges, for tests, metrics and the shutdown report (O(1) reads)."""
        c = self.tier.counts
        return {
            "host_pages_used": self.pool.num_used,
            "host_keys": c.entries,
            "pending": c.pending,
            "pinned": c.pinned,
            "evictable": c.evictable,
            "orphans": c.orphans,
            "expired": c.expired,
            "live_lifecycles": len(self._live),
            "stored": c.stored,
            "evicted": c.evicted,
            "dropped_host_full": c.no_room,
            "refused": self.refusals.total,
            **asdict(self.counts),
        }

    def _refuse(self, kind: str, message: str) -> None:
        self.refusals.refuse(kind, ManagerError(message))

    def _event(self, what: str, event: Callable[..., _T], *args: Any) -> _T | None:
        """A Lifecycle event; refused (nothing changed): counted, or raised with strict."""
        try:
            return event(*args)
        except LifecycleError as exc:
            self.refusals.refuse(f"{what}:{type(exc).__name__}", exc)
            return None

    def _life(self, ctx: ReqContext, what: str) -> Lifecycle:
        lifecycle: Lifecycle | None = ctx.get_state(Lifecycle)
        if lifecycle is None:  # a call for a request vLLM never started with us
            self._refuse(f"{what}:untracked_request", f"request {ctx.req_id} was never started")
            self.on_new_request(ctx)
            lifecycle = cast(Lifecycle, ctx.get_state(Lifecycle))
        return lifecycle

    def _seen(
        self,
        lifecycle: Lifecycle,
        keys: Iterable[OffloadKey],
        ctx: ReqContext,
        stored: Collection[OffloadKey] = (),
    ) -> None:
        """The life used ``keys``: remembered for its finish; each one vLLM gave a token
        position is ranked by it now, under the request's rank (tail below head): raised
        to it, or set to it for the keys this request just ``stored``."""
        seen = self._order.get(lifecycle)
        if seen is None:
            return
        new = [key for key in keys if key not in seen.keys]
        seen.keys.update(dict.fromkeys(new))
        for keys_, lower in ((new, False), (stored, True)):
            ranks = []
            for key in keys_:
                position = ctx.get_offload_key_position(key)
                if position is not None:
                    if seen.rank is None:
                        seen.rank = self.tier.new_rank()[0]
                    ranks.append((key, (seen.rank, -position)))
            if ranks:
                self.tier.rank(ranks, lower=lower)

    def _settle(self, job: _Job | None) -> None:
        """One key of ``job`` completed; its ticket is acked with the last one."""
        if job is None:
            return
        job.left -= 1
        if not job.left and job.ticket is not None:
            self._event("complete", job.lifecycle.ack, job.ticket)

    def _released(self, lifecycle: Lifecycle) -> None:
        self._live.discard(lifecycle)
        self._order.pop(lifecycle, None)
        self.counts.lifecycles_released += 1

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        lifecycle = Lifecycle(
            req_context.req_id, page_size=1, hasher=_hex_keys, on_release=self._on_release
        )
        req_context.set_state(lifecycle)
        self._live.add(lifecycle)
        self._order[lifecycle] = _Seen()
        self.counts.lifecycles_started += 1
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Recency from the finish (vLLM 0.34 has no touch): the request's keys, head to
        tail per KV cache group, become the most recent with the tail ranked first, the
        ones still being stored or loaded too (they go idle at that rank)."""
        lifecycle: Lifecycle | None = req_context.get_state(Lifecycle)
        if lifecycle is None:
            return
        seen = self._order.get(lifecycle)
        if seen is not None and lifecycle.finish_reason is None:
            self.tier.finished(_prefix_order(seen.keys, req_context))
        self._event("finish", lifecycle.finish, FinishReason.FINISHED)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self.tier.lookup(key)
        if found is Lookup.HIT:
            if self.holds_bytes and key not in self._held:
                # Held to the step's end: a later promotion in this step never evicts a hit
                # before its prepare_load (which comes in the same step) pins it.
                self._held[key] = None
                self.tier.pin([key])
            return LookupResult.HIT
        if found is Lookup.PENDING:
            self.counts.lookups_pending += 1
            return LookupResult.HIT_PENDING
        if self._disk is None or (self._down_until and time.monotonic() < self._down_until):
            return LookupResult.MISS  # no persistent tier, or it is down: recompute, ask later
        if self._reader is None:  # the bytes live in the workers: each reads its rank's page
            try:
                every = all(rank.contains(name(key)) for rank, name in self._ranks)
            except StoreError as exc:
                self._tier_down(exc)
                return LookupResult.MISS
            return LookupResult.HIT if every else LookupResult.MISS
        read = self._reads.get(key)
        if read is None:
            disk, name = self._ranks[0]
            if isinstance(disk, LocalDirectoryStore) and not os.path.exists(disk.path(name(key))):
                return LookupResult.MISS  # a stat: most misses stop here (else the read tells)
            self._reads[key] = self._reader.submit(self._read_pages, key)
        if read is None or not read.done():  # the next lookup (or a later one) finds it ready
            self.counts.lookups_pending += 1
            return LookupResult.HIT_PENDING
        del self._reads[key]
        if not self._promoted(key, read):
            return LookupResult.MISS
        self._held[key] = None
        self.tier.pin([key])
        return LookupResult.HIT

    def _tier_down(self, exc: StoreError) -> None:
        """The persistent tier failed to answer: every lookup is a miss for a while (vLLM
        recomputes) rather than each one waiting for the cluster's timeout."""
        self.counts.store_unavailable += 1
        self._down_until = time.monotonic() + _DOWN_SECONDS
        if self.counts.store_unavailable == 1:
            logger.warning("kvlife: persistent tier unavailable (%r); lookups miss", exc)

    def _read_pages(self, key: OffloadKey) -> list[bytes] | None:
        """Every rank's page of ``key``, each whole and verified (the reader thread); None
        at the first rank that lacks it."""
        pages = []
        for store, name in self._ranks:
            payload = store.get(name(key))
            if payload is None:
                return None
            pages.append(payload)
        return pages

    def _promoted(self, key: OffloadKey, read: Future[list[bytes] | None]) -> bool:
        """A finished read of ``key``'s pages: a ready host entry if each rank's is whole
        and verified (written into every rank's host page)."""
        try:
            payloads = read.result()
        except StoreError as exc:  # the cluster did not answer: a miss, and a pause
            self._tier_down(exc)
            payloads = None
        except Exception:  # an I/O error: a miss like any unreadable page
            payloads = None
        if not promote_pages(self.tier, key, self._rank_pools, payloads, pin=False):
            self.counts.promote_misses += 1  # damaged or gone since the lookup, or no room
            return False
        self.counts.promoted += 1
        return True

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        lifecycle = self._life(req_context, "load")
        ordered = keys if type(keys) is list else list(keys)
        tier = self.tier
        pages: list[int] = []
        for key in ordered:
            if tier.lookup(key) is Lookup.HIT:
                pages += tier.pin_ready([key])
            else:
                if self.holds_bytes:  # promoted at lookup, evicted since: read in the worker
                    self._refuse("load:evicted_since_lookup", f"key {key.hex()[:16]} left")
                pages.append(FROM_STORE)
                self.counts.loaded_from_store += 1
        self.counts.loads_started += 1
        ticket = self._event("load", lifecycle.load, _hex_keys(ordered, 1, None))
        job = _Job(lifecycle, ticket, len(ordered))
        for key in ordered:
            self._loads.setdefault(key, []).append(job)
        if all(req_context.get_offload_key_position(k) is None for k in ordered):
            tier.touch(ordered)  # no positions (vLLM 0.32's touch order): head most recent
        self._seen(lifecycle, ordered, req_context)
        return HostBlocksSpec(pages, ordered)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """vLLM 0.32's recency call (0.34 has none: recency comes from the finish)."""
        ordered = keys if isinstance(keys, Sequence) else list(keys)
        self.tier.touch(ordered)
        lifecycle: Lifecycle | None = req_context.get_state(Lifecycle)
        if lifecycle is not None:
            self._seen(lifecycle, ordered, req_context)

    def complete_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext, **kwargs: Any
    ) -> None:
        lifecycle: Lifecycle | None = req_context.get_state(Lifecycle)
        tier, loads = self.tier, self._loads
        for key in keys:
            jobs = loads.get(key)
            if not jobs:
                self._refuse("complete_load:unknown_key", f"no load of key {key.hex()[:16]}")
                continue
            # The request's own load of this key, oldest first; else the oldest one.
            job = next((j for j in jobs if j.lifecycle is lifecycle), jobs[0])
            jobs.remove(job)
            if not jobs:
                del loads[key]
            entry = tier.entry(key)
            if entry is not None and entry.pins:
                tier.complete_load([key])  # a FROM_STORE block has no pin to drop
            self.counts.loaded += 1
            self._settle(job)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        offered = list(keys)
        # More keys than the tier: store the leading ones, and evict none of the rest (a
        # held key the same call offers stays, as in vLLM's CPU manager).
        rest = offered[self.tier.capacity :]
        del offered[self.tier.capacity :]
        plan = self.tier.prepare_store(offered, protected=rest)
        if plan is None:
            return None
        lifecycle = self._life(req_context, "store")
        new = plan.keys
        self._seen(lifecycle, offered, req_context, new)
        if new:
            ticket = self._event("store", lifecycle.submit, new)
            job = _Job(lifecycle, ticket, len(new))
            for key in new:
                self._stores[key] = job
        return PrepareStoreOutput(
            keys_to_store=new, store_spec=HostBlocksSpec(plan.pages, new), evicted_keys=plan.evicted
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        stores, tier = self._stores, self.tier
        ours = []
        for key in keys:
            if key in stores:
                ours.append(key)
            # A key already ready (a completion naming more of the offer than it stored)
            # has nothing to settle: a no-op, as in vLLM's CPU manager. Others are refused.
            elif tier.lookup(key) is not Lookup.HIT:
                self._refuse("complete_store:unknown_key", f"no store of key {key.hex()[:16]}")
        if not ours:
            return
        # A failed store (vLLM 0.34 reports them) is dropped: never announced, page freed.
        tier.complete_store(ours, success=success, source=req_context)
        if not success:
            self.counts.store_failed += len(ours)
        for key in ours:
            self._settle(stores.pop(key))

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self.tier.take_events():
            extra: dict[str, Any] = {}
            if not event.removed:  # vLLM 0.34: the storing request; a later removal expected
                if _STORED_EXTRAS and isinstance(event.source, ReqContext):
                    extra["req_context"] = event.source
                if _REMOVAL_EXPECTED:
                    extra["removal_expected"] = True
            yield OffloadingEvent(
                keys=list(event.keys), medium=_CPU, removed=event.removed, **extra
            )

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """vLLM 0.33+: held by the connector around every call. Only the scheduler thread
        enters this manager (the promotion reader returns futures it reads; metrics read
        plain counts), so no lock is needed: a no-op, as vLLM's default."""
        return nullcontext()

    def config_info(self) -> Sequence[Mapping[str, str | int | float | bool]]:
        """vLLM 0.33+: the static facts of ``vllm:kv_offload_config_info``, one series (the
        spec's ``config_info_keys`` names which labels vLLM publishes)."""
        tier = type(self._disk).__name__ if self._disk is not None else "None"
        values = ("kvlife", self.tier.capacity, self._page_bytes, tier, self.holds_bytes)
        return [dict(zip(CONFIG_INFO_KEYS, values, strict=True))]

    def has_pending_work(self) -> bool:
        return bool(self._stores or self._loads or self._flush_steps)

    def on_schedule_end(self, context: Any) -> None:
        self.counts.preemptions += len(context.preempted_req_ids)
        self._unhold()
        self.tier.expire()
        if self._flush_steps:  # vLLM 0.32: the reset's flush ran by the second step's end
            self._flush_steps -= 1
            if not self._flush_steps:
                self.tier.abandon()

    def _unhold(self) -> None:
        held, self._held = self._held, {}
        if held:
            self.tier.unpin(list(held))

    def _abandon_jobs(self) -> None:
        """Ack every job vLLM will never complete (reset or shutdown); pins and pending go."""
        jobs = {id(job): job for job in self._stores.values()}
        for pending in self._loads.values():
            jobs.update((id(job), job) for job in pending)
        self._stores, self._loads = {}, {}
        self.counts.abandoned_jobs += len(jobs)
        for job in jobs.values():
            if job.ticket is not None:
                self._event("abandon", job.lifecycle.ack, job.ticket)

    def reset_cache(self) -> None:
        """vLLM dropped its offloaded state: no complete_* will come for jobs begun before.

        Entries a job may still copy (a store writing, a load reading) become orphans: not
        hits, their pages held, never handed to a store or a promotion, until the workers
        have flushed those jobs. vLLM 0.33+ says so (:meth:`on_reset_flushed`); vLLM 0.32
        sends the flush with the next step's metadata and the workers wait on it before
        that step's copies, so the orphans are freed at the end of the second scheduled step
        after the reset (by then the first one's flush ran)."""
        self._abandon_jobs()
        self._unhold()
        for seen in self._order.values():  # a request's ranks and uses end with the cache
            seen.keys.clear()
            seen.rank = None
        self.tier.reset()
        self._flush_steps = _FLUSH_STEPS if self.tier.counts.orphans else 0
        self._reads.clear()  # a read still running finishes into nothing

    def on_reset_flushed(self) -> None:
        """vLLM 0.33+: every job begun before the reset is over; its orphans' pages are free."""
        self._flush_steps = 0
        self.tier.abandon()

    def _stat_values(self) -> dict[str, float]:
        """Every metric of :data:`METRICS`, by its name."""
        c, counts = self.tier.counts, self.counts
        return {
            "vllm:kvlife_stored_blocks": c.stored,
            "vllm:kvlife_loaded_blocks": counts.loaded,
            "vllm:kvlife_loaded_from_store_blocks": counts.loaded_from_store,
            "vllm:kvlife_promoted_blocks": counts.promoted,
            "vllm:kvlife_promote_misses": counts.promote_misses,
            "vllm:kvlife_evicted_blocks": c.evicted,
            "vllm:kvlife_dropped_host_full": c.no_room,
            "vllm:kvlife_refused": self.refusals.total,
            "vllm:kvlife_pending_blocks": c.pending,
            "vllm:kvlife_host_usage_perc": self.pool.num_used / self.tier.capacity,
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        now = self._stat_values()
        last = self._last_stats
        if now == last:
            return None
        stats = OffloadingConnectorStats()
        for name, (kind, _) in METRICS.items():
            if kind == "gauge":
                stats.set_gauge(name, now[name])
            elif delta := now[name] - (0 if last is None else last[name]):
                stats.increase_counter(name, delta)
        self._last_stats = now
        return stats

    def shutdown(self) -> None:
        """Finish every Lifecycle left (vLLM never signals the last batch), then drain."""
        if self._shut:
            return
        self._shut = True
        steps: list[tuple[str, Callable[[], object]]] = [
            ("finish", self._finish_all),
            ("abandon", self._abandon_jobs),
            ("unhold", self._unhold),
        ]
        reader, report_dir = self._reader, self._report_dir
        if reader is not None:
            steps.append(("reader", lambda: reader.shutdown(wait=True, cancel_futures=True)))
        steps += [("store_close", rank.close) for rank, _ in self._ranks]
        if report_dir is not None:
            name = f"manager-{os.getpid()}.json"
            steps.append(("report", lambda: _write_report(report_dir, name, self.accounting())))
        errors = shut_down("manager", steps)
        self.counts.shutdown_errors += len(errors)
        if errors and self.refusals.strict:
            raise errors[0]

    def _finish_all(self) -> None:
        for lifecycle in list(self._live):
            if lifecycle.finish_reason is None:
                self.counts.finished_at_shutdown += 1
                self._event("finish", lifecycle.finish, FinishReason.ABORTED)


_LIVE_MANAGERS: _Live[KVLifeOffloadingManager] = _Live()


def live_managers() -> list[KVLifeOffloadingManager]:
    """The managers alive in this process (single-process vLLM: the engine's)."""
    return _LIVE_MANAGERS.members()
