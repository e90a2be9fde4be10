"""Seeded buggy runtimes: each one bug class of docs/design.md, behind the kit's adapter protocol.

Not part of kvlife's API. Each mutant is kvlife's OffloadManager with one small
patch that puts back a bug the real runtimes had; ``MUTANTS`` maps a name to an
adapter factory. The testing kit and the exhaustive checker must catch every one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from kvlife import FinishReason, Lifecycle, State
from kvlife.engine.base import Ack
from kvlife.engine.cpu import CpuCopyEngine
from kvlife.hashing import page_hashes
from kvlife.layout import LayerFirstLayout
from kvlife.manager import OffloadManager, OffloadRequest, ReleaseHandler
from kvlife.pool import HostPagePool
from kvlife.store.base import Store
from kvlife.testing import (
    DevicePages,
    InlineStore,
    ManagerAdapter,
    Release,
    ScriptedEngine,
    page_bytes_of,
)
from kvlife.testing.adapter import AdapterError


class RidKeyedProgress(OffloadManager):
    """State keyed by rid: a new life inherits the progress of an unreleased one with its rid.

    The hand-written runtime keeps ``progress[rid]`` and deletes it at release;
    a rid reused while the old life still drains continues the old chain.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._by_rid: dict[object, OffloadRequest] = {}

    def start(
        self,
        rid: object,
        prompt: Sequence[int],
        on_release: ReleaseHandler | None = None,
        *,
        prior_hash: str | None = None,
    ) -> OffloadRequest:
        lc = super().start(rid, prompt, on_release, prior_hash=prior_hash)
        old = self._by_rid.get(rid)
        if old is not None and old.state is not State.RELEASED:
            new, former = lc._lifecycle, old._lifecycle
            new._pages_submitted = former._pages_submitted  # the bug: progress found by rid
            lc.next_page = old.next_page
            new._tail = former.chain_tail
        self._by_rid[rid] = lc
        return lc


class EarlyRelease(OffloadManager):
    """Release while a copy is in flight: an abort or a retraction frees device pages at once."""

    def finish(self, lc: OffloadRequest, reason: FinishReason = FinishReason.FINISHED) -> None:
        handler = lc.release_handler
        if reason is not FinishReason.FINISHED and handler is not None:
            lc.release_handler = None  # released now, so not again at the last ack
            handler(lc, lc.device_pages)
        super().finish(lc, reason)


class DoubleHostFree(OffloadManager):
    """Host pages freed twice: a release-time cleanup frees what the pending store write frees."""

    def _on_release(self, lc: Any) -> None:
        pages = self.host.owned_by(lc.owner)
        if pages:
            self.host.free(pages, owner=lc.owner)  # the bug: the store result frees them again
        super()._on_release(lc)


class _AckOrderKeys:
    """A store front that rehashes each chunk from the chain head as acks arrive."""

    def __init__(self, inner: Store, manager: AckOrderChain) -> None:
        self.inner = inner
        self.manager = manager

    def put(self, token: object, keys: Sequence[str], pages: torch.Tensor) -> None:
        lc: OffloadRequest = token[1]  # type: ignore[index]  # (pipeline, request, pages)
        tokens = self.manager.chunk_tokens[tuple(keys)]
        head = self.manager.head.get(lc, self.manager.prior[lc])
        rehashed = self.manager.hasher(tokens, self.manager.page_size, head)
        self.manager.head[lc] = rehashed[-1]  # the bug: the chain advances in ack order
        self.inner.put(token, rehashed, pages)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class AckOrderChain(OffloadManager):
    """Hash chain advanced in ack order: each acked chunk is keyed from the last acked chunk."""

    def __init__(self, engine: Any, host: Any, store: Store, **kwargs: Any) -> None:
        super().__init__(engine, host, store, **kwargs)
        self.store = self.transfers.store = _AckOrderKeys(store, self)
        self.chunk_tokens: dict[tuple[str, ...], list[int]] = {}
        self.head: dict[OffloadRequest, str | None] = {}
        self.prior: dict[OffloadRequest, str | None] = {}

    def start(self, *args: Any, **kwargs: Any) -> OffloadRequest:
        lc = super().start(*args, **kwargs)
        self.prior[lc] = lc.snapshot().chain_tail
        return lc

    def offload(
        self, lc: OffloadRequest, tokens: Sequence[int], device_pages: Sequence[int]
    ) -> Any:
        ticket = super().offload(lc, tokens, device_pages)
        if ticket is not None:
            first = lc.prefill_len + ticket[3] * self.page_size
            end = first + self.page_size * len(ticket[2])
            self.chunk_tokens[ticket[2]] = list(tokens[first:end])
        return ticket


class NewestByRid(OffloadManager):
    """A late ack applied to the newest life with the same rid (the ack is looked up by rid)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._newest: dict[object, OffloadRequest] = {}
        apply = self.transfers.apply

        def by_rid(ack: Ack) -> None:
            newest = self._newest[ack.owner.rid]._lifecycle
            if newest is not ack.owner and newest.chunks_in_flight():
                ack = replace(ack, ticket=newest.chunks_in_flight()[0])  # the bug
            apply(ack)

        self.transfers.apply = by_rid  # type: ignore[method-assign]

    def start(self, rid: object, *args: Any, **kwargs: Any) -> OffloadRequest:
        lc = super().start(rid, *args, **kwargs)
        self._newest[rid] = lc
        return lc


def _adapter(manager: Callable[..., OffloadManager]) -> Callable[[], ManagerAdapter]:
    def factory() -> ManagerAdapter:
        return ManagerAdapter(manager_factory=manager)

    factory.__name__ = f"adapter_of_{manager.__name__}"
    return factory


#: Every seeded bug: name -> adapter factory.
MUTANTS: dict[str, Callable[[], ManagerAdapter]] = {
    "state-keyed-by-rid": _adapter(RidKeyedProgress),
    "release-in-flight": _adapter(EarlyRelease),
    "host-double-free": _adapter(DoubleHostFree),
    "ack-order-chain": _adapter(AckOrderChain),
    "late-ack-to-newest": _adapter(NewestByRid),
}


# ----------------------------------------------------------------------------- SGLang's shape
#
# A CPU port of SGLang's decode offload manager (DecodeKVCacheOffloadManager) in its fixed,
# object-keyed form: a per-life record hangs off the request object; each step offloads
# whole strides; finish flushes what is left (the last, shorter stride) and the life is
# released after that copy's ack; the progress check waits for every queued copy (a poll
# that drains); a retracted request resumes as the same request object with a fresh record;
# there is no per-copy failure path. The runtime frees its own device pages (no release
# callback): the adapter hands it a DevicePages allocator, which records each free.

_CARRIER = Lifecycle("sglang-port", page_size=1)  # the engines carry Tickets; this runtime
# keeps its own bookkeeping and uses the ticket's seq as its ack id.


class Req:
    """SGLang's Req, reduced: rid, tokens so far, the current life's device pages."""

    def __init__(self, rid: str, tokens: Sequence[int]) -> None:
        self.rid = rid
        self.tokens = list(tokens)
        self.pages: list[int] = []
        self.keys: list[str] = []
        self.written = 0
        self.offload: OffloadRecord | None = None

    def __repr__(self) -> str:
        return f"<Req rid={self.rid!r} tokens={len(self.tokens)} id=0x{id(self):x}>"


class OffloadRecord:
    """One life's offload bookkeeping (object-keyed: it belongs to one life of one Req)."""

    def __init__(self, req: Req, done_pages: int, prior: str | None) -> None:
        self.req = req
        self.pages = req.pages  # this life's device pages (the Req gets new ones on resume)
        self.done_pages = done_pages
        self.prior = prior
        self.inflight = 0
        self.finished = False
        self.released = False


class OngoingCopy:
    """One queued device -> host copy: its ack id, life, host pages and keys."""

    def __init__(
        self, ack_id: int, life: OffloadRecord, host: list[int], keys: list[str], flush: bool
    ) -> None:
        self.ack_id, self.life, self.host, self.keys, self.flush = ack_id, life, host, keys, flush

    def __repr__(self) -> str:
        return f"<copy ack={self.ack_id} rid={self.life.req.rid!r} pages={len(self.keys)}>"


class DecodeOffloadManager:
    """The port. ``stride`` is in pages. ``offload_kv_cache`` returns False when the host
    pool is full (the step retries at the next one)."""

    def __init__(
        self,
        engine: Any,
        host: HostPagePool,
        store: Any,
        device: DevicePages,
        *,
        page_size: int,
        stride: int = 2,
    ) -> None:
        self.engine, self.host, self.store, self.device = engine, host, store, device
        self.page_size, self.stride = page_size, stride
        self.ongoing: dict[int, OngoingCopy] = {}
        self.next_ack = 0

    def admit(self, req: Req) -> OffloadRecord:
        """A new life (a new request, or a retracted one resumed): a fresh record."""
        prefill = (len(req.tokens) - 1) // self.page_size
        req.offload = OffloadRecord(req, prefill, req.keys[prefill - 1] if prefill else None)
        return req.offload

    def offload_kv_cache(self, req: Req, final: bool = False) -> bool:
        life = req.offload
        assert life is not None
        whole = (len(req.tokens) - 1) // self.page_size
        n = whole - life.done_pages
        if not final:
            n = n // self.stride * self.stride
        if n <= 0:
            return True
        host = self.host.alloc(n, owner=self)
        if host is None:
            return False  # host pool full: retry at the next step
        first = life.done_pages
        keys = self.keys_for(req, first, n, life.prior)
        self.submit(life, first, n, host, keys, final)
        return True

    def keys_for(self, req: Req, first: int, n: int, prior: str | None) -> list[str]:
        ps = self.page_size
        return page_hashes(req.tokens[first * ps : (first + n) * ps], ps, prior)

    def submit(
        self, life: OffloadRecord, first: int, n: int, host: list[int], keys: list[str], flush: bool
    ) -> None:
        ack_id = self.next_ack
        self.next_ack += 1
        ticket = (_CARRIER, ack_id, tuple(keys), first)
        self.engine.submit(ticket, self.source_pages(life, first, n), host)
        self.ongoing[ack_id] = OngoingCopy(ack_id, life, host, keys, flush)
        life.inflight += 1
        life.done_pages = first + n
        life.prior = keys[-1]

    def source_pages(self, life: OffloadRecord, first: int, n: int) -> list[int]:
        return life.pages[first : first + n]

    def finish(self, req: Req, reason: FinishReason) -> None:
        """Flush the last stride, then release once its ack comes (at once if none)."""
        life = req.offload
        assert life is not None
        self.offload_kv_cache(req, final=True)
        life.finished = True
        if life.inflight == 0:
            self.release(life)

    def check_offload_progress(self) -> None:
        """SGLang's progress check: wait for every queued copy, then apply their acks."""
        for ack in self.engine.drain():
            self.on_ack(ack)
        for result in self.store.poll():
            self.host.free(list(result.token), owner=self)

    def on_ack(self, ack: Any) -> None:
        copy = self.ongoing.pop(ack.seq)
        life = self.life_of(copy)
        rows = self.host.tensor[list(copy.host)]
        self.store.put(tuple(copy.host), copy.keys, rows)  # no per-copy failure path
        life.inflight -= 1
        if life.finished and life.inflight == 0:
            self.release(life)

    def life_of(self, copy: OngoingCopy) -> OffloadRecord:
        return copy.life

    def release(self, life: OffloadRecord) -> None:
        if not life.released:
            life.released = True
            self.device.free(life.pages, owner=life.req)

    def close(self) -> None:
        self.check_offload_progress()
        for result in self.store.drain():
            self.host.free(list(result.token), owner=self)


class SGLangAdapter:
    """The kit's adapter for the port: no workarounds, the runtime as it is."""

    namespace: str | None = None
    progress = "drain"

    def __init__(
        self,
        manager: type[DecodeOffloadManager] = DecodeOffloadManager,
        *,
        page_size: int = 2,
        stride: int = 2,
        host_pages: int = 6,
        device_pages: int = 96,
        threaded: bool = False,
    ) -> None:
        self.page_size = page_size
        self.layout = LayerFirstLayout.zeros(1, device_pages, page_size, 1, 2, dtype=torch.int32)
        self.host = HostPagePool(host_pages, self.layout.page_numel, torch.int32, pin_memory=False)
        self.engine: Any = (
            CpuCopyEngine(self.layout, self.host)
            if threaded
            else ScriptedEngine(self.layout, self.host)
        )
        self.store = InlineStore()
        self.device = DevicePages(self.layout)
        self.mgr = manager(
            self.engine, self.host, self.store, self.device, page_size=page_size, stride=stride
        )
        self._closed = False

    def start(self, rid: str, prompt: Sequence[int]) -> Req:
        req = Req(rid, prompt)
        self._grow(req)
        self.mgr.admit(req)
        return req

    def resume(self, request: object, tokens: Sequence[int]) -> Req:
        assert isinstance(request, Req)
        request.tokens, request.pages, request.written = list(tokens), [], 0
        self._grow(request)
        self.mgr.admit(request)
        return request  # SGLang resumes the same request object

    def step(self, request: object, tokens: Sequence[int]) -> None:
        assert isinstance(request, Req)
        request.tokens.extend(tokens)
        self._grow(request)
        self.mgr.offload_kv_cache(request)

    def finish(self, request: object, reason: FinishReason) -> None:
        assert isinstance(request, Req)
        self.mgr.finish(request, reason)

    def copies_in_flight(self) -> list[OngoingCopy]:
        return list(self.mgr.ongoing.values())

    def copy_request(self, copy: object) -> Req:
        assert isinstance(copy, OngoingCopy)
        return copy.life.req

    def complete(self, copy: object, ok: bool = True) -> None:
        raise AdapterError("this runtime's copies complete in its progress check (drain)")

    def poll(self) -> None:
        self.mgr.check_offload_progress()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.mgr.close()
            finally:
                self.engine.close()

    def releases(self) -> list[Release]:
        return self.device.releases

    def stored_keys(self) -> Iterable[str]:
        return self.store.keys()

    def stored_page(self, key: str) -> bytes | None:
        return self.store.get(key)

    def page_bytes(self, key: str) -> bytes:
        return page_bytes_of(key, self.layout.page_nbytes)

    def host_pages_allocated(self) -> int:
        return self.host.num_used

    def device_pages_allocated(self) -> int:
        return self.device.allocated()

    def host_pages_free(self) -> int:
        return self.host.num_free

    def _grow(self, req: Req) -> None:
        ps = self.page_size
        need = -(-len(req.tokens) // ps) - len(req.pages)
        if need > 0:
            req.pages.extend(self.device.alloc(need, owner=req))
        whole = (len(req.tokens) - 1) // ps
        if whole > len(req.keys):
            prior = req.keys[-1] if req.keys else None
            req.keys.extend(page_hashes(req.tokens[len(req.keys) * ps : whole * ps], ps, prior))
        while req.written < whole:
            self.device.write(req.pages[req.written], req.keys[req.written])
            req.written += 1


# ---- seeded bugs in the port, one per shape


class RidKeyedAcks(DecodeOffloadManager):
    """(A) The ack finds its life by rid: a late ack lands on the request that reused it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.by_rid: dict[str, OffloadRecord] = {}

    def admit(self, req: Req) -> OffloadRecord:
        life = super().admit(req)
        self.by_rid[req.rid] = life
        return life

    def life_of(self, copy: OngoingCopy) -> OffloadRecord:
        return self.by_rid[copy.life.req.rid]  # the bug


class FreeAtRetract(DecodeOffloadManager):
    """(B) A retraction frees the device pages at once, while the flush copy still reads them."""

    def finish(self, req: Req, reason: FinishReason) -> None:
        super().finish(req, reason)
        if reason is FinishReason.RETRACTED and req.offload is not None:
            self.release(req.offload)  # the bug


class FlushCountedAtSubmit(DecodeOffloadManager):
    """(C) The finish-time flush is counted done when submitted: released before its ack."""

    def finish(self, req: Req, reason: FinishReason) -> None:
        life = req.offload
        assert life is not None
        before = life.inflight
        self.offload_kv_cache(req, final=True)
        life.finished = True
        if before == 0:  # the bug: the flush just submitted is not counted
            self.release(life)


class LostFlushAck(DecodeOffloadManager):
    """(D) A flush copy's completion is lost, and the progress check waits for it forever."""

    def check_offload_progress(self) -> None:
        for ack in self.engine.drain():
            if self.ongoing[ack.seq].flush:
                continue  # the bug: dropped, yet still counted as outstanding
            self.on_ack(ack)
        while any(c.flush for c in self.ongoing.values()):
            time.sleep(0.001)  # SGLang's synchronize loop, on an event that never fires
        for result in self.store.poll():
            self.host.free(list(result.token), owner=self)


class ResumeReusesRecord(DecodeOffloadManager):
    """(E) A resumed request reuses its record in place: the retracted life's flush still in
    flight is counted in the new life, and the old life's device pages are never freed."""

    def admit(self, req: Req) -> OffloadRecord:
        old = req.offload
        if old is None:
            return super().admit(req)
        prefill = (len(req.tokens) - 1) // self.page_size
        old.pages, old.done_pages = req.pages, prefill  # the bug: same record, new life
        old.prior = req.keys[prefill - 1] if prefill else None
        old.finished = old.released = False
        return old


class SharedStaging(DecodeOffloadManager):
    """(F) Each copy reads a fixed staging buffer, which the next offload overwrites while
    the copy still reads it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.staging = self.device.reserve(8)

    def source_pages(self, life: OffloadRecord, first: int, n: int) -> list[int]:
        layout = self.device.layout
        for i, page in enumerate(life.pages[first : first + n]):
            layout.write_page(self.staging[i], layout.read_page(page))  # the bug: one buffer
        return self.staging[:n]


class UnchainedKeys(DecodeOffloadManager):
    """(G) Each page keyed by its own tokens: two different prefixes map to one key."""

    def keys_for(self, req: Req, first: int, n: int, prior: str | None) -> list[str]:
        ps = self.page_size
        return [
            page_hashes(req.tokens[p * ps : (p + 1) * ps], ps, None)[0]  # the bug: no prior
            for p in range(first, first + n)
        ]


class SlotCounter(DecodeOffloadManager):
    """(I) Progress kept per request slot, and a slot's counter not reset when a new request
    takes the slot: it offloads from the previous occupant's position."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slot_done: dict[int, int] = {}
        self.free_slots = [0, 1, 2, 3, 4, 5, 6, 7]
        self.slot_of: dict[int, int] = {}

    def admit(self, req: Req) -> OffloadRecord:
        life = super().admit(req)
        slot = self.free_slots.pop(0)
        self.slot_of[id(life)] = slot
        life.done_pages = self.slot_done.setdefault(slot, life.done_pages)  # the bug
        return life

    def submit(self, life: OffloadRecord, *args: Any) -> None:
        super().submit(life, *args)
        self.slot_done[self.slot_of[id(life)]] = life.done_pages

    def release(self, life: OffloadRecord) -> None:
        if not life.released:
            self.free_slots.insert(0, self.slot_of[id(life)])
        super().release(life)


class DropFailedAck(OffloadManager):
    """(D) A failed copy's ack is dropped: its life never drains, its host pages leak."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        apply = self.transfers.apply

        def drop_failed(ack: Ack) -> None:
            if ack.ok:
                apply(ack)

        self.transfers.apply = drop_failed  # type: ignore[method-assign]


def _sglang(manager: type[DecodeOffloadManager]) -> Callable[[], SGLangAdapter]:
    def factory() -> SGLangAdapter:
        return SGLangAdapter(manager)

    factory.__name__ = f"sglang_adapter_of_{manager.__name__}"
    return factory


def sglang_runtime() -> SGLangAdapter:
    """The correct port (``kvlife check --runtime mutant_runtimes:sglang_runtime``)."""
    return SGLangAdapter()


#: Seeded bugs by shape: name -> (shape, adapter factory).
SHAPED: dict[str, tuple[str, Callable[[], Any]]] = {
    "sglang-rid-keyed-acks": ("A", _sglang(RidKeyedAcks)),
    "late-ack-to-newest": ("A", MUTANTS["late-ack-to-newest"]),
    "sglang-free-at-retract": ("B", _sglang(FreeAtRetract)),
    "release-in-flight": ("B", MUTANTS["release-in-flight"]),
    "sglang-flush-counted-at-submit": ("C", _sglang(FlushCountedAtSubmit)),
    "sglang-lost-flush-ack": ("D", _sglang(LostFlushAck)),
    "drop-failed-ack": ("D", _adapter(DropFailedAck)),
    "sglang-resume-reuses-record": ("E", _sglang(ResumeReusesRecord)),
    "sglang-shared-staging": ("F", _sglang(SharedStaging)),
    "sglang-unchained-keys": ("G", _sglang(UnchainedKeys)),
    "ack-order-chain": ("G", MUTANTS["ack-order-chain"]),
    "sglang-slot-counter": ("I", _sglang(SlotCounter)),
    "host-double-free": ("I", MUTANTS["host-double-free"]),
    "state-keyed-by-rid": ("A", MUTANTS["state-keyed-by-rid"]),
}


def reported(rules: set[str], rule: str, message: str) -> bool:
    """Whether a failure (its rule and message) is one of ``rules``.

    A rule written ``"PoolError: is already free"`` is an error the runtime raised: its
    type's name, and a phrase its message must hold, since one error class covers
    several refusals (a double free and a foreign free are both a ``PoolError``; the
    message says which).
    """
    for expected in rules:
        name, _, phrase = expected.partition(": ")
        if name == rule and phrase in message:
            return True
    return False


# Module-level names, for ``kvlife check --runtime mutant_runtimes:<name>``.
sglang_rid_keyed_acks = _sglang(RidKeyedAcks)
sglang_free_at_retract = _sglang(FreeAtRetract)
sglang_flush_counted_at_submit = _sglang(FlushCountedAtSubmit)
sglang_lost_flush_ack = _sglang(LostFlushAck)
sglang_resume_reuses_record = _sglang(ResumeReusesRecord)
sglang_shared_staging = _sglang(SharedStaging)
sglang_unchained_keys = _sglang(UnchainedKeys)
sglang_slot_counter = _sglang(SlotCounter)


# ----------------------------------------------------------------------------- the load half
#
# Each is kvlife's manager with one patch that puts back a load-side bug a serving engine
# shipped; the kit's Return event (a conversation coming back, its prefix restored by a load)
# drives them.


class ReleaseUnderLoad(OffloadManager):
    """(J) Device blocks handed back at finish while a load still writes them (LMCache #4939,
    vLLM #46951): the runtime frees a finished request's blocks without waiting for its load."""

    def finish(self, req: OffloadRequest, *args: Any, **kwargs: Any) -> None:
        handler = req.release_handler
        if req.loading and handler is not None:
            req.release_handler = None
            handler(req, req.device_pages)  # the bug: the load is still writing these
        super().finish(req, *args, **kwargs)


class DropLateLoadAck(OffloadManager):
    """(K) A load's completion after its request ended is filtered out (vllm-ascend #16662):
    the life never drains and the blocks and the pinned host pages leak for good."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        apply = self.transfers.apply

        def drop_late_load(ack: Ack) -> None:
            if ack.is_load and ack.owner.finish_reason is not None:
                return  # the bug: "the request is gone, ignore its load"
            apply(ack)

        self.transfers.apply = drop_late_load  # type: ignore[method-assign]


class TransferDoneByRid(OffloadManager):
    """(L) A preempted request re-admitted while its store is in flight (vLLM #46014): one
    "transfers done" flag per rid, so the new life's load ack also settles the old life's
    store, and the old life is released with its copy still reading its blocks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lives: dict[object, list[OffloadRequest]] = {}
        apply = self.transfers.apply

        def settle_by_rid(ack: Ack) -> None:
            apply(ack)
            if ack.is_load:
                for other in self._lives[ack.owner.rid]:  # the bug: settled by rid
                    for ticket in other._lifecycle.chunks_in_flight():
                        other._lifecycle.ack(ticket)

        self.transfers.apply = settle_by_rid  # type: ignore[method-assign]

    def start(self, rid: object, *args: Any, **kwargs: Any) -> OffloadRequest:
        req = super().start(rid, *args, **kwargs)
        self._lives.setdefault(rid, []).append(req)
        return req


class PendingServed(OffloadManager):
    """(M) A key served while its store is still in flight: a miss on every tier is
    "found" in the host page an in-flight copy is writing, before that copy completed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        promote = self.transfers.promote

        def promote_pending(key: str, name: Any = None) -> bool:
            if promote(key):
                return True
            for copy in self.engine.in_flight():  # type: ignore[attr-defined]
                if type(copy.ticket) is tuple and key in copy.ticket[2]:  # the bug: not written
                    source = copy.host_pages[copy.ticket[2].index(key)]

                    def fill(page: int, source: int = source) -> bool:
                        self.host.tensor[page].copy_(self.host.tensor[source])
                        return True

                    return self.tier.insert_ready(key, fill, pin=True)
            return False

        self.transfers.promote = promote_pending  # type: ignore[method-assign]


class _UnguardedEngine(ScriptedEngine):
    """An engine that does not refuse a copy into a host page a load still reads (kvlife's
    engines do): so the runtime's own mistake shows as the bytes it loads."""

    def _claim(self, *args: Any) -> None:
        pass

    def _unclaim(self, *args: Any) -> None:
        pass


class UnpinnedLoad(OffloadManager):
    """(N) A pinned page evicted under a load: the load's pins are dropped as soon as it is
    submitted, so its host pages are free for the next store while the load still reads them."""

    def load(self, req: OffloadRequest, *args: Any, **kwargs: Any) -> Any:
        ticket = super().load(req, *args, **kwargs)
        if ticket is not None:
            self.tier.complete_load(ticket.keys)  # the bug: unpinned under the copy
        return ticket

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        counts = self.transfers.counts

        def settle_load(ack: Ack) -> None:  # the pins are gone already: the rest only
            if ack.ok:
                counts.pages_loaded += len(ack.keys)
            else:
                counts.load_failures += 1

        self.transfers._settle_load = settle_load  # type: ignore[method-assign]


class AliasedLoads(OffloadManager):
    """(O) Two identical loads alias one job (kvlife's own vLLM backend, found this turn): a
    load of keys another load in flight already reads returns that load's ticket, so the
    second request's blocks are never written and it decodes on whatever they held."""

    def load(self, req: OffloadRequest, *args: Any, **kwargs: Any) -> Any:
        for other in self._live:
            for ticket in other._lifecycle.loads_in_flight():
                if ticket.keys == req.prompt_keys[: len(ticket.keys)]:
                    return ticket  # the bug: one job for both
        return super().load(req, *args, **kwargs)


class FailedLoadAsLoaded(OffloadManager):
    """(P) A failed load reported as loaded (the blind spot issue 35 found adversarially): the
    request is told its load copied every page, so the runtime never recomputes them and
    decodes on whatever the failed copy left in its blocks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        acked = self.transfers._acked
        assert acked is not None

        def loaded_anyway(req: Any, ack: Ack) -> None:
            if ack.is_load and not ack.ok:
                req.loaded_pages += len(ack.keys)  # the bug: a failure counted as loaded
                return
            acked(req, ack)

        self.transfers._acked = loaded_anyway


class PinHeldToClose(OffloadManager):
    """(Q) A pin never dropped while the runtime runs (a liveness bug): a load's pins on its
    host pages are kept after its copy completed and dropped only at shutdown, so the pages
    can never be evicted or freed; a check that looks only after close sees nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held_pins: list[Sequence[str]] = []
        counts = self.transfers.counts

        def settle_load(ack: Ack) -> None:
            self._held_pins.append(ack.ticket[2])  # the bug: the pins stay
            if ack.ok:
                counts.pages_loaded += len(ack.keys)
            else:
                counts.load_failures += 1

        self.transfers._settle_load = settle_load  # type: ignore[method-assign]

    def close(self) -> None:
        for keys in self._held_pins:
            self.tier.complete_load(keys)
        self._held_pins.clear()
        super().close()


def _unguarded(manager: Callable[..., OffloadManager]) -> Callable[[], ManagerAdapter]:
    class Adapter(ManagerAdapter):
        engine_class = _UnguardedEngine

    def factory() -> ManagerAdapter:
        return Adapter(manager_factory=manager)

    factory.__name__ = f"unguarded_adapter_of_{manager.__name__}"
    return factory


LOAD_MUTANTS: dict[str, tuple[str, Callable[[], ManagerAdapter]]] = {
    "load-release-under-load": ("J", _adapter(ReleaseUnderLoad)),
    "load-late-ack-dropped": ("K", _adapter(DropLateLoadAck)),
    "load-transfer-done-by-rid": ("L", _adapter(TransferDoneByRid)),
    "load-pending-served": ("M", _adapter(PendingServed)),
    "load-unpinned": ("N", _unguarded(UnpinnedLoad)),
    "load-aliased": ("O", _adapter(AliasedLoads)),
    "load-failed-as-loaded": ("P", _adapter(FailedLoadAsLoaded)),
    "load-pin-held-to-close": ("Q", _adapter(PinHeldToClose)),
}
SHAPED.update(LOAD_MUTANTS)

# Module-level, for ``kvlife check --runtime mutant_runtimes:load_failed_as_loaded``.
load_failed_as_loaded = _adapter(FailedLoadAsLoaded)
load_pin_held_to_close = _adapter(PinHeldToClose)
