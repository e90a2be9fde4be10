"""What the kit needs from a runtime (the adapter), and what it checks of it (the oracle).

Theory of operation
===================

The kit plays a decode scheduler against *your* offload bookkeeping. It talks
to it only through a :class:`RuntimeAdapter`: start a request life with a rid,
run decode steps, finish it with a reason, list the copies in flight, complete
one of them (success or failure) when the kit decides, poll, close; and observe
what happened: which lives were released with which device pages (and how many
of their copies were still in flight right then), which pages were stored under
which keys, how many host pages are allocated.

The adapter owns the device side: it gives each life device pages, writes each
page's KV values as soon as the page is whole, and takes the pages back (and
poisons and reuses them at once) when the life is released. Page values are a
pure function of the page's key (:meth:`RuntimeAdapter.page_bytes`), so a page
stored under a key it does not belong to is caught by its bytes.

:class:`Oracle` is the trusted model. It replays the same events, knows each
life's tokens (hence its keys: :func:`kvlife.hashing.page_hashes` in page
order), which copies the kit has completed, which lives finished; after every
event :meth:`Oracle.check` compares what the adapter reports with DESIGN.md's
rules and raises :class:`InvariantViolation` naming the rule:

* ``release-once``: a life is released at most once, and only after it finished
  (an ack that moved another life shows up here);
* ``release-in-flight``: never while a copy of it is in flight;
* ``misfiled-page``: a stored page's bytes are the bytes of its key's page;
* ``hash-chain``: every stored key is a key of some life's tokens, chained in page order;
* ``copy-owner``: copies belong to a live, unfinished life when they appear;
* at close, ``unreleased`` and ``host-leak``: every life released exactly once,
  every host page freed (a double free raises in the pool and surfaces as is).

:class:`ManagerAdapter` is the adapter for a runtime built on kvlife's
:class:`~kvlife.manager.OffloadManager`, with a
:class:`~kvlife.testing.scripted.ScriptedEngine`, a
:class:`~kvlife.store.MemoryStore` and a small layer-first KV pool.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from kvlife._lifecycle import FinishReason
from kvlife.errors import KVLifeError
from kvlife.hashing import page_hashes
from kvlife.layout import LayerFirstLayout
from kvlife.manager import ManagedLifecycle, OffloadManager
from kvlife.pool import HostPagePool
from kvlife.store.base import PageMismatch, Store, StoreResult, _check_put, check_key
from kvlife.store.memory import MemoryStore
from kvlife.testing.scripted import ScriptedCopy, ScriptedEngine

__all__ = [
    "AdapterError",
    "Complete",
    "DeviceFull",
    "Finish",
    "InlineStore",
    "InvariantViolation",
    "KitEvent",
    "Life",
    "ManagerAdapter",
    "Oracle",
    "Poll",
    "Release",
    "Resume",
    "RuntimeAdapter",
    "Start",
    "Step",
]


class AdapterError(KVLifeError):
    """A call the adapter refused (a request it does not know, a full device pool)."""


class DeviceFull(AdapterError):
    """The adapter's device KV pool has no free page for a step or a start."""


class InvariantViolation(KVLifeError, AssertionError):
    """The runtime broke one of the lifecycle rules; ``rule`` names it."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"[{rule}] {message}")
        self.rule = rule


@dataclass(frozen=True)
class Release:
    """One release the runtime performed: the request life, its device pages, copies in flight."""

    #: The handle :meth:`RuntimeAdapter.start` returned for the life.
    request: object
    #: The device pages the runtime was told it may free.
    device_pages: tuple[int, ...]
    #: Copies of this life still reading device pages at that moment (must be 0).
    copies_in_flight: int


@runtime_checkable
class RuntimeAdapter(Protocol):
    """All the kit needs from a decode runtime's offload bookkeeping."""

    #: Tokens per page.
    page_size: int
    #: The hash-chain namespace the runtime's keys use (``None``: plain SGLang keys).
    namespace: str | None

    def start(self, rid: str, prompt: Sequence[int]) -> object:
        """Begin a request life with ``rid`` whose prefill computed ``prompt``; its handle."""
        ...

    def step(self, request: object, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` (append them, write whole pages' KV), then offload what is due."""
        ...

    def finish(self, request: object, reason: FinishReason) -> None:
        """Decoding of the life ended (finished, aborted, retracted)."""
        ...

    def copies_in_flight(self) -> Sequence[object]:
        """Copies submitted and not yet completed, as opaque handles, in submit order."""
        ...

    def copy_request(self, copy: object) -> object:
        """The request handle a copy belongs to."""
        ...

    def complete(self, copy: object, ok: bool = True) -> None:
        """Complete one copy now: it reads its device pages (``ok``) or fails."""
        ...

    def poll(self) -> None:
        """One scheduler poll: the runtime applies completed copies and store writes."""
        ...

    def close(self) -> None:
        """Drain and shut down; afterwards nothing may be in flight or allocated."""
        ...

    def releases(self) -> Sequence[Release]:
        """Every release so far, in order."""
        ...

    def stored_keys(self) -> Iterable[str]:
        """Every key the store holds."""
        ...

    def stored_page(self, key: str) -> bytes | None:
        """The stored bytes under ``key``."""
        ...

    def page_bytes(self, key: str) -> bytes:
        """The bytes the page whose key is ``key`` holds on the device (a pure function)."""
        ...

    def host_pages_allocated(self) -> int:
        """Host pages allocated now."""
        ...


# ----------------------------------------------------------------------------- kvlife's adapter


class _SettledStore:
    """A store whose writes are all complete at each poll: interleavings come from copies."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner

    def put(self, token: object, keys: Sequence[str], pages: torch.Tensor) -> None:
        self.inner.put(token, keys, pages)

    def poll(self) -> list[StoreResult]:
        return self.inner.drain()

    def drain(self, timeout: float | None = None) -> list[StoreResult]:
        return self.inner.drain(timeout)

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def keys(self) -> Iterator[str]:
        return self.inner.keys()

    def close(self) -> None:
        self.inner.close()

    @property
    def pending(self) -> int:
        return self.inner.pending


class InlineStore:
    """A :class:`~kvlife.store.Store` that writes each put at once, on the caller's thread.

    Pages in a dict, all-or-nothing, same refusals and mismatch rule as the
    other stores; results come at the next poll. No thread, so a run is cheap
    and deterministic (the exhaustive checker builds one per interleaving).
    """

    def __init__(self) -> None:
        self._pages: dict[str, bytes] = {}
        self._done: list[StoreResult] = []

    def put(self, token: object, keys: Sequence[str], pages: torch.Tensor) -> None:
        """Store every page under its key now, or none; the result comes at the next poll."""
        checked = _check_put(keys, pages)
        rows = pages.detach().contiguous().view(torch.uint8).numpy()
        copies = {key: rows[i].tobytes() for i, key in enumerate(checked)}
        error: BaseException | None = None
        for key, page in copies.items():
            held = self._pages.get(key)
            if held is not None and held != page:
                error = PageMismatch(f"key {key} is stored with different bytes", key=key)
                break
        if error is None:
            self._pages.update(copies)
        self._done.append(StoreResult(token, checked, error))

    def poll(self) -> list[StoreResult]:
        """Results of the puts since the last poll or drain."""
        done, self._done = self._done, []
        return done

    def drain(self, timeout: float | None = None) -> list[StoreResult]:
        """Same as :meth:`poll`: every put is already complete."""
        return self.poll()

    def get(self, key: str) -> bytes | None:
        """The stored bytes under ``key``."""
        return self._pages.get(check_key(key))

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored."""
        return check_key(key) in self._pages

    def keys(self) -> Iterator[str]:
        """Every stored key."""
        return iter(list(self._pages))

    def close(self) -> None:
        """Nothing to stop."""

    @property
    def pending(self) -> int:
        """Results not yet returned by poll or drain."""
        return len(self._done)


class RuntimeRequest:
    """The runtime's side of one request life: tokens, device page table, page keys."""

    __slots__ = ("handle", "keys", "pages", "rid", "tokens", "written")

    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.rid = rid
        self.tokens = tokens
        self.pages: list[int] = []
        self.keys: list[str] = []
        self.written = 0
        self.handle: Any = None

    def __repr__(self) -> str:
        return f"<request rid={self.rid!r} tokens={len(self.tokens)} id=0x{id(self):x}>"


#: Builds an offload manager from (engine, host pool, store, page_size=, stride=).
ManagerFactory = Callable[..., OffloadManager]


class ManagerAdapter:
    """The kit's adapter for kvlife's :class:`~kvlife.manager.OffloadManager` (or a subclass).

    A scripted engine, a MemoryStore whose writes complete by the next poll
    (or the given ``store``), a layer-first device pool whose page values are
    the page key's digest, and a small host pool (``host_pages``) so that
    exhaustion is frequent.
    """

    namespace: str | None = None

    def __init__(
        self,
        *,
        page_size: int = 2,
        stride: int | None = None,
        host_pages: int = 6,
        device_pages: int = 128,
        manager_factory: ManagerFactory = OffloadManager,
        store: Store | None = None,
    ) -> None:
        self.page_size = page_size
        self.layout = LayerFirstLayout(1, device_pages, page_size, 1, 2, dtype=torch.int32)
        self.host = HostPagePool(host_pages, self.layout.page_numel, torch.int32, pin_memory=False)
        self.engine = ScriptedEngine(self.layout, self.host)
        self.store: Store = _SettledStore(MemoryStore()) if store is None else store
        self.manager = manager_factory(
            self.engine, self.host, self.store, page_size=page_size, stride=stride
        )
        self._free_pages = list(range(device_pages - 1, -1, -1))
        self._poison = torch.full((self.layout.page_numel,), -1, dtype=torch.int32)
        self._requests: dict[ManagedLifecycle, RuntimeRequest] = {}
        self._releases: list[Release] = []
        self._closed = False

    # ---------------------------------------------------------------- driving

    def start(self, rid: str, prompt: Sequence[int]) -> RuntimeRequest:
        """Prefill ``prompt`` into fresh device pages and start a manager life."""
        req = RuntimeRequest(rid, list(prompt))
        self._grow(req)
        req.handle = self.manager.start(rid, req.tokens, self._on_release)
        self._requests[req.handle] = req
        return req

    def step(self, request: object, tokens: Sequence[int]) -> None:
        """Append ``tokens``, write the pages that became whole, and offload what is due."""
        req = self._request(request)
        req.tokens.extend(tokens)
        self._grow(req)
        self.manager.offload(req.handle, req.tokens, req.pages)

    def finish(self, request: object, reason: FinishReason) -> None:
        """Tell the manager the life's decoding ended."""
        self.manager.finish(self._request(request).handle, reason)

    def copies_in_flight(self) -> list[ScriptedCopy]:
        """The scripted engine's copies not yet completed, in submit order."""
        return self.engine.in_flight()

    def copy_request(self, copy: object) -> RuntimeRequest:
        """The request life whose Lifecycle submitted ``copy``."""
        if not isinstance(copy, ScriptedCopy):
            raise AdapterError(f"{copy!r} is not a copy of this adapter's engine")
        return self._requests[copy.ticket.lifecycle]  # type: ignore[index]

    def complete(self, copy: object, ok: bool = True) -> None:
        """Complete ``copy`` in the scripted engine (it reads the device pages now)."""
        if not isinstance(copy, ScriptedCopy):
            raise AdapterError(f"{copy!r} is not a copy of this adapter's engine")
        self.engine.complete(copy, ok)

    def poll(self) -> None:
        """One manager poll."""
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

    # ---------------------------------------------------------------- observing

    def releases(self) -> list[Release]:
        """Every release so far."""
        return self._releases

    def stored_keys(self) -> Iterable[str]:
        """Every key in the store."""
        return self.store.keys()

    def stored_page(self, key: str) -> bytes | None:
        """The stored bytes under ``key``."""
        return self.store.get(key)

    def page_bytes(self, key: str) -> bytes:
        """The key's digest, repeated to the page's size: what the device page holds."""
        return page_bytes_of(key, self.layout.page_nbytes)

    def host_pages_allocated(self) -> int:
        """Host pages allocated now."""
        return self.host.num_used

    # ---------------------------------------------------------------- device side

    def _request(self, request: object) -> RuntimeRequest:
        if not isinstance(request, RuntimeRequest) or self._requests.get(request.handle) is not (
            request
        ):
            raise AdapterError(f"{request!r} was not started by this adapter")
        return request

    def _grow(self, req: RuntimeRequest) -> None:
        """Give ``req`` device pages for all its tokens; write each page once it is whole."""
        size = self.page_size
        while len(req.pages) * size < len(req.tokens):
            if not self._free_pages:
                raise DeviceFull(f"no free device page for {req!r}")
            req.pages.append(self._free_pages.pop())
        whole = (len(req.tokens) - 1) // size  # the newest token has no KV yet
        if whole > len(req.keys):
            prior = req.keys[-1] if req.keys else None
            new = req.tokens[len(req.keys) * size : whole * size]
            req.keys.extend(page_hashes(new, size, prior, namespace=self.namespace))
        nbytes = self.layout.page_nbytes
        while req.written < whole:
            values = torch.frombuffer(
                bytearray(page_bytes_of(req.keys[req.written], nbytes)), dtype=torch.int32
            )
            self.layout.write_page(req.pages[req.written], values)
            req.written += 1

    def _on_release(self, lc: ManagedLifecycle, device_pages: Sequence[int]) -> None:
        req = self._requests[lc]
        self._releases.append(Release(req, tuple(device_pages), len(self.engine.in_flight(lc))))
        # The runtime frees the pages it holds for the life: poisoned, reused first.
        for page in reversed(req.pages):
            self.layout.write_page(page, self._poison)
            self._free_pages.append(page)
        req.pages = []


def page_bytes_of(key: str, nbytes: int) -> bytes:
    """A page's bytes as a pure function of its key: the key's digest, repeated."""
    digest = bytes.fromhex(key) if len(key) % 2 == 0 else hashlib.sha256(key.encode()).digest()
    return (digest * (nbytes // len(digest) + 1))[:nbytes]


# ----------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Start:
    """Start a new life with ``rid`` and ``prompt``."""

    rid: str
    prompt: tuple[int, ...]

    def __str__(self) -> str:
        return f"start rid={self.rid} prompt={len(self.prompt)} tokens"


@dataclass(frozen=True)
class Step:
    """Decode ``tokens`` for life number ``life`` (lives are numbered in start order)."""

    life: int
    tokens: tuple[int, ...]

    def __str__(self) -> str:
        return f"step life {self.life} +{len(self.tokens)} tokens"


@dataclass(frozen=True)
class Finish:
    """End life ``life`` with ``reason``."""

    life: int
    reason: FinishReason

    def __str__(self) -> str:
        return f"finish life {self.life} {self.reason.value}"


@dataclass(frozen=True)
class Resume:
    """Start a new life for retracted life ``life``: same rid, its tokens so far as the prompt."""

    life: int

    def __str__(self) -> str:
        return f"resume life {self.life}"


@dataclass(frozen=True)
class Complete:
    """Complete the ``chunk``-th copy life ``life`` submitted (``ok`` or failed), then poll."""

    life: int
    chunk: int
    ok: bool = True
    poll: bool = True

    def __str__(self) -> str:
        then = ", poll" if self.poll else ""
        return f"complete life {self.life} chunk {self.chunk} {'ok' if self.ok else 'FAIL'}{then}"


@dataclass(frozen=True)
class Poll:
    """One scheduler poll."""

    def __str__(self) -> str:
        return "poll"


#: One event of a run, as data (the exhaustive checker's traces, the strategies' sequences).
KitEvent = Start | Step | Finish | Resume | Complete | Poll


# ----------------------------------------------------------------------------- the oracle


class Life:
    """The oracle's model of one request life."""

    __slots__ = (
        "copies",
        "handle",
        "index",
        "keys",
        "reason",
        "released",
        "resumed",
        "rid",
        "tokens",
    )

    def __init__(self, index: int, rid: str, handle: object, tokens: list[int]) -> None:
        self.index = index
        self.rid = rid
        self.handle = handle
        self.tokens = tokens
        self.keys: list[str] = []
        self.reason: FinishReason | None = None
        self.released = False
        self.resumed = False
        #: Copies this life submitted, in submit order.
        self.copies: list[object] = []

    @property
    def running(self) -> bool:
        """Started and not finished."""
        return self.reason is None

    def __repr__(self) -> str:
        return f"life {self.index} (rid {self.rid})"


class Oracle:
    """The trusted model: drives an adapter and checks every rule after every event."""

    def __init__(self, adapter: RuntimeAdapter) -> None:
        self.adapter = adapter
        self.lives: list[Life] = []
        self.trace: list[KitEvent] = []
        self._by_handle: dict[int, Life] = {}
        self._owner: dict[int, Life] = {}  # id(copy) -> life (the copy is kept in life.copies)
        self._completed: set[int] = set()
        self._allowed: set[str] = set()
        self._verified: set[str] = set()
        self._releases_seen = 0

    # ---------------------------------------------------------------- queries

    def running(self) -> list[Life]:
        """Lives started and not finished."""
        return [life for life in self.lives if life.running]

    def resumable(self) -> list[Life]:
        """Retracted lives not yet resumed whose rid no running life uses."""
        busy = {life.rid for life in self.running()}
        return [
            life
            for life in self.lives
            if life.reason is FinishReason.RETRACTED and not life.resumed and life.rid not in busy
        ]

    def unreleased(self) -> int:
        """Lives not released yet (they hold device pages)."""
        return sum(not life.released for life in self.lives)

    def in_flight(self, life: Life | None = None) -> list[object]:
        """Copies the kit has not completed (only ``life``'s if given), in submit order."""
        lives = self.lives if life is None else [life]
        return [c for lf in lives for c in lf.copies if id(c) not in self._completed]

    # ---------------------------------------------------------------- events

    def apply(self, event: KitEvent) -> None:
        """Run ``event`` on the adapter, update the model, check every rule."""
        self.trace.append(event)
        if isinstance(event, Start):
            self._start(event.rid, event.prompt)
        elif isinstance(event, Resume):
            life = self.lives[event.life]
            life.resumed = True
            self._start(life.rid, tuple(life.tokens))
        elif isinstance(event, Step):
            life = self.lives[event.life]
            life.tokens.extend(event.tokens)
            self._extend_keys(life)
            self.adapter.step(life.handle, event.tokens)
        elif isinstance(event, Finish):
            life = self.lives[event.life]
            life.reason = event.reason
            self.adapter.finish(life.handle, event.reason)
        elif isinstance(event, Complete):
            life = self.lives[event.life]
            self.check()  # registers the copies submitted so far
            if event.chunk >= len(life.copies):
                raise InvariantViolation(
                    "copy-owner",
                    f"{life} submitted {len(life.copies)} chunks; chunk {event.chunk} "
                    "was due and never submitted",
                )
            copy = life.copies[event.chunk]
            self._completed.add(id(copy))
            self.adapter.complete(copy, event.ok)
            if event.poll:
                self.adapter.poll()
        else:
            self.adapter.poll()
        self.check()

    def complete(self, copy: object, ok: bool, poll: bool) -> None:
        """Complete one copy the adapter lists as in flight (the stateful machine's event)."""
        self.check()
        life = self._owner[id(copy)]
        self.apply(Complete(life.index, life.copies.index(copy), ok, poll))

    def _start(self, rid: str, prompt: tuple[int, ...]) -> None:
        handle = self.adapter.start(rid, prompt)
        if id(handle) in self._by_handle:
            raise InvariantViolation("copy-owner", "start returned the handle of an older life")
        life = Life(len(self.lives), rid, handle, list(prompt))
        self.lives.append(life)
        self._by_handle[id(handle)] = life
        self._extend_keys(life)

    def _extend_keys(self, life: Life) -> None:
        size = self.adapter.page_size
        whole = (len(life.tokens) - 1) // size
        if whole > len(life.keys):
            prior = life.keys[-1] if life.keys else None
            new = page_hashes(
                life.tokens[len(life.keys) * size : whole * size],
                size,
                prior,
                namespace=self.adapter.namespace,
            )
            life.keys.extend(new)
            self._allowed.update(new)

    def close(self) -> None:
        """Finish every running life, complete every copy, poll, close; then the final rules."""
        for life in self.running():
            self.apply(Finish(life.index, FinishReason.FINISHED))
        self.check()
        for copy in self.in_flight():
            self.complete(copy, ok=True, poll=False)
        self.apply(Poll())
        self.adapter.close()
        self.check()
        left = self.adapter.copies_in_flight()
        if left:
            raise InvariantViolation("copy-owner", f"copies still in flight after close: {left}")
        never = [life for life in self.lives if not life.released]
        if never:
            raise InvariantViolation("unreleased", f"never released (device pages leaked): {never}")
        used = self.adapter.host_pages_allocated()
        if used:
            raise InvariantViolation("host-leak", f"{used} host pages still allocated after close")

    # ---------------------------------------------------------------- the rules

    def check(self) -> None:
        """Compare what the adapter reports now with the model; raise on the first broken rule."""
        self._check_copies()
        self._check_releases()
        self._check_store()

    def _life_of(self, handle: object, what: str) -> Life:
        life = self._by_handle.get(id(handle))
        if life is None or life.handle is not handle:
            raise InvariantViolation("copy-owner", f"{what} names an unknown request {handle!r}")
        return life

    def _check_copies(self) -> None:
        for copy in self.adapter.copies_in_flight():
            key = id(copy)
            owner = self._owner.get(key)
            if owner is not None:
                if key in self._completed:
                    raise InvariantViolation(
                        "copy-owner", f"{copy!r} of {owner} was completed and is in flight again"
                    )
                continue
            life = self._life_of(self.adapter.copy_request(copy), f"copy {copy!r}")
            if life.released or not life.running:
                raise InvariantViolation(
                    "copy-owner", f"{copy!r} submitted for {life}, which already finished"
                )
            self._owner[key] = life
            life.copies.append(copy)

    def _check_releases(self) -> None:
        releases = self.adapter.releases()
        while self._releases_seen < len(releases):
            release = releases[self._releases_seen]
            self._releases_seen += 1
            life = self._life_of(release.request, "a release")
            if life.released:
                raise InvariantViolation("release-once", f"{life} released twice")
            if life.running:
                raise InvariantViolation(
                    "release-once",
                    f"{life} released before it finished (an ack moved a life it does not "
                    "belong to?)",
                )
            pending = self.in_flight(life)
            if release.copies_in_flight or pending:
                raise InvariantViolation(
                    "release-in-flight",
                    f"{life} released (device pages {list(release.device_pages)}) with "
                    f"{max(release.copies_in_flight, len(pending))} copies in flight: {pending}",
                )
            life.released = True

    def _check_store(self) -> None:
        for key in list(self.adapter.stored_keys()):
            if key in self._verified:
                continue
            if key not in self._allowed:
                raise InvariantViolation(
                    "hash-chain",
                    f"page stored under key {key[:12]}.., which no life's tokens hash to in "
                    "page order",
                )
            if self.adapter.stored_page(key) != self.adapter.page_bytes(key):
                raise InvariantViolation(
                    "misfiled-page",
                    f"page stored under key {key[:12]}.. holds another page's bytes",
                )
            self._verified.add(key)
