"""kvlife as vLLM's KV offloading backend, ``KVLifeOffloadingSpec`` (vLLM 0.32).

Switch it on with ``LLM(..., kv_transfer_config=transfer_config(host_bytes, ...))``.
:class:`KVLifeOffloadingManager` runs on the scheduler: it decides and copies nothing,
hands out host page indices, and gives each request a :class:`~kvlife.Lifecycle`
whose stores and loads are jobs, found again by (Lifecycle, key set) when vLLM
completes them. :class:`KVLifeWorker` holds the bytes and copies through a kvlife
copy engine, one Lifecycle and one ``TransferResult`` per job. The rules, keys, call
sequence, process layouts, persistent tier and metrics are in ``docs/vllm.md``.
Limits: one KV cache group (plain attention models), ``blocks_per_chunk`` 1.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

# vLLM is an optional dependency: mypy runs without it, hence the ignores.
from vllm.config import KVTransferConfig  # type: ignore[import-not-found]
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # type: ignore[import-not-found]
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)

from kvlife import FinishReason, Lifecycle, LoadTicket, Ticket
from kvlife.engine import (
    Ack,
    CpuCopyEngine,
    CpuCopyEvent,
    CudaCopyEngine,
    EngineError,
    PageBusy,
    UnallocatedHostPage,
    host_runs,
)
from kvlife.errors import ConfigError, KVLifeError, LifecycleError, ManagerError, StoreError
from kvlife.host_tier import HostTier, Lookup
from kvlife.layout import KVLayout
from kvlife.pool import HostPagePool
from kvlife.refusals import Refusals
from kvlife.store.directory import LocalDirectoryStore

__all__ = [
    "METRICS",
    "HostBlocksSpec",
    "KVLifeOffloadingManager",
    "KVLifeOffloadingSpec",
    "KVLifeWorker",
    "OffloadCollector",
    "live_managers",
    "live_workers",
    "store_namespace",
    "transfer_config",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def _hex_keys(tokens: Sequence[object], page_size: int, prior: str | None) -> list[str]:
    """The backend Lifecycles' hasher: vLLM names each block by its own ``OffloadKey``
    (bytes); a Lifecycle records keys as hex ``str`` (one key type per ticket)."""
    return [key.hex() for key in tokens]  # type: ignore[attr-defined]


#: ``Lifecycle.submit`` typed for a chunk named by vLLM's keys (the hasher above).
_start_store = cast("Callable[[Lifecycle, Sequence[object]], Ticket]", Lifecycle.submit)


class HostBlocksSpec(LoadStoreSpec):  # type: ignore[misc]
    """A job's host side: ``block_ids[i]`` is block ``i``'s host page (or ``FROM_STORE``),
    ``keys[i]`` its vLLM key. Only the worker reads it: plain lists, no array."""

    __slots__ = ("block_ids", "keys")

    def __init__(self, block_ids: list[int], keys: list[OffloadKey]) -> None:
        self.block_ids = block_ids
        self.keys = keys

    def __repr__(self) -> str:
        return f"HostBlocksSpec({self.block_ids!r})"


#: Host page of a block that a load reads from the persistent tier.
FROM_STORE = -1

_CPU = Medium.CPU  # the medium of the host tier's KV events

#: Metric name -> (kind, documentation). Counters are deltas per ``get_stats``.
METRICS: dict[str, tuple[str, str]] = {
    "vllm:kvlife_stored_blocks": ("counter", "Blocks whose store to the host tier completed."),
    "vllm:kvlife_loaded_blocks": ("counter", "Blocks loaded back to the device."),
    "vllm:kvlife_loaded_from_store_blocks": (
        "counter",
        "Blocks loaded from the persistent tier (host miss).",
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

#: The counter metrics' names and the manager's counts they report (``_Counts`` fields).
_COUNTER_NAMES = tuple(name for name, (kind, _) in METRICS.items() if kind == "counter")
_COUNTED = ("stored", "loaded", "loaded_from_store", "evicted", "dropped_host_full", "refused")

# ----------------------------------------------------------------------------- scheduler side


class _Job:
    """One prepared store or load of one request life: its ticket and the keys not yet
    completed (vLLM completes per key: any subset, any grouping)."""

    __slots__ = ("left", "lifecycle", "ticket")

    def __init__(self, lifecycle: Lifecycle, ticket: Ticket | LoadTicket | None, left: int) -> None:
        self.lifecycle = lifecycle
        self.ticket = ticket
        self.left = left


@dataclass(slots=True)
class _Counts:
    """The backend's own counts; the host tier's are in ``HostTier.counts``."""

    loaded: int = 0
    loaded_from_store: int = 0
    store_failed: int = 0
    abandoned_jobs: int = 0
    lifecycles_started: int = 0
    lifecycles_released: int = 0
    finished_at_shutdown: int = 0
    preemptions: int = 0  # requests vLLM preempted (seen at the end of each step)


_LIVE_MANAGERS: weakref.WeakSet[KVLifeOffloadingManager] = weakref.WeakSet()
_LIVE_WORKERS: weakref.WeakSet[KVLifeWorker] = weakref.WeakSet()


def transfer_config(host_bytes: int, **extra: Any) -> KVTransferConfig:
    """vLLM's ``kv_transfer_config`` that switches kvlife on: the offloading connector
    with this spec, a host tier of ``host_bytes`` and any other extra-config keys."""
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "KVLifeOffloadingSpec",
            "spec_module_path": "kvlife.integrations.vllm",
            "host_bytes": host_bytes,
            **extra,
        },
    )


def live_managers() -> list[KVLifeOffloadingManager]:
    """The managers alive in this process (single-process vLLM: the engine's)."""
    return list(_LIVE_MANAGERS)


def live_workers() -> list[KVLifeWorker]:
    """The workers alive in this process."""
    return list(_LIVE_WORKERS)


class KVLifeOffloadingManager(OffloadingManager):  # type: ignore[misc]
    """vLLM's scheduler-side manager on kvlife's :class:`~kvlife.host_tier.HostTier`: the
    tier holds the keys, pins and recency; each request life is a :class:`~kvlife.Lifecycle`
    whose stores and loads are tickets, settled key by key as vLLM completes them.
    ``pool``: the host tier's pages (the worker's in one process, else an allocator only);
    ``disk``: the persistent tier, read side, or None."""

    def __init__(
        self,
        pool: HostPagePool,
        *,
        strict: bool = False,
        disk: LocalDirectoryStore | None = None,
        report_dir: str | None = None,
        pending_timeout: float | None = None,
    ) -> None:
        self.refusals = Refusals(strict=strict, logger=logger)
        self.tier: HostTier[OffloadKey] = HostTier(
            pool, keep=True, pending_timeout=pending_timeout, refusals=self.refusals
        )
        self._pool = pool
        self._strict = strict
        self._disk = disk
        self._report_dir = report_dir
        self._on_disk: set[OffloadKey] = set()  # keys verified in the persistent tier
        self._live: set[Lifecycle] = set()  # not yet released (each on its ReqContext)
        # Per key, the jobs in flight that name it, oldest first (two identical loads: two).
        self._stores: dict[OffloadKey, _Job] = {}
        self._loads: dict[OffloadKey, list[_Job]] = {}
        self._order: dict[Lifecycle, dict[OffloadKey, None]] = {}  # keys per life, seen order
        self._on_release = self._released  # one bound method for every Lifecycle
        self.counts = _Counts()
        self._last_stats: tuple[int, ...] | None = None
        self._shut = False
        _LIVE_MANAGERS.add(self)

    @property
    def pool(self) -> HostPagePool:
        """The host tier's pool (its allocator; its bytes too in single-process mode)."""
        return self._pool

    def accounting(self) -> dict[str, int]:
        """Counters and gauges, for tests, metrics and the shutdown report (O(1) reads)."""
        c = self.tier.counts
        return {
            "host_pages_used": self._pool.num_used,
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

    def _refuse(self, kind: str, message: str, exc: KVLifeError | None = None) -> None:
        self.refusals.refuse(kind, exc if exc is not None else ManagerError(message))

    def _event(self, what: str, event: Callable[..., _T], *args: Any) -> _T | None:
        """A Lifecycle event; refused (nothing changed): counted, or raised with strict."""
        try:
            return event(*args)
        except LifecycleError as exc:
            self._refuse(f"{what}:{type(exc).__name__}", str(exc), exc)
            return None

    def _life(self, ctx: ReqContext, what: str) -> Lifecycle:
        lifecycle: Lifecycle | None = ctx.get_state(Lifecycle)
        if lifecycle is None:  # a call for a request vLLM never started with us
            self._refuse(f"{what}:untracked_request", f"request {ctx.req_id} was never started")
            self.on_new_request(ctx)
            lifecycle = cast(Lifecycle, ctx.get_state(Lifecycle))
        return lifecycle

    def _seen(self, lifecycle: Lifecycle, keys: Iterable[OffloadKey]) -> None:
        order = self._order.get(lifecycle)
        if order is not None:
            order.update(dict.fromkeys(keys))

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
        self._order[lifecycle] = {}
        self.counts.lifecycles_started += 1
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        lifecycle: Lifecycle | None = req_context.get_state(Lifecycle)
        if lifecycle is None:
            return
        keys = list(self._order.get(lifecycle, ()))
        positions = [req_context.get_offload_key_position(k) for k in keys]
        if keys and None not in positions:  # vLLM knows each key's place in the prefix
            keys = [k for _, k in sorted(zip(positions, keys, strict=True), key=lambda p: p[0])]
        self.tier.finished(keys)  # the tail goes first: what stays is reachable
        self._event("finish", lifecycle.finish, FinishReason.FINISHED)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self.tier.lookup(key)
        if found is Lookup.HIT:
            return LookupResult.HIT
        if found is Lookup.PENDING:
            return LookupResult.HIT_PENDING
        if self._disk is not None:
            if key in self._on_disk:
                return LookupResult.HIT
            if self._disk.contains(key.hex()):  # whole and verified, or a miss
                self._on_disk.add(key)
                return LookupResult.HIT
        return LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        lifecycle = self._life(req_context, "load")
        ordered = keys if type(keys) is list else list(keys)
        tier = self.tier
        pages: list[int] = []
        hit: list[OffloadKey] = []
        for key in ordered:
            if tier.lookup(key) is Lookup.HIT:
                pinned = tier.prepare_load([key])
                pages.append(pinned[0] if pinned else FROM_STORE)
                hit.append(key)
            else:
                if key not in self._on_disk:  # lookup said HIT: unreachable by design
                    self._refuse("load:no_source", f"key {key.hex()[:16]} is on no tier")
                pages.append(FROM_STORE)
                self.counts.loaded_from_store += 1
        ticket = self._event("load", lifecycle.load, [key.hex() for key in ordered])
        job = _Job(lifecycle, ticket, len(ordered))
        for key in ordered:
            self._loads.setdefault(key, []).append(job)
        self._seen(lifecycle, ordered)
        tier.touch(ordered)
        return HostBlocksSpec(pages, ordered)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        ordered = keys if isinstance(keys, Sequence) else list(keys)
        self.tier.touch(ordered)
        lifecycle: Lifecycle | None = req_context.get_state(Lifecycle)
        if lifecycle is not None:
            self._seen(lifecycle, ordered)

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
        del offered[self.tier.capacity :]  # more keys than the tier: store the leading ones
        plan = self.tier.prepare_store(offered)
        if plan is None:
            return None
        lifecycle = self._life(req_context, "store")
        self._seen(lifecycle, offered)
        new = plan.keys
        if new:
            ticket = self._event("store", _start_store, lifecycle, new)
            job = _Job(lifecycle, ticket, len(new))
            for key in new:
                self._stores[key] = job
        return PrepareStoreOutput(
            keys_to_store=new, store_spec=HostBlocksSpec(plan.pages, new), evicted_keys=plan.evicted
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        named = list(keys)
        ours = [key for key in named if key in self._stores]
        for key in named:
            if key not in self._stores:
                self._refuse("complete_store:unknown_key", f"no store of key {key.hex()[:16]}")
        if not ours:
            return
        self.tier.complete_store(ours, success=success)
        if not success:
            self.counts.store_failed += len(ours)
        for key in ours:
            self._settle(self._stores.pop(key))

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self.tier.take_events():
            yield OffloadingEvent(keys=list(event.keys), medium=_CPU, removed=event.removed)

    def has_pending_work(self) -> bool:
        return bool(self._stores or self._loads)

    def on_schedule_end(self, context: Any) -> None:
        self.counts.preemptions += len(context.preempted_req_ids)
        self.tier.expire()

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
        """vLLM dropped its offloaded state: no complete_* will come for jobs begun before."""
        self._abandon_jobs()
        self.tier.reset()
        self.tier.abandon()
        self._on_disk.clear()

    def get_stats(self) -> OffloadingConnectorStats | None:
        books = self.accounting()
        now = (*(books[name] for name in _COUNTED), books["pending"], self._pool.num_used)
        last = self._last_stats
        if now == last:
            return None
        stats = OffloadingConnectorStats()
        # The counters lead ``now``: zip stops at the last of their names.
        for name, value, old in zip(_COUNTER_NAMES, now, last or (0,) * len(now), strict=False):
            if value != old:
                stats.increase_counter(name, value - old)
        stats.set_gauge("vllm:kvlife_pending_blocks", now[-2])
        stats.set_gauge("vllm:kvlife_host_usage_perc", now[-1] / self.tier.capacity)
        self._last_stats = now
        return stats

    def shutdown(self) -> None:
        """Finish every Lifecycle left (vLLM never signals the last batch), then drain."""
        if self._shut:
            return
        self._shut = True
        for lifecycle in list(self._live):
            if lifecycle.finish_reason is None:
                self.counts.finished_at_shutdown += 1
                self._event("finish", lifecycle.finish, FinishReason.ABORTED)
        self._abandon_jobs()
        if self._disk is not None:
            self._disk.close()
        if self._report_dir is not None:
            _write_report(self._report_dir, f"manager-{os.getpid()}.json", self.accounting())


# ----------------------------------------------------------------------------- worker side


def _block_views(kv_caches: CanonicalKVCaches) -> list[torch.Tensor]:
    """vLLM's block views of the one KV cache group, each tensor once."""
    indices = dict.fromkeys(ref.tensor_idx for ref in kv_caches.group_data_refs[0])
    return [kv_caches.tensors[i].tensor for i in indices]


class BlockViewsLayout(KVLayout):
    """vLLM's KV cache as a kvlife layout: block ``b`` is row ``b`` of every view, vLLM's
    per-layer ``(num_blocks, page_bytes)`` int8 views (strided, each row contiguous)."""

    def __init__(self, views: Sequence[torch.Tensor], tokens_per_block: int = 1) -> None:
        # KVLayout checks the rest: at least one, 2-D, contiguous rows, one block count.
        for view in views:
            if view.dtype != torch.int8:
                raise ConfigError(f"kvlife: expected int8 block views, got {view.dtype}")
        super().__init__(views, page_size=tokens_per_block)
        #: vLLM's block views, one per layer (or per tensor layers share): the page rows.
        self.views = self.buffers()


@dataclass(slots=True)
class _WorkerJob:
    """One vLLM transfer job on the worker: its own Lifecycle, one result when it releases."""

    job_id: int
    load: bool
    blocks: int
    started: float
    event: CpuCopyEvent | torch.cuda.Event | None = None
    copy_done: float = 0.0
    #: A copy of the job could not be made, even directly: its result says so.
    failed: bool = False


class KVLifeWorker(OffloadingWorker):  # type: ignore[misc]
    """Copies blocks between vLLM's KV cache and host page rows through a kvlife copy
    engine. Each job's Lifecycle is finished at submit; the engine acks its chunks and
    its one release is the job's one ``TransferResult``."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        pool: HostPagePool,
        *,
        store: LocalDirectoryStore | None = None,
        report_dir: str | None = None,
        pool_key: str | None = None,
        tokens_per_block: int = 1,
    ) -> None:
        layout = BlockViewsLayout(_block_views(kv_caches), tokens_per_block)
        if pool.page_numel != layout.page_numel or pool.dtype != torch.int8:
            raise ConfigError(
                f"host pages of {pool.page_numel} {pool.dtype} cannot hold a block of "
                f"{layout.page_numel} B"
            )
        self.layout = layout
        self.row_bytes = layout.page_numel
        engine = CudaCopyEngine if layout.device.type == "cuda" else CpuCopyEngine
        self.engine: CpuCopyEngine | CudaCopyEngine = engine(layout, pool)
        self._pool = pool
        self._store = store
        self._report_dir = report_dir
        self._pool_key = pool_key
        self._pages_claimed = False
        self._jobs: dict[int, _WorkerJob] = {}  # job id -> job in flight
        self._by_life: dict[Lifecycle, _WorkerJob] = {}  # the same jobs, by their Lifecycle
        self._finished: list[TransferResult] = []
        self._shut = False
        self.stats: Counter[str] = Counter()
        self.seconds: dict[str, float] = {"store": 0.0, "load": 0.0}
        _LIVE_WORKERS.add(self)

    @property
    def pool(self) -> HostPagePool:
        """The host tier this worker copies into and out of."""
        return self._pool

    @property
    def inflight(self) -> int:
        """Jobs submitted whose result was not yet handed to vLLM's ``get_finished``."""
        return len(self._jobs)

    def _error_once(self, kind: str, message: str) -> None:
        self.stats[kind] += 1
        if self.stats[kind] == 1:
            logger.error("kvlife worker: %s (%s); counted, logged once", kind, message)

    def _unshare(self) -> bool:
        """Take the pool back from ``_SHARED_POOLS`` if no manager of this process took it."""
        key = self._pool_key
        if key is not None and _SHARED_POOLS.get(key) is self._pool:
            del _SHARED_POOLS[key]
            return True
        return False

    def _start(self, job_id: int, load: bool, blocks: int) -> tuple[_WorkerJob, Lifecycle]:
        if not self._pages_claimed:  # the first job
            self._pages_claimed = True
            # No manager here took the pool (vLLM's multiprocess mode; or no pool key): the
            # scheduler allocates page indices elsewhere and this worker owns every page
            # (the engine copies only allocated pages).
            if (self._unshare() or self._pool_key is None) and self._pool.num_free:
                self._pool.alloc(self._pool.num_free, self)
        if job_id in self._jobs:  # vLLM reused a job id in flight: both still get results
            self._error_once("job_id_in_flight", f"job {job_id} submitted while in flight")
        job = _WorkerJob(job_id, load, blocks, time.perf_counter())
        lifecycle = Lifecycle(
            job_id, page_size=1, hasher=_hex_keys, on_release=partial(self._released, job)
        )
        self._jobs[job_id] = job
        self._by_life[lifecycle] = job
        return job, lifecycle

    def _submit(
        self, job: _WorkerJob, ticket: Ticket | LoadTicket, device: list[int], host: list[int]
    ) -> None:
        """Hand one chunk to the engine; a chunk it refuses is acked here, counted."""
        engine = self.engine
        try:
            try:
                job.event = engine.submit(ticket, device, host)
            except PageBusy:  # in use by an earlier copy (after a reset or an abort): wait
                self.stats["engine_busy_waits"] += 1
                self._collect(engine.drain())
                job.event = engine.submit(ticket, device, host)
        except UnallocatedHostPage as exc:
            # vLLM reset the offloaded cache (the manager freed the pages) before it
            # submitted this stale job; its result is ignored, nothing reads the pages.
            self.stats["stale_jobs_skipped"] += 1
            logger.debug("kvlife worker: job %d skipped (%s)", job.job_id, exc)
            ticket[0].ack(ticket)
        except EngineError as exc:
            self._error_once("copy_refused", repr(exc))
            self._copy_directly(job, device, host)
            ticket[0].ack(ticket)

    def _copy_directly(
        self, job: _WorkerJob, device_pages: Sequence[int], host_pages: Sequence[int]
    ) -> None:
        """The copy the engine failed or refused, made here, at once; if this fails too,
        the job's result is a failure (vLLM 0.32 then stops rather than use the blocks)."""
        pages = torch.tensor(list(device_pages), dtype=torch.int64, device=self.layout.device)
        runs = host_runs(host_pages)
        try:
            if job.load:
                self.layout.scatter_runs(pages, self._pool.tensor, runs)
            else:
                self.layout.gather_runs(pages, self._pool.tensor, runs)
        except Exception as exc:
            job.failed = True
            self._error_once("copy_failed_twice", repr(exc))
            return
        self.stats["copies_made_directly"] += 1

    def _released(self, job: _WorkerJob, lifecycle: Lifecycle) -> None:
        """The job's Lifecycle released: every copy of the job is over. Its one result."""
        if self._jobs.get(job.job_id) is job:  # not a later job that reused the id
            del self._jobs[job.job_id]
        del self._by_life[lifecycle]
        elapsed = (job.copy_done or time.perf_counter()) - job.started
        self.stats["loaded_blocks" if job.load else "stored_blocks"] += job.blocks
        self.seconds["load" if job.load else "store"] += elapsed
        self._finished.append(
            TransferResult(job.job_id, not job.failed, job.blocks * self.row_bytes, elapsed)
        )

    def _collect(self, acks: Iterable[Ack]) -> None:
        """Ack each engine ack to its job's Lifecycle (never looked up by job id)."""
        for ack in acks:
            job = self._by_life.get(ack.lifecycle)
            if job is None:  # every ticket the engine holds is a job's: never raise in vLLM
                self._error_once("unknown_acks", repr(ack.ticket))
                continue
            job.copy_done = ack.completed_at
            if ack.error is not None:  # made again directly; a failure only if that fails
                self._error_once("copy_failures", repr(ack.error))
                self._copy_directly(job, ack.device_pages, ack.host_pages)
            if not ack.is_load and self._store is not None and not job.failed:
                try:  # a private copy: the host pages may be evicted before the write ends
                    pages = torch.tensor(ack.host_pages, dtype=torch.int64)
                    rows = self._pool.tensor.index_select(0, pages)
                    self._store.put(job.job_id, list(ack.keys), rows)
                except StoreError as exc:
                    self._error_once("store_put_refused", repr(exc))
            ack.lifecycle.ack(ack.ticket)

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec, **kwargs: Any
    ) -> bool:
        spec = cast(HostBlocksSpec, dst_spec)
        host_pages = list(spec.block_ids)
        job, lifecycle = self._start(job_id, False, len(host_pages))
        if host_pages:
            ticket = _start_store(lifecycle, spec.keys)
            self._submit(job, ticket, src_spec.block_ids.tolist(), host_pages)
        lifecycle.finish(FinishReason.FINISHED)
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, **kwargs: Any
    ) -> bool:
        spec = cast(HostBlocksSpec, src_spec)
        host_ids = spec.block_ids
        device_ids: list[int] = dst_spec.block_ids.tolist()
        job, lifecycle = self._start(job_id, True, len(device_ids))
        disk = [i for i, page in enumerate(host_ids) if page == FROM_STORE]
        if disk:
            names = [spec.keys[i].hex() for i in disk]
            ticket = lifecycle.load(names)
            self._load_from_store(job, names, [device_ids[i] for i in disk])
            lifecycle.ack(ticket)
        on_host = [i for i, page in enumerate(host_ids) if page != FROM_STORE]
        if on_host:
            ticket = lifecycle.load([spec.keys[i].hex() for i in on_host])
            self._submit(
                job, ticket, [device_ids[i] for i in on_host], [host_ids[i] for i in on_host]
            )
        lifecycle.finish(FinishReason.FINISHED)
        return True

    def _load_from_store(self, job: _WorkerJob, names: list[str], blocks: list[int]) -> None:
        """Read persistent-tier pages (verified) straight into device blocks, here: the
        engine copies only to and from host pool pages."""
        for name, block in zip(names, blocks, strict=True):
            payload = self._store.get(name) if self._store is not None else None
            self.stats["disk_reads"] += 1
            if payload is None or len(payload) != self.row_bytes:
                # Verified at lookup, gone or damaged since: the job fails (never decode on it).
                self._error_once("disk_load_errors", f"page {name[:16]} unreadable")
                job.failed = True
                continue
            row = torch.frombuffer(bytearray(payload), dtype=torch.int8)
            self.layout.write_page(block, row.to(self.layout.device))

    def _poll_store(self, results: Iterable[Any]) -> None:
        for result in results:
            if result.ok:
                self.stats["disk_pages_written"] += len(result.keys)
            else:
                self._error_once("disk_write_failures", repr(result.error))

    def get_finished(self) -> list[TransferResult]:
        self._collect(self.engine.poll())
        if self._store is not None:
            self._poll_store(self._store.poll())
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Block until the copies of ``job_ids`` are over (results: ``get_finished``)."""
        jobs = [self._jobs.get(job_id) for job_id in job_ids]
        events = [job.event for job in jobs if job is not None and job.event is not None]
        for event in events:
            event.synchronize()
        if events:
            self._collect(self.engine.poll())

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every copy is over and the persistent tier wrote every queued page."""
        self._collect(self.engine.drain(timeout))
        if self._store is not None:
            self._poll_store(self._store.drain(timeout))

    def shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True
        try:
            self._collect(self.engine.drain(timeout=60.0))
        except KVLifeError as exc:
            self._error_once("shutdown_drain", repr(exc))
        self.engine.close()
        self._unshare()
        if self._store is not None:
            self._store.close()
            self._poll_store(self._store.drain())
            self._store = None
        if self._report_dir is not None:
            report = {**self.stats, **{f"{k}_seconds": v for k, v in self.seconds.items()}}
            report["jobs_in_flight"] = len(self._jobs)
            _write_report(self._report_dir, f"worker-{os.getpid()}.json", report)


class OffloadCollector:
    """A ``prometheus_client`` collector of this process's kvlife roles, read at scrape
    time: ``REGISTRY.register(OffloadCollector())`` (its families: ``docs/vllm.md``)."""

    _GAUGES = ("pending", "pinned", "live_lifecycles", "host_pages_used")

    def describe(self) -> list[Any]:
        """No up-front description: the registry calls :meth:`collect` instead."""
        return []

    def collect(self) -> Iterator[Any]:
        """One family per figure, summed over this process's live managers and workers."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        books = [m.accounting() for m in live_managers()]
        for family_type, names in (
            (CounterMetricFamily, _COUNTED),
            (GaugeMetricFamily, self._GAUGES),
        ):
            for name in names:
                family = family_type(f"kvlife_vllm_{name}", f"kvlife vLLM backend: {name}")
                family.add_metric([], float(sum(b[name] for b in books)))
                yield family
        seconds = CounterMetricFamily(
            "kvlife_vllm_transfer_seconds", "Worker transfer time", labels=["direction"]
        )
        for direction in ("store", "load"):
            seconds.add_metric([direction], sum(w.seconds[direction] for w in live_workers()))
        yield seconds


def _write_report(directory: str, name: str, report: Mapping[str, Any]) -> None:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(json.dumps(dict(report), sort_keys=True))


# ----------------------------------------------------------------------------- the spec

#: Host pools built by a worker, for the manager of the same engine in the same process.
_SHARED_POOLS: dict[str, HostPagePool] = {}


def store_namespace(config: Any, model_id: str | None = None) -> str:
    """The persistent tier's namespace for one model, KV cache shape and parallel rank
    (``model_id`` overrides the model name/path); the rank is a second component."""
    identity = {
        "model": model_id if model_id is not None else config.model.name,
        "dtype": str(config.model.dtype),
        "kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tokens_per_block": [g.tokens_per_block for g in config.groups],
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "layout": config.kv_cache_layout,
        "layers": [list(g.layer_names) for g in config.groups],
        "parallel": [config.parallel.world_size, config.parallel.tp_size, config.parallel.pp_size],
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return f"vllm-{digest}/rank{config.parallel.rank}"


class KVLifeOffloadingSpec(OffloadingSpec):  # type: ignore[misc]
    """The vLLM offloading spec (see :func:`transfer_config`); its extra-config keys are
    in ``docs/vllm.md``."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        kinds = {"counter": OffloadingCounterMetadata, "gauge": OffloadingGaugeMetadata}
        return {name: kinds[kind](documentation=doc) for name, (kind, doc) in METRICS.items()}

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        extra = self.extra_config
        host_bytes = extra.get("host_bytes")
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes <= 0:
            raise ConfigError(
                "kvlife: kv_connector_extra_config['host_bytes'] must be a positive int "
                f"(bytes), got {host_bytes!r}"
            )
        self.host_bytes = host_bytes
        eviction = extra.get("eviction", "lru")
        if eviction != "lru":
            raise ConfigError(f"kvlife: eviction {eviction!r} is not supported (only 'lru')")
        strict = extra.get("strict", False)
        if not isinstance(strict, bool):
            raise ConfigError(f"kvlife: strict must be a bool, got {strict!r}")
        self.strict = strict
        store_dir = extra.get("store_dir")
        self.store_dir: str | None = None if store_dir is None else os.fspath(store_dir)
        report_dir = extra.get("report_dir")
        self.report_dir: str | None = None if report_dir is None else os.fspath(report_dir)
        if len(config.groups) != 1:
            raise ConfigError(f"kvlife: one KV cache group is supported, got {len(config.groups)}")
        if self.blocks_per_chunk != 1:
            raise ConfigError(f"kvlife: blocks_per_chunk must be 1, got {self.blocks_per_chunk}")
        self.page_bytes = int(config.worker_kv_bytes_per_block)
        self.capacity = self.host_bytes // self.page_bytes
        if self.capacity < 1:
            raise ConfigError(
                f"kvlife: host_bytes {self.host_bytes} hold no block of {self.page_bytes} bytes"
            )
        model_id = extra.get("model_id")
        self.namespace = store_namespace(config, None if model_id is None else str(model_id))
        self._pool_key = f"{config.engine_id}/{config.parallel.rank}"
        self._manager: KVLifeOffloadingManager | None = None
        self._worker: KVLifeWorker | None = None

    def _open_store(self) -> LocalDirectoryStore | None:
        if self.store_dir is None:
            return None
        return LocalDirectoryStore(self.store_dir, self.namespace)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            # Single process: the worker built the pool first; allocate from that same memory.
            pool = _SHARED_POOLS.get(self._pool_key)
            if pool is not None and pool.capacity == self.capacity:
                del _SHARED_POOLS[self._pool_key]
            else:  # multiprocess: page indices here, the bytes in the worker process
                pool = HostPagePool(self.capacity, 1, torch.int8, pin_memory=False)
            self._manager = KVLifeOffloadingManager(
                pool, strict=self.strict, disk=self._open_store(), report_dir=self.report_dir
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            row = sum(int(view.shape[1]) for view in _block_views(kv_caches))
            pool = HostPagePool(self.capacity, row, torch.int8)
            _SHARED_POOLS[self._pool_key] = pool
            self._worker = KVLifeWorker(
                kv_caches,
                pool,
                store=self._open_store(),
                report_dir=self.report_dir,
                pool_key=self._pool_key,
                tokens_per_block=self.tokens_per_block[0],
            )
        return self._worker
