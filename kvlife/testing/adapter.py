"""What the kit needs from a runtime (:class:`RuntimeAdapter`), and kvlife's own adapter.

The adapter owns the device side: page values are a pure function of the page's key
(:func:`page_bytes_of`), and a released life's pages are poisoned and reused at once.
Guide: docs/testing-kit.md, "Writing an adapter for another runtime".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from kvlife._lifecycle import FinishReason, LoadTicket
from kvlife.errors import KVLifeError
from kvlife.hashing import page_hashes
from kvlife.layout import LayerFirstLayout
from kvlife.manager import OffloadManager, OffloadRequest
from kvlife.pool import HostPagePool
from kvlife.store.base import Store
from kvlife.store.memory import InlineStore
from kvlife.testing.options import Progress
from kvlife.testing.scripted import ScriptedCopy, ScriptedEngine

__all__ = [
    "AdapterError",
    "DevicePages",
    "ManagerAdapter",
    "Release",
    "RuntimeAdapter",
    "RuntimeRequest",
    "page_bytes_of",
]


class AdapterError(KVLifeError):
    """A call the adapter refused: a request or copy it does not know, a device page its
    owner does not hold, or a full device KV pool (no free page for a start or a step);
    the message says which."""


@dataclass(frozen=True)
class Release:
    """One release the runtime performed."""

    #: The handle :meth:`RuntimeAdapter.start` returned for the life.
    request: object
    #: The device pages the runtime was told it may free.
    device_pages: tuple[int, ...]
    #: Copies of this life still reading device pages at that moment (must be 0).
    copies_in_flight: int


@runtime_checkable
class RuntimeAdapter(Protocol):
    """All the kit needs from a decode runtime's offload bookkeeping. Optional members, read
    with ``getattr``: ``progress`` (default ``"poll"``), ``device_pages_allocated()``,
    ``host_pages_free()``, and the load half: ``restore(request)``, ``copy_is_load(copy)``,
    ``copy_keys(copy)`` and ``device_page(request, index)`` (docs/testing-kit.md)."""

    #: Tokens per page.
    page_size: int
    #: The hash-chain namespace the runtime's keys use (``None``: plain SGLang keys).
    namespace: str | None

    def start(self, rid: str, prompt: Sequence[int]) -> object:
        """Begin a new request life with ``rid`` whose prefill computed ``prompt``; its handle."""

    def resume(self, request: object, tokens: Sequence[int]) -> object:
        """Resume retracted ``request`` as a new life recomputing ``tokens``; its handle
        (``request`` itself if the runtime reuses the request object)."""

    def step(self, request: object, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` (append them, write whole pages' KV), then offload what is due."""

    def finish(self, request: object, reason: FinishReason) -> None:
        """Decoding of the life ended (finished, aborted, retracted)."""

    def copies_in_flight(self) -> Sequence[object]:
        """Copies submitted and not yet completed, as opaque handles, in submit order."""

    def copy_request(self, copy: object) -> object:
        """The request handle a copy belongs to."""

    def complete(self, copy: object, ok: bool = True) -> None:
        """Complete one copy now: it reads its device pages (``ok``) or fails."""

    def poll(self) -> None:
        """One scheduler poll: the runtime applies completed copies and store writes."""

    def close(self) -> None:
        """Drain and shut down; afterwards nothing may be in flight or allocated."""

    def releases(self) -> Sequence[Release]:
        """Every release so far, in order."""

    def stored_keys(self) -> Iterable[str]:
        """Every key the store holds."""

    def stored_page(self, key: str) -> bytes | None:
        """The stored bytes under ``key``."""

    def page_bytes(self, key: str) -> bytes:
        """The bytes the page whose key is ``key`` holds on the device (a pure function)."""

    def host_pages_allocated(self) -> int:
        """Host pages allocated now."""


# ----------------------------------------------------------------------------- kvlife's adapter


@dataclass(eq=False)
class RuntimeRequest:
    """The runtime's side of one request life: tokens, device page table, page keys."""

    rid: str
    tokens: list[int]
    pages: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    written: int = 0
    handle: Any = None
    #: A failed load's pages were computed again.
    recomputed: bool = False
    #: Its prompt pages are still to be stored as the prefill side would.
    prefill_pending: bool = False

    def __repr__(self) -> str:
        return f"<request rid={self.rid!r} tokens={len(self.tokens)} id=0x{id(self):x}>"


#: Builds an offload manager from (engine, host pool, store, page_size=, stride=).
ManagerFactory = Callable[..., OffloadManager]


class ManagerAdapter:
    """The kit's adapter for kvlife's :class:`~kvlife.manager.OffloadManager` (or a subclass):
    a scripted engine, an :class:`~kvlife.store.InlineStore` (or ``store``), a layer-first
    device pool and a small host pool, so that exhaustion is frequent."""

    namespace: str | None = None
    #: kvlife's poll never blocks: it applies the acks of copies that completed.
    progress: Progress = "poll"
    #: The copy engine the adapter builds (a subclass may use another).
    engine_class: type[ScriptedEngine] = ScriptedEngine

    def __init__(
        self,
        *,
        page_size: int = 2,
        stride: int | None = None,
        host_pages: int = 6,
        device_pages: int = 128,
        manager_factory: ManagerFactory = OffloadManager,
        store: Store | None = None,
        prefill_store: bool = True,
    ) -> None:
        self.page_size = page_size
        self.layout = LayerFirstLayout.zeros(1, device_pages, page_size, 1, 2, dtype=torch.int32)
        self.host = HostPagePool(host_pages, self.layout.page_numel, torch.int32, pin_memory=False)
        self.engine = self.engine_class(self.layout, self.host)
        self.store: Store = InlineStore() if store is None else store
        self.manager = manager_factory(
            self.engine, self.host, self.store, page_size=page_size, stride=stride
        )
        self.device = DevicePages(self.layout)
        #: Store each life's whole prompt pages as the prefill side would (so a returning
        #: conversation finds its prefix); the puts are not the manager's.
        self.prefill_store = prefill_store
        self._requests: dict[OffloadRequest, RuntimeRequest] = {}
        self._releases: list[Release] = []
        self._closed = False

    def start(self, rid: str, prompt: Sequence[int]) -> RuntimeRequest:
        req = RuntimeRequest(rid, list(prompt))
        self._grow(req)
        req.handle = self.manager.start(rid, req.tokens, self._on_release)
        self._requests[req.handle] = req
        req.prefill_pending = self.prefill_store
        return req

    def _prefill(self, req: RuntimeRequest) -> None:
        """Store the prompt pages the prefill side computed, once, before the life goes on
        (a restored life's prompt was loaded, not prefilled: it stores none)."""
        if not req.prefill_pending:
            return
        req.prefill_pending = False
        computed = min(len(req.keys), len(req.handle.prompt_keys))  # prompt pages with KV
        if computed:
            pages = torch.stack([self.layout.read_page(p) for p in req.pages[:computed]])
            self.store.put(("prefill", req.rid), req.keys[:computed], pages)

    def restore(self, request: object) -> None:
        """Load the request's prompt prefix: the pages the load covers hold poison until its
        copy completes; the rest are recomputed (written) at once."""
        req = self._request(request)
        req.prefill_pending = False
        computed = min(len(req.keys), len(req.pages))
        for page in req.pages[:computed]:
            self.device.poison(page)
        ticket = self.manager.load(req.handle, req.pages)
        loaded = 0 if ticket is None else len(ticket.keys)
        for i in range(loaded, computed):
            self.device.write(req.pages[i], req.keys[i])

    def copy_is_load(self, copy: object) -> bool:
        return type(self._copy(copy).ticket) is LoadTicket

    def copy_keys(self, copy: object) -> tuple[str, ...]:
        return self._copy(copy).ticket[2]

    def device_page(self, request: object, index: int) -> bytes:
        req = self._request(request)
        page = self.layout.read_page(req.pages[index]).contiguous()
        return page.view(-1).view(torch.uint8).numpy().tobytes()

    def resume(self, request: object, tokens: Sequence[int]) -> RuntimeRequest:
        """kvlife gives a resumed request a new life (a new Lifecycle)."""
        return self.start(self._request(request).rid, tokens)

    def step(self, request: object, tokens: Sequence[int]) -> None:
        req = self._request(request)
        self._prefill(req)
        if req.handle.load_failures and not req.recomputed:  # a failed load: recompute
            req.recomputed = True
            for i in range(min(len(req.keys), len(req.pages))):
                self.device.write(req.pages[i], req.keys[i])
        req.tokens.extend(tokens)
        self._grow(req)
        self.manager.offload(req.handle, req.tokens, req.pages)

    def finish(self, request: object, reason: FinishReason) -> None:
        req = self._request(request)
        self._prefill(req)
        self.manager.finish(req.handle, reason)

    def copies_in_flight(self) -> list[ScriptedCopy]:
        return self.engine.in_flight()

    def copy_request(self, copy: object) -> RuntimeRequest:
        return self._requests[self._copy(copy).lifecycle.owner]  # type: ignore[index]

    def complete(self, copy: object, ok: bool = True) -> None:
        self.engine.complete(self._copy(copy), ok)

    def poll(self) -> None:
        self.manager.poll()

    def close(self) -> None:
        """Drain the manager, then stop the store's writer thread (also when draining raised)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.manager.close()
        finally:
            self.engine.close()
            self.store.close()

    def releases(self) -> list[Release]:
        return self._releases

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

    def refusal_counts(self) -> dict[str, int]:
        """Refusals the manager counted, by kind (coverage)."""
        return self.manager.refusals.snapshot()

    def pinned_pages(self) -> int:
        """Host pages a load still pins (the liveness phase)."""
        tier = self.manager.tier
        return sum(1 for k in tier.held() if (e := tier.entry(k)) is not None and e.pins)

    def pending_keys(self) -> list[str]:
        """Keys whose store is still pending in the host tier (the liveness phase)."""
        tier = self.manager.tier
        return [k for k in tier.held() if (e := tier.entry(k)) is not None and e.pending]

    def host_pages_held_by_tier(self) -> int:
        """Host pages the host tier holds (a copy of a stored page)."""
        return len(self.manager.tier)

    def _request(self, request: object) -> RuntimeRequest:
        if isinstance(request, RuntimeRequest) and self._requests.get(request.handle) is request:
            return request
        raise AdapterError(f"{request!r} was not started by this adapter")

    def _copy(self, copy: object) -> ScriptedCopy:
        if not isinstance(copy, ScriptedCopy):
            raise AdapterError(f"{copy!r} is not a copy of this adapter's engine")
        return copy

    def _grow(self, req: RuntimeRequest) -> None:
        """Give ``req`` device pages for all its tokens; write each page once it is whole."""
        size = self.page_size
        missing = -(-len(req.tokens) // size) - len(req.pages)
        if missing > 0:
            req.pages += self.device.alloc(missing, req)
        extend_page_keys(req.keys, req.tokens, size, self.namespace)
        while req.written < len(req.keys):
            self.device.write(req.pages[req.written], req.keys[req.written])
            req.written += 1

    def _on_release(self, record: OffloadRequest, device_pages: Sequence[int]) -> None:
        req = self._requests[record]
        reading = sum(c.lifecycle.owner is record for c in self.engine.in_flight())
        self._releases.append(Release(req, tuple(device_pages), reading))
        self.device._reclaim(req.pages)
        req.pages = []


def extend_page_keys(
    keys: list[str], tokens: Sequence[int], page_size: int, namespace: str | None
) -> list[str]:
    """Append to ``keys`` the chained keys of the pages of ``tokens`` that became whole (the
    newest token has no KV yet, so its page is not whole); the keys added."""
    whole = (len(tokens) - 1) // page_size
    if whole <= len(keys):
        return []
    prior = keys[-1] if keys else None
    new = page_hashes(
        tokens[len(keys) * page_size : whole * page_size], page_size, prior, namespace=namespace
    )
    keys.extend(new)
    return new


def page_bytes_of(key: str, nbytes: int) -> bytes:
    """A page's bytes as a pure function of its key: the key's digest, repeated."""
    digest = bytes.fromhex(key) if len(key) % 2 == 0 else hashlib.sha256(key.encode()).digest()
    return (digest * (nbytes // len(digest) + 1))[:nbytes]


class DevicePages:
    """The device-page accounting hook for a runtime that frees its own pages (it has no
    release callback): its device allocator (docs/testing-kit.md)."""

    def __init__(
        self,
        layout: LayerFirstLayout,
        copies_in_flight: Callable[[object], int] | None = None,
    ) -> None:
        self.layout = layout
        self._free = list(range(layout.num_pages - 1, -1, -1))
        self._owner: dict[int, object] = {}
        self._in_flight = copies_in_flight
        self._poison = torch.full((layout.page_numel,), -1, dtype=layout.dtype)
        #: Every free, in order.
        self.releases: list[Release] = []

    def alloc(self, n: int, owner: object) -> list[int]:
        """``n`` pages for ``owner``, or :class:`AdapterError` (nothing taken)."""
        if n > len(self._free):
            raise AdapterError(f"no {n} free device pages for {owner!r}")
        pages = [self._free.pop() for _ in range(n)]
        self._owner.update(dict.fromkeys(pages, owner))
        return pages

    def write(self, page: int, key: str) -> None:
        """Write the bytes of the page with ``key`` (:func:`page_bytes_of`) into ``page``."""
        data = bytearray(page_bytes_of(key, self.layout.page_nbytes))
        self.layout.write_page(page, torch.frombuffer(data, dtype=self.layout.dtype))

    def free(self, pages: Sequence[int], owner: object) -> None:
        """Take back ``owner``'s ``pages`` and record one :class:`Release` of ``owner``."""
        for page in pages:
            if self._owner.get(page) is not owner:
                raise AdapterError(f"device page {page} is not held by {owner!r}")
        inflight = self._in_flight(owner) if self._in_flight is not None else 0
        self.releases.append(Release(owner, tuple(pages), inflight))
        self._reclaim(pages)

    def poison(self, page: int) -> None:
        """Overwrite ``page`` with poison (a page whose KV is not computed yet)."""
        self.layout.write_page(page, self._poison)

    def _reclaim(self, pages: Sequence[int]) -> None:
        """Poison ``pages`` and put them back to be reused first (no release recorded)."""
        for page in reversed(pages):
            del self._owner[page]
            self.layout.write_page(page, self._poison)
            self._free.append(page)

    def reserve(self, n: int) -> list[int]:
        """Take ``n`` pages for good (a staging buffer): no owner, not :meth:`allocated`."""
        if n > len(self._free):
            raise AdapterError(f"no {n} free device pages to reserve")
        return [self._free.pop() for _ in range(n)]

    def allocated(self) -> int:
        """Pages held by owners now."""
        return len(self._owner)
