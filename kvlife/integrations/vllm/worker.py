"""The worker side: :class:`KVLifeWorker`, vLLM's ``OffloadingWorker`` copying through a
kvlife copy engine, and :class:`BlockViewsLayout`, vLLM's KV cache as a kvlife layout."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

# vLLM is an optional dependency: mypy runs without it, hence the ignores.
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvlife import LoadTicket, Ticket
from kvlife._checks import positive_int
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
from kvlife.engine.base import _c_index, distinct
from kvlife.errors import ConfigError, DrainTimeout, DuplicateAck, StoreError
from kvlife.integrations.vllm._common import (
    FROM_STORE,
    HostBlocksSpec,
    PersistentTier,
    _Live,
    _write_report,
    page_namer,
    shut_down,
)
from kvlife.integrations.vllm.shared_pool import SharedHostPool
from kvlife.layout import KVLayout
from kvlife.pool import HostPagePool
from kvlife.refusals import Refusals
from kvlife.store.base import StoreResult
from kvlife.transfers import Transfers

logger = logging.getLogger(__name__)

#: vLLM 0.34 and later take a failed job (a failed load is recomputed, a failed store
#: dropped; but a failed synchronous load, ``expedited``, stops vLLM) and hand the worker
#: device pointers; vLLM 0.32 stops on a failed job and hands block ids.
TAKES_FAILURES = hasattr(sys.modules[OffloadingWorker.__module__], "DevicePointers")


def _group_tensors(kv_caches: CanonicalKVCaches) -> list[tuple[int, ...]]:
    """Each KV cache group's tensors (indices into ``kv_caches.tensors``), each once, in
    vLLM's data-ref order; a group without one is refused (ConfigError)."""
    groups = [
        tuple(dict.fromkeys(ref.tensor_idx for ref in refs)) for refs in kv_caches.group_data_refs
    ]
    if not groups or not all(groups):
        raise ConfigError(f"kvlife: a KV cache group has no layers ({len(groups)} groups)")
    return groups


def host_row_bytes(kv_caches: CanonicalKVCaches, blocks_per_chunk: int = 1) -> int:
    """A host page's bytes: one key's chunk, ``blocks_per_chunk`` blocks of the group whose
    blocks are widest (every group's keys share the host tier's pages)."""
    widths = [
        sum(int(kv_caches.tensors[i].tensor.shape[1]) for i in group)
        for group in _group_tensors(kv_caches)
    ]
    return blocks_per_chunk * max(widths)


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


class GroupedBlocksLayout(KVLayout):
    """Several KV cache groups, or chunks of several blocks, as one layout the copy engine
    drives (docs/vllm.md, "Hybrid models: several KV cache groups"): a host page is one
    key's chunk, slot ``j`` its block ``j``; a device "page" is ``part * num_blocks +
    block``, ``block`` the chunk's first real block, the chunk's blocks registered under it
    while its copy is in flight."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int = 1,
        tokens_per_block: Sequence[int] = (),
    ) -> None:
        groups = _group_tensors(kv_caches)
        parts = list(dict.fromkeys(groups))
        #: Each group's part (the layout of its tensors), by group position.
        self.group_part = [parts.index(group) for group in groups]
        tokens = list(tokens_per_block) or [1] * len(groups)
        if len(tokens) != len(groups):
            raise ConfigError(f"kvlife: {len(tokens)} block sizes for {len(groups)} groups")
        self.slot_numel = host_row_bytes(kv_caches)
        #: One :class:`BlockViewsLayout` per distinct set of group tensors.
        self.parts = [
            BlockViewsLayout(
                [kv_caches.tensors[i].tensor for i in part], tokens[groups.index(part)]
            )
            for part in parts
        ]
        counts = {part.num_pages for part in self.parts}
        if len(counts) != 1:
            raise ConfigError(f"kvlife: KV cache groups of different block counts {counts}")
        self.num_blocks = counts.pop()
        self.blocks_per_chunk = positive_int("blocks_per_chunk", blocks_per_chunk)
        width = self.slot_numel * blocks_per_chunk
        first = self.parts[0]
        # KVLayout's own rows are a placeholder (no memory): every copy goes through a part.
        placeholder = torch.zeros((1, width), dtype=torch.int8, device=first.device)
        super().__init__([placeholder.expand(len(parts) * self.num_blocks, width)], tokens[0])
        #: With several blocks a chunk: each chunk's blocks by device page while in flight.
        self.chunks: dict[int, tuple[int, ...]] = {}

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return tuple(dict.fromkeys(v for part in self.parts for v in part.views))

    def _copy_runs(
        self,
        load: bool,
        pages: torch.Tensor,
        host: torch.Tensor,
        runs: Sequence[tuple[int, int, int]],
        max_staging_bytes: int,
    ) -> None:
        """Each part's blocks and host slots in one copy of that part's layout."""
        self._check_rows("host", host)
        bpc, listed = self.blocks_per_chunk, pages.tolist()
        rows = np.empty(len(listed), dtype=np.int64)
        for offset, row, length in runs:
            rows[offset : offset + length] = np.arange(row, row + length)
        parts, blocks = np.divmod(np.array(listed, dtype=np.int64), self.num_blocks)
        chunks = np.array([self.chunks[p] for p in listed]) if bpc > 1 else blocks[:, None]
        slots = rows[:, None] * bpc + np.arange(bpc)
        host_slots = host.view(host.shape[0] * bpc, self.slot_numel)
        for part in np.unique(parts).tolist():
            wanted = (chunks >= 0) & (parts == part)[:, None]
            layout = self.parts[part]
            copy = layout.scatter_runs if load else layout.gather_runs
            index = torch.from_numpy(chunks[wanted]).to(layout.device)
            target, runs = host_slots[:, : layout.page_numel], host_runs(slots[wanted].tolist())
            copy(index, target, runs, max_staging_bytes=max_staging_bytes)

    def read_page(self, page: int) -> torch.Tensor:
        out = torch.zeros((1, self.page_numel), dtype=self.dtype)
        self.gather_runs(torch.tensor([self._page(page)]), out, [(0, 0, 1)])
        return out[0].to(self.device)

    def write_page(self, page: int, values: torch.Tensor) -> None:
        if values.dtype != self.dtype or tuple(values.shape) != (self.page_numel,):
            raise ConfigError(f"values must be {self.dtype} of shape ({self.page_numel},)")
        row = values.reshape(1, -1).cpu()
        self.scatter_runs(torch.tensor([self._page(page)]), row, [(0, 0, 1)])


@dataclass(slots=True, eq=False)  # compared and hashed by identity, never by job id
class _WorkerJob:
    """One vLLM transfer job on the worker: the owner of its chunks' tickets, a record
    completed once its copies are over (one ``TransferResult``), never a state machine."""

    job_id: int
    load: bool
    blocks: int
    started: float
    event: CpuCopyEvent | torch.cuda.Event | None = None
    copy_done: float = 0.0
    #: A copy of the job could not be made, even directly: its result says so.
    failed: bool = False
    #: vLLM 0.34's synchronous load (``expedited``): waited on in the step that runs its
    #: request, so a failed result cannot become a recompute (vLLM stops).
    expedited: bool = False
    #: Chunks of the job in flight (what the pipeline reads), and its keys by KV cache group.
    inflight: int = 0
    groups: dict[int, int] = field(default_factory=dict)
    #: Device pages whose chunk's blocks the job registered (``blocks_per_chunk`` > 1).
    pages: list[int] = field(default_factory=list)

    def ack(self, ticket: object) -> None:
        """One chunk of the job is over; more acks than chunks are refused, nothing changed."""
        if not self.inflight:
            what = f"job {self.job_id} has no chunk in flight"
            raise DuplicateAck(what, event="ack", state=None, rid=self.job_id, ident=id(self))
        self.inflight -= 1


class KVLifeWorker(OffloadingWorker):  # type: ignore[misc]
    """Copies blocks between vLLM's KV cache and host page rows through kvlife's copy
    pipeline (:class:`~kvlife.transfers.Transfers`), each job a record that owns its
    chunks' tickets (docs/design.md, "One copy pipeline")."""

    drain_timeout_s = 60.0  # how long shutdown waits for the copies in flight

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        pool: HostPagePool | SharedHostPool,
        *,
        store: PersistentTier | None = None,
        report_dir: str | None = None,
        strict: bool = False,
        pool_key: str | None = None,
        tokens_per_block: int | Sequence[int] = 1,
        blocks_per_chunk: int = 1,
        copy_threads: int = 0,
    ) -> None:
        self.blocks_per_chunk = positive_int("blocks_per_chunk", blocks_per_chunk)
        positive_int("copy_threads", copy_threads, least=0)
        # A shared pool is this worker's to close (its page lock and name) at shutdown.
        shared = pool if isinstance(pool, SharedHostPool) else SharedHostPool(pool)
        pool = shared.pool
        groups = _group_tensors(kv_caches)
        if isinstance(tokens_per_block, int):
            tokens_per_block = [tokens_per_block] * len(groups)
        tokens = list(tokens_per_block)
        layout: BlockViewsLayout | GroupedBlocksLayout
        # Each group's part of the layout (0 for every group over the same tensors).
        if len(set(groups)) == 1 and blocks_per_chunk == 1:  # one group's blocks: as they are
            views = [kv_caches.tensors[i].tensor for i in groups[0]]
            layout = BlockViewsLayout(views, tokens[0])
            self._num_blocks, self._parts = layout.num_pages, [0] * len(groups)
        else:
            layout = GroupedBlocksLayout(kv_caches, blocks_per_chunk, tokens)
            self._num_blocks, self._parts = layout.num_blocks, layout.group_part
        if pool.page_numel != layout.page_numel or pool.dtype != torch.int8:
            raise ConfigError(
                f"host pages of {pool.page_numel} {pool.dtype} cannot hold a block of "
                f"{layout.page_numel} B"
            )
        self.layout = layout
        self.row_bytes = layout.page_numel
        # On a CPU a job is copied in submit by default (copy_threads=0), on torch's own
        # OpenMP team: a copy thread would take cores from the model's (docs/vllm.md).
        self.engine: CpuCopyEngine | CudaCopyEngine = (
            CudaCopyEngine(layout, pool)
            if layout.device.type == "cuda"
            else CpuCopyEngine(layout, pool, workers=copy_threads)
        )
        self._pool = pool
        self._store = store
        self._names = page_namer(store.namespace if store is not None else "")
        self._report_dir = report_dir
        self._strict = strict
        self._pool_key = pool_key
        self._shared = shared
        self._pages_claimed = False
        self._jobs: dict[int, _WorkerJob] = {}  # job id -> job in flight
        self._finished: list[TransferResult] = []
        self._shut = False
        #: Refusals and recovered failures by kind (a refusal raises with strict).
        self.refusals = Refusals(strict=strict, logger=logger)
        #: The copy pipeline: acks to their jobs, stored blocks to the persistent tier.
        self.transfers = Transfers(
            self.engine,
            pool,
            store,
            refusals=self.refusals,
            owns_pages=False,
            route=self._route,
            acked=self._acked,
            stored=self._stored,
        )
        self.stats: Counter[str] = Counter()
        self.seconds: dict[str, float] = {"store": 0.0, "load": 0.0}
        # Per group, each data ref's view base address and row stride, in vLLM's order, to
        # read device pointers (vLLM 0.34) back as block ids: ``base + block * stride``.
        self._refs: list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = []
        for refs in kv_caches.group_data_refs:
            tensors = [kv_caches.tensors[ref.tensor_idx].tensor for ref in refs]
            bases = np.array([t.data_ptr() for t in tensors], dtype=np.uint64)[:, None]
            strides = np.array([t.stride(0) for t in tensors], dtype=np.uint64)[:, None]
            self._refs.append((bases, strides))
        _LIVE_WORKERS.add(self)

    @property
    def pool(self) -> HostPagePool:
        """The host tier this worker copies into and out of."""
        return self._pool

    @property
    def inflight(self) -> int:
        """Jobs submitted whose result was not yet handed to vLLM's ``get_finished``."""
        return len(self._jobs)

    def _unshare(self) -> bool:
        """Take the pool back if no manager of this process took it."""
        return self._pool_key is not None and self._shared.withdraw(self._pool_key)

    def _start(self, job_id: int, load: bool, blocks: int) -> _WorkerJob:
        if not self._pages_claimed:  # the first job
            self._pages_claimed = True
            # No manager here took the pool (multiprocess mode; or no pool key): the scheduler
            # allocates pages elsewhere, so this worker owns them all (the engine wants owners).
            if (self._unshare() or self._pool_key is None) and self._pool.num_free:
                self._pool.alloc(self._pool.num_free, self)
        if job_id in self._jobs:  # vLLM reused a job id in flight: both still get results
            self.refusals.note("job_id_in_flight", f"job {job_id} submitted while in flight")
        job = _WorkerJob(job_id, load, blocks, time.perf_counter())
        self._jobs[job_id] = job
        return job

    def _submit(
        self, job: _WorkerJob, ticket: Ticket | LoadTicket, device: list[int], host: list[int]
    ) -> None:
        """Hand one chunk to the pipeline (checked once, by the engine); a chunk it refuses
        is counted and made here or skipped."""
        transfers = self.transfers
        try:
            try:
                job.event = cast(Any, transfers.submit(ticket, device, host, checked=False))
            except PageBusy:  # in use by an earlier copy (after a reset or an abort): wait
                self._wait_for_copies()
                job.event = cast(Any, transfers.submit(ticket, device, host, checked=False))
        except UnallocatedHostPage as exc:
            # vLLM reset the offloaded cache (the manager freed the pages) before it
            # submitted this stale job: a store's result is ignored; a load fails (0.34).
            self.stats["stale_jobs_skipped"] += 1
            job.failed |= job.load and TAKES_FAILURES  # (a part read from disk may have failed)
            logger.debug("kvlife worker: job %d skipped (%s)", job.job_id, exc)
            return
        except EngineError as exc:
            self.refusals.note("copy_refused", repr(exc))
            self._recover(job, device, host)
            return
        job.inflight += 1

    def _wait_for_copies(self) -> None:
        """Pages an earlier copy still uses: wait for every copy in flight (counted)."""
        self.stats["engine_busy_waits"] += 1
        self.transfers.apply_acks(self.engine.drain())

    def _recover(self, job: _WorkerJob, device: Sequence[int], host: Sequence[int]) -> None:
        """A chunk the engine refused or failed: vLLM 0.34+ takes the job as failed,
        except a synchronous load (its request already runs on the blocks); vLLM 0.32
        takes no failure. Those are made here, at once."""
        if TAKES_FAILURES and not job.expedited:
            job.failed = True
        else:
            self._copy_directly(job, device, host)

    def _copy_directly(
        self, job: _WorkerJob, device_pages: Sequence[int], host_pages: Sequence[int]
    ) -> None:
        """The copy the engine failed or refused, made here, at once; if this fails too,
        the job's result is a failure (vLLM 0.32, or 0.34 on a synchronous load, then
        stops rather than use the blocks)."""
        pages = torch.tensor(list(device_pages), dtype=torch.int64, device=self.layout.device)
        copy = self.layout.scatter_runs if job.load else self.layout.gather_runs
        try:
            copy(pages, self._pool.tensor, host_runs(host_pages))
        except Exception as exc:
            job.failed = True
            self.refusals.note("copy_failed_twice", repr(exc))
            return
        self.stats["copies_made_directly"] += 1

    def _route(self, owner: object) -> tuple[Transfers, object] | None:
        """Only a job's ack is this worker's (any other is refused: counted, never raised)."""
        return (self.transfers, owner) if type(owner) is _WorkerJob else None

    def _acked(self, job: object, ack: Ack) -> None:
        """A chunk of ``job`` is over (the pipeline applied it): a failed copy is made
        again directly; the job's last chunk makes its result."""
        assert isinstance(job, _WorkerJob)
        job.copy_done = ack.completed_at
        if ack.error is not None:  # the job fails (vLLM 0.34+), or is made again (0.32)
            self.refusals.note("copy_failures", repr(ack.error))
            self._recover(job, ack.device_pages, ack.host_pages)
        if not job.inflight:
            self._done(job)

    def _done(self, job: _WorkerJob) -> None:
        """Every copy of the job is over: its one result."""
        if self._jobs.get(job.job_id) is job:  # not a later job that reused the id
            del self._jobs[job.job_id]
        elapsed = (job.copy_done or time.perf_counter()) - job.started
        what = "loaded" if job.load else "stored"
        self.stats[f"{what}_blocks"] += job.blocks
        if not job.failed:
            for g, n in job.groups.items():
                self.stats[f"{what}_keys_group{g}"] += n
        if job.pages and isinstance(self.layout, GroupedBlocksLayout):
            for page in job.pages:  # its chunks' copies are over
                self.layout.chunks.pop(page, None)
        self.seconds["load" if job.load else "store"] += elapsed
        self._finished.append(
            TransferResult(job.job_id, not job.failed, job.blocks * self.row_bytes, elapsed)
        )

    def _stored(self, job: object, result: StoreResult) -> None:
        if result.ok:
            self.stats["disk_pages_written"] += len(result.keys)
        else:
            self.refusals.note("disk_write_failures", repr(result.error))

    def _device_groups(self, device: Any) -> list[tuple[list[int], int]] | None:
        """A job's device blocks per KV cache group, each with the request's index of its
        first block, from vLLM 0.32's block ids or 0.34's pointers (docs/vllm.md); ``None``
        (counted) for a spec that does not fit this worker's groups or cache."""
        ptrs, groups = getattr(device, "ptrs", None), len(self._refs)
        if ptrs is None:
            ids: list[int] = np.asarray(device.block_ids).tolist()
            sizes = list(device.group_sizes or [len(ids)])
            starts = list(device.block_indices or [0] * len(sizes))
            if len(sizes) != groups or len(starts) != groups or sum(sizes) != len(ids):
                self.refusals.note("device_spec_refused", f"{len(sizes)} groups of {groups}")
                return None
            # One C pass where no id repeats (one group); else (groups may share ids) two.
            limit = self._num_blocks
            checked = _c_index(device.block_ids, limit)  # vLLM's own array, read as it is
            if ids and checked is None and not 0 <= min(ids) <= max(ids) < limit:
                self.refusals.note("device_spec_refused", "block ids outside the KV cache")
                return None  # (not another part's block either)
            ends = list(itertools.accumulate(sizes))
            return [
                (ids[end - n : end], int(first))
                for n, end, first in zip(sizes, ends, starts, strict=True)
            ]
        counts, refs = tuple(device.group_block_counts), tuple(device.group_data_ref_counts)
        if (
            len(counts) != groups
            or refs != tuple(len(bases) for bases, _ in self._refs)
            or len(ptrs) != sum(n * r for n, r in zip(counts, refs, strict=True))
        ):
            self.refusals.note("device_pointers_refused", f"{len(counts)} groups, {len(ptrs)} ptrs")
            return None
        flat, at = np.asarray(ptrs, dtype=np.uint64), 0
        out: list[tuple[list[int], int]] = []
        starts = device.block_indices
        for n, first, (bases, strides) in zip(counts, starts, self._refs, strict=True):
            offsets = flat[at : at + n * len(bases)].reshape(len(bases), n) - bases
            at += n * len(bases)
            rows = offsets // strides
            if n and (
                (rows * strides != offsets).any()
                or (rows != rows[0]).any()
                or int(rows[0].max()) >= self._num_blocks
            ):
                self.refusals.note("device_pointers_refused", "pointers outside the KV cache views")
                return None
            out.append((rows[0].tolist(), int(first)))
        return out

    def _device_pages(self, job: _WorkerJob, device: Any, keys: int) -> list[int] | None:
        """Each key's device page in the job's key order, a group's blocks filling its keys'
        chunks from slot ``first % blocks_per_chunk`` (docs/vllm.md, "Chunks of several
        blocks"), each chunk's blocks registered under its page until the job is over;
        ``None`` (counted) when they do not make one chunk per key."""
        groups = self._device_groups(device)
        if groups is None:
            return None
        bpc, stride = self.blocks_per_chunk, self._num_blocks
        pages: list[int] = []
        chunks: list[tuple[int, ...]] = []
        for g, (blocks, first) in enumerate(groups):
            if not blocks:
                continue
            if bpc == 1:  # a chunk is its block (the common case: one list, no tuples)
                base = self._parts[g] * stride
                pages += [base + b for b in blocks] if base else blocks
                job.groups[g] = job.groups.get(g, 0) + len(blocks)
                continue
            skip = first % bpc
            padded = [-1] * skip + blocks + [-1] * (-(skip + len(blocks)) % bpc)
            for k in range(0, len(padded), bpc):
                chunk = tuple(padded[k : k + bpc])
                # Named by its first real block (vLLM 0.34 keeps null block 0 as a placeholder).
                real = next((b for b in chunk if b > 0), max(chunk))
                pages.append(self._parts[g] * stride + real)
                chunks.append(chunk)
                job.groups[g] = job.groups.get(g, 0) + 1
        if len(pages) != keys or not distinct(pages):
            self.refusals.note("device_spec_refused", f"{len(pages)} chunks for {keys} keys")
            return None
        layout = self.layout
        if isinstance(layout, GroupedBlocksLayout) and bpc > 1:
            if not layout.chunks.keys().isdisjoint(pages):  # an earlier job's chunk: wait
                self._wait_for_copies()
            if not layout.chunks.keys().isdisjoint(pages):
                self.refusals.note("device_spec_refused", "a chunk's page is still in use")
                return None
            layout.chunks.update(zip(pages, chunks, strict=True))
            job.pages = pages
        return pages

    def submit_store(
        self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec, **kwargs: Any
    ) -> bool:
        """Device -> host: ``src_spec`` is vLLM 0.32's ``GPULoadStoreSpec`` or vLLM 0.34's
        ``DevicePointers``; ``dst_spec`` the scheduler's host pages, one a key."""
        return self._transfer(job_id, False, src_spec, cast(HostBlocksSpec, dst_spec), False)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any, **kwargs: Any
    ) -> bool:
        """Host -> device: ``dst_spec`` is vLLM 0.32's ``GPULoadStoreSpec`` or vLLM 0.34's
        ``DevicePointers``. An ``expedited`` load (vLLM 0.34's synchronous load, waited on
        in its request's step) is copied like the rest, and a copy of it that fails is
        made again at once, as on vLLM 0.32: its failure would stop vLLM."""
        expedited = bool(kwargs.get("expedited", False))
        return self._transfer(job_id, True, dst_spec, cast(HostBlocksSpec, src_spec), expedited)

    def _transfer(
        self, job_id: int, load: bool, device_spec: Any, spec: HostBlocksSpec, expedited: bool
    ) -> bool:
        """One job: its host pages and keys (``spec``), its device blocks, one chunk."""
        host_ids = spec.block_ids
        job = self._start(job_id, load, len(host_ids))
        job.expedited = expedited
        device = self._device_pages(job, device_spec, len(host_ids))
        if device is None:
            job.failed = True
        elif host_ids:
            keys, host = spec.keys, list(host_ids)
            if not load and self._store is not None:  # named for the persistent tier, here
                keys = list(map(self._names, keys))
            if load and FROM_STORE in host_ids:  # pages the persistent tier holds: read first
                disk = [i for i, page in enumerate(host_ids) if page == FROM_STORE]
                names = [self._names(keys[i]) for i in disk]
                self._load_from_store(job, names, [device[i] for i in disk])
                on_host = [i for i, page in enumerate(host_ids) if page != FROM_STORE]
                keys, device, host = ([x[i] for i in on_host] for x in (keys, device, host))
            if host:  # the rest (every block, in the common case) from host pages: one chunk
                ticket = LoadTicket(job, 0, tuple(keys)) if load else (job, 0, tuple(keys), 0)
                self._submit(job, ticket, device, host)
        if not job.inflight:
            self._done(job)
        return True

    def _load_from_store(self, job: _WorkerJob, names: list[str], blocks: list[int]) -> None:
        """Read persistent-tier pages (verified) straight into device blocks, here: the
        engine copies only to and from host pool pages. Blocks an earlier copy still reads or
        writes (after a reset or an abort) are waited for, as a chunk the engine finds busy."""
        if self.engine.device_pages_busy(blocks):
            self._wait_for_copies()
        for name, block in zip(names, blocks, strict=True):
            try:
                payload = self._store.get(name) if self._store is not None else None
            except (StoreError, OSError):  # a cluster that does not answer: gone, as below
                payload = None
            self.stats["disk_reads"] += 1
            if payload is None or len(payload) != self.row_bytes:
                # Verified at lookup, gone or damaged since: the job fails (never decode on it).
                self.refusals.note("disk_load_errors", f"page {name[:16]} unreadable")
                job.failed = True
                continue
            row = torch.frombuffer(bytearray(payload), dtype=torch.int8)
            self.layout.write_page(block, row.to(self.layout.device))

    def get_finished(self) -> list[TransferResult]:
        self.transfers.poll()
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Block until the copies of ``job_ids`` are over (results: ``get_finished``)."""
        jobs = [self._jobs.get(job_id) for job_id in job_ids]
        events = [job.event for job in jobs if job is not None and job.event is not None]
        for event in events:
            event.synchronize()
        if events:
            self.transfers.apply_acks(self.engine.poll())

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every copy is over and the persistent tier wrote every queued page."""
        self.transfers.drain(timeout)

    def shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True
        steps: list[tuple[str, Callable[[], object]]] = [
            ("drain", lambda: self.transfers.apply_acks(self.engine.drain(self.drain_timeout_s))),
            ("engine_close", self.engine.close),
            ("unshare", self._unshare),
            ("unpin_unlink", self._release_pool),
            ("store_close", self._close_store),
        ]
        if self._report_dir is not None:
            steps.append(("report", self._report))
        errors = shut_down("worker", steps)
        self.stats["shutdown_errors"] += len(errors)
        if errors and self._strict:
            raise errors[0]

    def _release_pool(self) -> None:
        """Unlock and unlink the shared pool; only unlink it where a copy may still use it
        (the drain ran out of time): the process's end unlocks it then."""
        self.transfers.apply_acks(self.engine.poll())
        if self.engine.inflight:
            self._shared.unlink()
            raise DrainTimeout(f"{self.engine.inflight} copies in flight: the pool stays locked")
        self._shared.close()

    def _close_store(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()
            self.transfers.apply_results(store.drain())

    def _report(self) -> None:
        assert self._report_dir is not None
        report = {**self.stats, **{f"{k}_seconds": v for k, v in self.seconds.items()}}
        report.update(self.refusals.snapshot())
        report["jobs_in_flight"] = len(self._jobs)
        _write_report(self._report_dir, f"worker-{os.getpid()}.json", report)


_LIVE_WORKERS: _Live[KVLifeWorker] = _Live()


def live_workers() -> list[KVLifeWorker]:
    """The workers alive in this process."""
    return _LIVE_WORKERS.members()
