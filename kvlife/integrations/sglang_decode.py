"""SGLang's decode-side KV offload manager with kvlife Lifecycles as its bookkeeping
(docs/sglang.md, "The decode offload manager": what it keeps of SGLang's, retraction, tensor
parallelism, a write the cache controller refuses, refusals).

:class:`KVLifeDecodeOffloadManager` subclasses SGLang 0.5.23's ``DecodeKVCacheOffloadManager``
(built on first use, so this module imports without SGLang): each request *life* is a
:class:`~kvlife.Lifecycle` whose tickets the copies' acks settle, released exactly once; a free
naming device pages a copy in flight still reads waits, whole, for that copy's ack. Switch it
on in the scheduler process, before SGLang builds its scheduler::

    import kvlife.integrations.sglang_decode as kvlife_decode; kvlife_decode.install()
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvlife._lifecycle import DECODING, FinishReason, Lifecycle, Ticket
from kvlife.engine.base import Ack
from kvlife.errors import ConfigError, KVLifeError, ManagerError
from kvlife.hashing import sglang_page_hashes
from kvlife.refusals import Refusals

__all__ = ["decode_manager_class", "install", "uninstall"]  # and KVLifeDecodeOffloadManager

logger = logging.getLogger(__name__)

_SCHEDULER = "sglang.srt.managers.scheduler"


class _Life:
    """One life of one ``Req``: its Lifecycle and where its chunks start."""

    __slots__ = ("generation", "lifecycle", "prefill_len", "req", "retracted")

    def __init__(self, req: Any, lifecycle: Lifecycle, prefill_len: int) -> None:
        self.req = weakref.ref(req)  # copies in flight hold the Req strongly, not the life
        self.lifecycle = lifecycle
        self.prefill_len = prefill_len
        self.generation = req.retraction_count  # SGLang counts each retraction of a Req
        self.retracted = False


class _HostBudget:
    """SGLang's host pool seen as kvlife's (free pages), for the agreed host budget."""

    def __init__(self, pool: Any, page_size: int) -> None:
        self._pool, self._page_size = pool, page_size

    @property
    def num_free(self) -> int:
        return int(self._pool.available_size()) // self._page_size


class _KVLifeDecodeOffload:
    """The kvlife half of :class:`KVLifeDecodeOffloadManager` (no SGLang import here).

    The attributes below are SGLang's, set by its ``__init__`` (tests set them without it:
    ``tests/sglang_stubs.py``'s ``sglang_own_manager``).
    """

    page_size: int
    offload_stride: int
    request_counter: int
    tp_world_size: int
    tp_group: Any
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    tree_cache: Any
    cache_controller: Any
    decode_host_mem_pool: Any
    kv_cache: Any
    ongoing_offload: dict[int, tuple[Any, ...]]
    ongoing_backup: dict[int, tuple[Any, ...]]
    offloaded_state: Any
    offload_inflight: Any
    _resolve_offload_transfers: Callable[..., tuple[Any, list[Any]]]
    _release_finished_req: Callable[[Any], None]
    _check_backup_progress: Callable[[int], None]
    _compute_prefix_hash: Callable[..., list[str]]

    def __init__(self, *args: Any, strict: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # SGLang's: controller, host pool, dicts
        self._init_kvlife(strict=strict)

    def _init_kvlife(self, *, strict: bool) -> None:
        self.strict = strict
        #: Refusals by kind: counted, logged once per kind, raised only with ``strict``.
        self.refusals = Refusals(strict=strict, logger=logger)
        #: Chunks not submitted because the host pages were not free (on every rank, with
        #: more than one); writes this rank's cache controller refused (no host pages);
        #: chunks every rank failed because some rank's write was refused, offered again.
        self.host_pool_exhausted = 0
        self.writes_refused = 0
        self.chunks_failed = 0
        #: Lifecycles released, retractions drained, copies waited for in those drains.
        self.released = 0
        self.retractions_drained = 0
        self.drained_copies = 0
        #: Frees held back because a copy in flight still read one of their pages.
        self.deferred_frees = 0
        self._retracting = False  # a drain ran: the next progress check ends retracted lives
        self._lives: weakref.WeakKeyDictionary[Any, _Life] = weakref.WeakKeyDictionary()
        self._tickets: dict[int, Ticket] = {}
        self._pins: dict[int, torch.Tensor] = {}  # ack id -> device indices its copy reads
        # With an agreement: ack id -> (first token, prior key) of its chunk, where the
        # request's chunks start again if the group fails it; and the failed acks of chunks
        # whose write this rank's controller refused, for the next agreement.
        self._restart: dict[int, tuple[int, str | None]] = {}
        self._refused_here: list[Ack] = []
        self._orphans: list[int] = []  # copies running with no ticket (its submit refused)
        self._held: list[tuple[torch.Tensor, set[int]]] = []  # frees waiting for those acks
        self._raw_free: Callable[[torch.Tensor], None] | None = None
        allocator = self.token_to_kv_pool_allocator
        if allocator is not None:
            self._raw_free = allocator.free
            allocator.free = self._guarded_free  # the instance's free; free_full etc. call it
        self.agreement: Any = None
        if self.tp_world_size > 1:
            from kvlife.distributed import TorchAgreement

            budget: Any = _HostBudget(self.decode_host_mem_pool, self.page_size)
            self.agreement = TorchAgreement(self.tp_group, host=budget)

    # ------------------------------------------------------------ what SGLang calls

    def offload_kv_cache(self, req: Any) -> bool:
        """Submit the chunk that is due (whole strides of decoded KV); True if one was (at
        finish: the life is released after this last copy's ack). A write the cache controller
        refuses: docs/sglang.md, "A write the cache controller refuses"."""
        if self.cache_controller is None or self.decode_host_mem_pool is None:
            return False
        row: Any = req.kv.req_pool_idx
        if row is None or row == -1 or not req.output_ids:
            return False
        try:
            life = self._life_of(req)
            lc = life.lifecycle
            if not DECODING[lc.state]:
                raise ManagerError(f"offload of {lc!r} after its life ended")
            start = life.prefill_len + lc.tokens_submitted
            have = len(req.origin_input_ids) + len(req.output_ids) - 1  # the newest has no KV
            n = (have - start) // self.offload_stride * self.offload_stride
            if n <= 0 or not self._admit(n):
                return False
            tokens = _tokens(req, start, start + n)
        except KVLifeError as exc:
            self.refusals.refuse("offload", exc)
            return False
        indices = self.req_to_token_pool.req_to_token[row][start : start + n].to(torch.int64)
        device_indices, pool_transfers = self._resolve_offload_transfers(indices)
        self.request_counter += 1
        ack_id = self.request_counter
        host_indices = self.cache_controller.write(
            device_indices=device_indices, node_id=ack_id, extra_pools=pool_transfers
        )
        agreement = self.agreement
        if host_indices is None:  # no host pages for the write after all (SGLang logs it)
            self.writes_refused += 1
            if self.writes_refused == 1:
                logger.warning(
                    "kvlife: the cache controller refused a write for request %r (no host "
                    "pages); the chunk is offered again. Counted in writes_refused, logged once",
                    req.rid,
                )
            if agreement is None:  # nothing submitted: the chunk is due again next step
                return False
        self._pins[ack_id] = device_indices  # on every rank, copy or not: frees wait alike
        if host_indices is not None:
            self.ongoing_offload[ack_id] = (req, host_indices, tokens, time.time(), pool_transfers)
        prior = lc.chain_tail
        try:
            ticket = lc.submit(tokens)  # a typed refusal here leaves the Lifecycle as it was
        except KVLifeError as exc:
            # The copy may run already (on this rank or another): its device pages stay
            # guarded, its host pages go back, at the next progress check on every rank.
            self._orphans.append(ack_id)
            self.refusals.refuse("offload", exc)
            return False
        self._tickets[ack_id] = ticket
        if agreement is not None:
            agreement.submitted(ticket)
            self._restart[ack_id] = (start, prior)
            if host_indices is None:  # failed here; the group learns at the next check
                error = ManagerError(f"the cache controller refused the write of {ticket[:2]!r}")
                self._refused_here.append(Ack(ticket, (), (), error=error))
        if req.finished():  # the finish-time flush: released after its ack
            lc.finish(_reason(req))
        return True

    def check_offload_progress(self) -> None:
        """Wait for the device -> host copies queued on this rank (as SGLang's check does),
        agree with the other ranks, apply the acks; then free host pages already backed up.
        After a retraction, first end the lives of the requests it retracted."""
        if self._retracting:
            self._end_retracted_lives()
        cc = self.cache_controller
        queue = cc.ack_write_queue
        done: list[int] = []
        while queue:
            ack = queue.pop(0)
            ack.finish_event.synchronize()
            done.extend(ack.node_ids)
        orphans, self._orphans = self._orphans, []
        for ack_id in orphans:  # their copies are over on this rank (and on every rank)
            self._drop(ack_id)
        tickets = self._tickets
        if self.agreement is None:
            for ack_id in done:
                if ack_id in tickets:
                    self._apply(ack_id)
        else:
            local = [Ack(tickets[i], (), ()) for i in done if i in tickets]
            local += self._refused_here  # failed here: the group fails them on every rank
            self._refused_here = []
            self._agree(local)
        backed_up = cc.ack_backup_queue.qsize()
        if backed_up:
            self._check_backup_progress(backed_up)

    def _agree(self, local: list[Ack]) -> None:
        """Agree on ``local`` (this rank's completions) and apply what the group agreed, in
        submission order: a chunk failed on any rank (its write refused there) fails on every
        rank. The agreement stops at a failure, so agree again until nothing is pending (every
        rank drained its copies, so each round agrees one chunk or more: the same number of
        rounds on every rank)."""
        agreement = self.agreement
        tickets = self._tickets
        while True:
            before = agreement.chunks_agreed
            agreed = agreement.agree(local)
            local = []
            by_ticket = {id(t): i for i, t in tickets.items()}
            for ack in agreed:
                agreed_id = by_ticket.get(id(ack.ticket))
                if agreed_id is None:
                    self.refusals.refuse(
                        "stray_ack", ManagerError(f"no copy for {ack.ticket[:2]!r}")
                    )
                elif ack.error is not None:
                    self._fail(agreed_id)
                else:
                    self._apply(agreed_id)
            if not agreement.pending or agreement.chunks_agreed == before:
                return

    def drain_before_retraction(self) -> None:
        """Retraction is safe, never refused: the allocator guard holds back the retracted
        request's pages until its copies' acks, so there is nothing to wait for. (Without
        an allocator to guard, it waits for every copy on this rank and agrees, instead.)"""
        self.retractions_drained += 1
        self._retracting = True
        if self._raw_free is not None:
            return
        self.drained_copies += len(self.ongoing_offload)
        self.check_offload_progress()
        if self.agreement is not None and self.agreement.pending:
            self.check_offload_progress()  # every rank drained: the second agreement is total

    def _guarded_free(self, indices: torch.Tensor) -> None:
        """The allocator's ``free``, except that a free naming a page under a copy in flight
        waits, whole, for the acks of every such copy."""
        assert self._raw_free is not None
        pins = self._pins
        if pins and indices.numel():
            waits = {i for i, read in pins.items() if bool(torch.isin(read, indices).any())}
            if waits:
                self._held.append((indices, waits))
                self.deferred_frees += 1
                return
        self._raw_free(indices)

    def finalize_release_on_finish(self, req: Any) -> None:
        """The request finished with nothing more to offload: release now, or at its last ack."""
        life = self._lives.get(req)
        if life is None or life.generation != req.retraction_count:
            if life is not None:
                self._end_retracted(req, life)
            self._release_finished_req(req)
            self.released += 1
            return
        self._finish(life.lifecycle, _reason(req))

    def has_inflight_device_transfer(self) -> bool:
        """Whether a device -> host copy may still read device KV pages (or, with more than
        one rank, a chunk this rank's write refused is not failed by the group yet: the same
        answer on every rank)."""
        return bool(self.ongoing_offload or self._pins)

    def release_host_resources(self) -> None:
        """Shutdown: wait for the copies in flight, then free SGLang's host pool."""
        try:
            self.check_offload_progress()
        finally:
            self.decode_host_mem_pool.destroy()

    # ------------------------------------------------------------ kvlife's bookkeeping

    def _life_of(self, req: Any) -> _Life:
        life = self._lives.get(req)
        if life is not None and life.generation == req.retraction_count:
            return life
        start, prior = self._prefill_point(req)
        if life is not None:  # retracted since: end that life, continue after its pages
            self._end_retracted(req, life)
            old = life.prefill_len + life.lifecycle.tokens_submitted
            if old >= start:
                start, prior = old, life.lifecycle.chain_tail
        new = self._new_life(req, start, prior)
        self._lives[req] = new
        return new

    def _new_life(self, req: Any, start: int, prior: str | None) -> _Life:
        """A life of ``req`` whose chunks start at token ``start``, chained from ``prior``."""
        lc = Lifecycle(
            req.rid,
            page_size=self.page_size,
            on_release=self._on_release,
            prior_hash=prior,
            hasher=self._hasher(req, start),
        )
        new = _Life(req, lc, start)
        lc.owner = new
        return new

    def _prefill_point(self, req: Any) -> tuple[int, str | None]:
        """The prompt's whole pages (the prefill side stored them) and their last key."""
        prefill = len(req.origin_input_ids) // self.page_size * self.page_size
        if not prefill:
            return 0, None
        prompt = list(req.origin_input_ids[:prefill])
        return prefill, self._compute_prefix_hash(req, prompt)[-1]

    def _hasher(self, req: Any, start: int) -> Any:
        """SGLang's page keys: kvlife's SGLang chain; a namespaced request (``extra_key`` or
        ``cache_salt``) chains its first page from SGLang's namespace seed."""
        if start or (getattr(req, "extra_key", None) is None and req.cache_salt is None):
            return sglang_page_hashes
        compute = self._compute_prefix_hash

        def namespaced(tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
            return compute(req, list(tokens), prior)

        return namespaced

    def _end_retracted_lives(self) -> None:
        """Each life whose request SGLang retracted since (``reset_for_retract`` counts it) ends
        ``RETRACTED`` now, released at its last ack, though the request may never come back."""
        self._retracting = False
        for req, life in list(self._lives.items()):
            if not life.retracted and life.generation != req.retraction_count:
                self._end_retracted(req, life)

    def _end_retracted(self, req: Any, life: _Life) -> None:
        """A retracted request came back (or finished): its old life ends RETRACTED."""
        life.retracted = True  # its pages went back (or wait in the guard) with the retraction
        self._finish(life.lifecycle, FinishReason.RETRACTED)

    def _finish(self, lc: Lifecycle, reason: FinishReason) -> None:
        """End ``lc`` if it still decodes (a refusal counted, or raised with ``strict``)."""
        if DECODING[lc.state]:
            try:
                lc.finish(reason)
            except KVLifeError as exc:
                self.refusals.refuse("finish", exc)

    def _admit(self, n_tokens: int) -> bool:
        pages = n_tokens // self.page_size
        if self.agreement is not None:
            ok = bool(self.agreement.admit(pages))
        else:
            ok = int(self.decode_host_mem_pool.available_size()) >= n_tokens
        if not ok:
            self.host_pool_exhausted += 1
        return ok

    def _apply(self, ack_id: int) -> None:
        """One agreed ack: back the chunk up under its life's keys, then ack the life."""
        ticket = self._tickets.pop(ack_id)
        self._unpin(ack_id)
        req, host_indices, tokens, start_time, pool_transfers = self.ongoing_offload.pop(ack_id)
        keys = list(ticket[2])
        for transfer in pool_transfers:
            transfer.keys = keys[-(transfer.device_indices.numel() // self.page_size) :]
        extra = {"extra_pools": pool_transfers} if pool_transfers else {}
        op_id = self.cache_controller.write_storage(host_indices, tokens, hash_value=keys, **extra)
        self.ongoing_backup[op_id] = (req.rid, host_indices, start_time, pool_transfers)
        try:
            ticket[0].ack(ticket)  # may release the life
        except KVLifeError as exc:
            self.refusals.refuse("ack", exc)

    def _fail(self, ack_id: int) -> None:
        """One chunk the group failed (its write was refused on some rank): its host pages
        go back unwritten, its held frees run, its life acks it; a life still decoding ends
        (``RETRACTED``, leaving the request to a new life) and the request's chunks start
        again at this one, so it is offered again with the same keys, as on every rank."""
        ticket = self._tickets.pop(ack_id)
        start, prior = self._restart.pop(ack_id)
        self._drop(ack_id)
        self.chunks_failed += 1
        lc = ticket[0]
        try:
            lc.ack(ticket)  # may release the life (a finished one)
        except KVLifeError as exc:
            self.refusals.refuse("ack", exc)
            return
        life = lc.owner
        assert isinstance(life, _Life)
        req = life.req()
        if req is None or self._lives.get(req) is not life or not DECODING[lc.state]:
            return
        if life.generation != req.retraction_count:
            return  # retracted: its end and the resumed life are _life_of's
        self._lives[req] = self._new_life(req, start, prior)  # first: the old one may release
        self._finish(lc, FinishReason.RETRACTED)  # now, or at its last ack; the request stays

    def _drop(self, ack_id: int) -> None:
        """A copy that stores nothing: its held frees run, its host pages go back unwritten."""
        self._unpin(ack_id)
        entry = self.ongoing_offload.pop(ack_id, None)
        if entry is None:
            return  # refused on this rank: no host pages
        host_indices, pool_transfers = entry[1], entry[4]
        pool = self.decode_host_mem_pool
        for transfer in pool_transfers:
            if getattr(transfer, "host_indices", None) is not None:
                pool.get_pool(transfer.name).free(transfer.host_indices)
        pool.free(host_indices)

    def _unpin(self, ack_id: int) -> None:
        """Copy ``ack_id`` reads its device pages no more: frees that waited for it alone run."""
        self._pins.pop(ack_id, None)
        if self._held:
            assert self._raw_free is not None
            still: list[tuple[torch.Tensor, set[int]]] = []
            for indices, waits in self._held:
                waits.discard(ack_id)
                if waits:
                    still.append((indices, waits))
                else:
                    self._raw_free(indices)
            self._held = still

    def _on_release(self, lc: Lifecycle) -> None:
        life = lc.owner
        assert isinstance(life, _Life)
        req = life.req()
        if req is None:
            return
        self.released += 1
        if life.retracted or life.generation != req.retraction_count:
            return  # its device pages went back with the retraction; kept for the chain's tail
        if self._lives.get(req) is not life:
            return  # a chunk of it failed: the request's current life releases it
        del self._lives[req]
        self._release_finished_req(req)


def _tokens(req: Any, start: int, stop: int) -> list[int]:
    """Tokens ``[start, stop)`` of prompt + outputs, without building the whole list."""
    prompt = req.origin_input_ids
    n = len(prompt)
    if stop <= n:
        return list(prompt[start:stop])
    if start >= n:
        return list(req.output_ids[start - n : stop - n])
    return list(prompt[start:]) + list(req.output_ids[: stop - n])


def _reason(req: Any) -> FinishReason:
    name = type(getattr(req, "finished_reason", None)).__name__
    return FinishReason.ABORTED if name == "FINISH_ABORT" else FinishReason.FINISHED


_MADE: dict[str, type] = {}


def sglang_subclass(mixin: type, module: str, base: str, name: str, owner: str) -> type:
    """``name``: ``mixin`` over SGLang's class ``module.base``, made once (imports SGLang)."""
    if name not in _MADE:
        import importlib

        try:
            sglang_base = getattr(importlib.import_module(module), base)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"SGLang's {base} does not import: {exc}") from exc
        _MADE[name] = type(
            name, (mixin, sglang_base), {"__module__": owner, "__doc__": mixin.__doc__}
        )
    return _MADE[name]


def decode_manager_class() -> type:
    """The subclass of SGLang's ``DecodeKVCacheOffloadManager`` (imports SGLang once)."""
    return sglang_subclass(
        _KVLifeDecodeOffload,
        "sglang.srt.disaggregation.decode_kvcache_offload_manager",
        "DecodeKVCacheOffloadManager",
        "KVLifeDecodeOffloadManager",
        __name__,
    )


def install() -> type:
    """Make SGLang's scheduler build kvlife's decode offload manager (the one switch-on line).

    Replaces ``sglang.srt.managers.scheduler.DecodeKVCacheOffloadManager``; run it in the
    scheduler process before the ``Scheduler`` is constructed. Returns the class."""
    import importlib

    cls = decode_manager_class()
    scheduler: Any = importlib.import_module(_SCHEDULER)
    if not hasattr(scheduler, "_kvlife_replaced"):
        scheduler._kvlife_replaced = scheduler.DecodeKVCacheOffloadManager
    scheduler.DecodeKVCacheOffloadManager = cls
    logger.info("kvlife: SGLang's scheduler builds %s", cls.__qualname__)
    return cls


def uninstall() -> None:
    """Undo :func:`install`."""
    import sys

    scheduler: Any = sys.modules.get(_SCHEDULER)
    if scheduler is not None and hasattr(scheduler, "_kvlife_replaced"):
        scheduler.DecodeKVCacheOffloadManager = scheduler._kvlife_replaced
        del scheduler._kvlife_replaced


def __getattr__(name: str) -> Any:
    if name == "KVLifeDecodeOffloadManager":
        return decode_manager_class()
    raise AttributeError(name)
