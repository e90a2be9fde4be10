"""The worker side: :class:`KVLifeWorker`, vLLM's ``OffloadingWorker`` copying through a
kvlife copy engine, and :class:`BlockViewsLayout`, vLLM's KV cache as a kvlife layout."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from kvlife.errors import ConfigError, DuplicateAck
from kvlife.integrations.vllm._common import (
    _SHARED_POOLS,
    FROM_STORE,
    HostBlocksSpec,
    PersistentTier,
    _Live,
    _write_report,
    page_namer,
    shut_down,
    unlink_quietly,
    unpin_shared_pool,
)
from kvlife.layout import KVLayout
from kvlife.pool import HostPagePool
from kvlife.refusals import Refusals
from kvlife.store.base import StoreResult
from kvlife.transfers import Transfers

logger = logging.getLogger(__name__)

#: vLLM 0.34 and later take a failed job (a failed load is recomputed, a failed store
#: dropped) and hand the worker device pointers; vLLM 0.32 stops on a failed job and hands
#: block ids.
TAKES_FAILURES = hasattr(sys.modules[OffloadingWorker.__module__], "DevicePointers")


def _block_views(kv_caches: CanonicalKVCaches) -> list[torch.Tensor]:
    """vLLM's block views of the one KV cache group, each tensor once."""
    indices = dict.fromkeys(ref.tensor_idx for ref in kv_caches.group_data_refs[0])
    return [kv_caches.tensors[i].tensor for i in indices]


#: Rows this wide are gathered one by one (the per-row cost is lost in the copy's).
_WIDE_ROW_BYTES = 16 << 10
#: The element a copy moves block rows in: 16 bytes, copied bit for bit (torch moves
#: complex values whole, never through arithmetic), 16 times fewer than int8 elements.
_WORD = torch.complex128


def _as_words(
    blocks: Sequence[tuple[torch.Tensor, slice]], page_numel: int
) -> list[tuple[torch.Tensor, slice]] | None:
    """Each view as rows of 16-byte words with its columns of a host page in words, or None
    when a view's rows, strides or place in the page are not 16-byte aligned."""
    size = _WORD.itemsize
    if page_numel % size:
        return None
    words = []
    for view, cols in blocks:
        if cols.start % size or cols.stop % size or view.stride(0) % size:
            return None
        try:
            wide = view.view(_WORD)
        except RuntimeError:  # e.g. a storage offset that is not a whole word
            return None
        words.append((wide, slice(cols.start // size, cols.stop // size)))
    return words


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
        self._np_views: tuple[np.ndarray[Any, Any], ...] | None = None
        self._wide_rows = all(int(view.shape[1]) >= _WIDE_ROW_BYTES for view in self.views)
        self._words = _as_words(self._blocks, self.page_numel)

    def _gather_into(self, pages: torch.Tensor, out: torch.Tensor) -> None:
        """A store's copy on a CPU below ``STREAM_BYTES`` (larger ones are streamed by
        ``KVLayout``): each view's rows as 16-byte words, one ``index_select`` per view
        straight into the host page columns (torch's own loop, in C++ and on its threads:
        0.9x a contiguous copy of the same bytes for 64 KiB rows, where int8 elements are
        copied one by one at 0.6x); views that are not 16-byte aligned by the rows below."""
        words = self._words
        if words is not None and self.device.type == "cpu" and pages.numel():
            host = out.view(_WORD)
            for view, cols in words:
                torch.index_select(view, 0, pages, out=host[:, cols])
            return
        self._gather_rows(pages, out)

    def _scatter_from(self, pages: torch.Tensor, src: torch.Tensor) -> None:
        """A load's copy on a CPU below ``STREAM_BYTES``, as the store's: one ``index_copy_``
        of 16-byte words per view (0.9x a contiguous copy; the core's row loop is 0.6x)."""
        words = self._words
        if words is not None and self.device.type == "cpu" and pages.numel():
            host = src.view(_WORD)
            for view, cols in words:
                view.index_copy_(0, pages, host[:, cols])
            return
        super()._scatter_from(pages, src)

    def _gather_rows(self, pages: torch.Tensor, out: torch.Tensor) -> None:
        """A store's copy on a CPU for views that are not 16-byte aligned, one memcpy per
        (page, view) row with the GIL released: rows of 16 KiB and more assigned one by one
        (numpy slices: 0.75x to 0.85x a contiguous copy), smaller ones as opaque items by
        one numpy ``take`` per view (the loop's cost would be the copy's). ``index_select``
        of int8 elements into strided host columns copies them one by one: 0.3x to 0.6x
        (``bench/vllm_offload.py``)."""
        if self.device.type != "cpu" or pages.numel() == 0:
            super()._gather_into(pages, out)
            return
        if self._np_views is None:
            rows = [row.detach().view(torch.uint8).numpy() for row, _ in self._blocks]
            self._np_views = tuple(r.view(np.dtype((np.void, r.shape[1])))[:, 0] for r in rows)
        host = out.detach().view(torch.uint8).numpy()
        if self._wide_rows:
            pairs = [(cols, row.detach().view(torch.uint8).numpy()) for row, cols in self._blocks]
            for i, page in enumerate(pages.tolist()):
                row = host[i]
                for cols, view in pairs:
                    row[cols] = view[page]
            return
        index = pages.numpy()
        for (_, cols), source in zip(self._blocks, self._np_views, strict=True):
            target = host[:, cols.start : cols.stop].view(source.dtype)[:, 0]
            np.take(source, index, out=target, mode="clip")  # indices checked: no buffering


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
    #: Chunks of the job in flight (what the pipeline reads).
    inflight: int = 0

    def ack(self, ticket: object) -> None:
        """One chunk of the job is over; more acks than chunks are refused, nothing changed."""
        if not self.inflight:
            raise DuplicateAck(
                f"job {self.job_id} has no chunk in flight",
                event="ack",
                state=None,
                rid=self.job_id,
                ident=id(self),
            )
        self.inflight -= 1


class KVLifeWorker(OffloadingWorker):  # type: ignore[misc]
    """Copies blocks between vLLM's KV cache and host page rows through kvlife's copy
    pipeline (:class:`~kvlife.transfers.Transfers`): each job is a record that owns its
    chunks' tickets; the engine acks them, the pipeline writes stored blocks to the
    persistent tier (a private copy: the scheduler owns the host pages), and a job whose
    last chunk is over is the job's one ``TransferResult``."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        pool: HostPagePool,
        *,
        store: PersistentTier | None = None,
        report_dir: str | None = None,
        strict: bool = False,
        pool_key: str | None = None,
        tokens_per_block: int = 1,
        shared_path: str | None = None,
        pinned: Sequence[int] = (),
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
        self._names = page_namer(store.namespace if store is not None else "")
        self._report_dir = report_dir
        self._strict = strict
        self._pool_key = pool_key
        self._shared_path = shared_path  # the pool's shared-memory name, removed at shutdown
        self._pinned = list(pinned)  # the pool's page-locked ranges, unlocked at shutdown
        self._pages_claimed = False
        self._jobs: dict[int, _WorkerJob] = {}  # job id -> job in flight
        self._finished: list[TransferResult] = []
        self._shut = False
        #: Refusals and recovered failures by kind (counted, logged once per kind; a refusal
        #: of bad input raises with strict, a failure the worker recovers from never does).
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
        # Each view's base address and row stride, in vLLM's data-ref order, to read device
        # pointers (vLLM 0.34) back as block ids: a pointer is ``base + block * stride``.
        refs = kv_caches.group_data_refs[0]
        tensors = [kv_caches.tensors[ref.tensor_idx].tensor for ref in refs]
        self._bases = np.array([t.data_ptr() for t in tensors], dtype=np.uint64)[:, None]
        self._strides = np.array([t.stride(0) for t in tensors], dtype=np.uint64)[:, None]
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
        """Take the pool back from ``_SHARED_POOLS`` if no manager of this process took it."""
        key = self._pool_key
        if key is None:
            return False
        built = _SHARED_POOLS.get(key)
        if built is not None and built[0] is self._pool:
            del _SHARED_POOLS[key]
            return True
        return False

    def _start(self, job_id: int, load: bool, blocks: int) -> _WorkerJob:
        if not self._pages_claimed:  # the first job
            self._pages_claimed = True
            # No manager here took the pool (vLLM's multiprocess mode; or no pool key): the
            # scheduler allocates page indices elsewhere and this worker owns every page
            # (the engine copies only allocated pages).
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
                self.stats["engine_busy_waits"] += 1
                transfers.apply_acks(self.engine.drain())
                job.event = cast(Any, transfers.submit(ticket, device, host, checked=False))
        except UnallocatedHostPage as exc:
            # vLLM reset the offloaded cache (the manager freed the pages) before it
            # submitted this stale job; its result is ignored, nothing reads the pages.
            self.stats["stale_jobs_skipped"] += 1
            logger.debug("kvlife worker: job %d skipped (%s)", job.job_id, exc)
            return
        except EngineError as exc:
            self.refusals.note("copy_refused", repr(exc))
            self._recover(job, device, host)
            return
        job.inflight += 1

    def _recover(self, job: _WorkerJob, device: Sequence[int], host: Sequence[int]) -> None:
        """A chunk the engine refused or failed: vLLM 0.34+ takes the job as failed (a
        load is recomputed, a store dropped); vLLM 0.32 cannot, so it is made here."""
        if TAKES_FAILURES:
            job.failed = True
        else:
            self._copy_directly(job, device, host)

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
        self.stats["loaded_blocks" if job.load else "stored_blocks"] += job.blocks
        self.seconds["load" if job.load else "store"] += elapsed
        self._finished.append(
            TransferResult(job.job_id, not job.failed, job.blocks * self.row_bytes, elapsed)
        )

    def _stored(self, job: object, result: StoreResult) -> None:
        if result.ok:
            self.stats["disk_pages_written"] += len(result.keys)
        else:
            self.refusals.note("disk_write_failures", repr(result.error))

    def _device_blocks(self, device: Any) -> list[int] | None:
        """A job's device blocks: vLLM 0.32's ``GPULoadStoreSpec`` names them; vLLM 0.34's
        ``DevicePointers`` gives each view's row address (``base + block * stride``, views
        in data-ref order), read back here: every view must name the same blocks, inside the
        cache. ``None`` (counted) for pointers this worker's cache does not hold."""
        ptrs = getattr(device, "ptrs", None)
        if ptrs is None:
            blocks: list[int] = device.block_ids.tolist()
            return blocks
        counts, bases = tuple(device.group_block_counts), self._bases
        n = counts[0] if counts else 0
        if len(counts) != 1 or len(ptrs) != n * len(bases):
            self.refusals.note("device_pointers_refused", f"{len(counts)} groups, {len(ptrs)} ptrs")
            return None
        offsets = np.asarray(ptrs, dtype=np.uint64).reshape(len(bases), n) - bases
        rows = offsets // self._strides
        if n and (
            (rows * self._strides != offsets).any()
            or (rows != rows[0]).any()
            or int(rows[0].max()) >= self.layout.num_pages
        ):
            self.refusals.note("device_pointers_refused", "pointers outside the KV cache views")
            return None
        return [int(b) for b in rows[0].tolist()]

    def submit_store(
        self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec, **kwargs: Any
    ) -> bool:
        """Device -> host: ``src_spec`` is vLLM 0.32's ``GPULoadStoreSpec`` or vLLM 0.34's
        ``DevicePointers``; ``dst_spec`` the scheduler's host pages."""
        spec = cast(HostBlocksSpec, dst_spec)
        host_pages = list(spec.block_ids)
        job = self._start(job_id, False, len(host_pages))
        device = self._device_blocks(src_spec)
        if device is None:
            job.failed = True
        elif host_pages:  # named for the persistent tier where there is one, once, here
            names = self._names
            keys = tuple(map(names, spec.keys) if self._store is not None else spec.keys)
            self._submit(job, (job, 0, keys, 0), device, host_pages)
        if not job.inflight:
            self._done(job)
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any, **kwargs: Any
    ) -> bool:
        """Host -> device: ``dst_spec`` is vLLM 0.32's ``GPULoadStoreSpec`` or vLLM 0.34's
        ``DevicePointers`` (``expedited`` loads are copied like the rest)."""
        spec = cast(HostBlocksSpec, src_spec)
        host_ids = spec.block_ids
        device_ids = self._device_blocks(dst_spec)
        job = self._start(job_id, True, len(host_ids))
        if device_ids is None or len(device_ids) != len(host_ids):
            job.failed = True
            self._done(job)
            return True
        keys, device, host = spec.keys, device_ids, list(host_ids)
        if FROM_STORE in host_ids:  # blocks the persistent tier holds: read here, first
            disk = [i for i, page in enumerate(host_ids) if page == FROM_STORE]
            names = [self._names(keys[i]) for i in disk]
            self._load_from_store(job, names, [device_ids[i] for i in disk])
            on_host = [i for i, page in enumerate(host_ids) if page != FROM_STORE]
            keys = [spec.keys[i] for i in on_host]
            device = [device_ids[i] for i in on_host]
            host = [host_ids[i] for i in on_host]
        if host:  # the rest (every block, in the common case) from host pages: one chunk
            self._submit(job, LoadTicket(job, 0, tuple(keys)), device, host)
        if not job.inflight:
            self._done(job)
        return True

    def _load_from_store(self, job: _WorkerJob, names: list[str], blocks: list[int]) -> None:
        """Read persistent-tier pages (verified) straight into device blocks, here: the
        engine copies only to and from host pool pages."""
        for name, block in zip(names, blocks, strict=True):
            payload = self._store.get(name) if self._store is not None else None
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
            ("drain", lambda: self.transfers.apply_acks(self.engine.drain(timeout=60.0))),
            ("engine_close", self.engine.close),
            ("unpin", self._unpin),
            ("unshare", self._unshare),
            ("unlink", lambda: unlink_quietly(self._shared_path or "")),
            ("store_close", self._close_store),
        ]
        if self._report_dir is not None:
            steps.append(("report", self._report))
        errors = shut_down("worker", steps)
        self.stats["shutdown_errors"] += len(errors)
        if errors and self._strict:
            raise errors[0]

    def _unpin(self) -> None:
        pinned, self._pinned = self._pinned, []
        unpin_shared_pool(pinned)

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
