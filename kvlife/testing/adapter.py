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

import contextlib
import hashlib
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from kvlife._lifecycle import FinishReason
from kvlife.errors import KVLifeError
from kvlife.hashing import page_hashes
from kvlife.layout import LayerFirstLayout
from kvlife.manager import OffloadManager, OffloadRequest
from kvlife.pool import HostPagePool
from kvlife.store.base import PageMismatch, Store, StoreResult, _check_put, check_key
from kvlife.store.memory import MemoryStore
from kvlife.testing.options import KitOptions, Progress, progress_of
from kvlife.testing.scripted import ScriptedCopy, ScriptedEngine

__all__ = [
    "OPTIONAL_MEMBERS",
    "AdapterError",
    "Close",
    "Complete",
    "DeviceFull",
    "DevicePages",
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
    "page_bytes_of",
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
    """All the kit needs from a decode runtime's offload bookkeeping.

    Two optional members (:data:`OPTIONAL_MEMBERS`): ``progress``, the runtime's progress
    model (``"poll"``: its poll never blocks and applies the copies that completed, the
    default; ``"drain"``: its poll waits for every queued copy), and
    ``device_pages_allocated()`` (device pages lives hold now: 0 after close, or
    ``device-leak``).
    """

    #: Tokens per page.
    page_size: int
    #: The hash-chain namespace the runtime's keys use (``None``: plain SGLang keys).
    namespace: str | None

    def start(self, rid: str, prompt: Sequence[int]) -> object:
        """Begin a new request life with ``rid`` whose prefill computed ``prompt``; its handle."""
        ...

    def resume(self, request: object, tokens: Sequence[int]) -> object:
        """Resume the retracted request ``request`` (a handle :meth:`start` or :meth:`resume`
        returned) as a new life whose prefill recomputes ``tokens``; the new life's handle.

        Return ``request`` itself if your runtime resumes the same request object (SGLang
        does): the kit then tells the lives apart by which one is running.
        """
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


#: Optional adapter members, read with ``getattr`` (an adapter may leave them out):
#: ``progress`` (default ``"poll"``), ``device_pages_allocated() -> int`` (device pages
#: held by lives now; checked to be 0 after close: the ``device-leak`` rule) and
#: ``host_pages_free() -> int`` (lets the exhaustive checker tell a chunk deferred because
#: the host pool was full from one the runtime skipped).
OPTIONAL_MEMBERS = ("progress", "device_pages_allocated", "host_pages_free")


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
    #: kvlife's poll never blocks: it applies the acks of copies that completed.
    progress: Progress = "poll"

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
        self.layout = LayerFirstLayout.zeros(1, device_pages, page_size, 1, 2, dtype=torch.int32)
        self.host = HostPagePool(host_pages, self.layout.page_numel, torch.int32, pin_memory=False)
        self.engine = ScriptedEngine(self.layout, self.host)
        self.store: Store = _SettledStore(MemoryStore()) if store is None else store
        self.manager = manager_factory(
            self.engine, self.host, self.store, page_size=page_size, stride=stride
        )
        self._free_pages = list(range(device_pages - 1, -1, -1))
        self._poison = torch.full((self.layout.page_numel,), -1, dtype=torch.int32)
        self._requests: dict[OffloadRequest, RuntimeRequest] = {}
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

    def resume(self, request: object, tokens: Sequence[int]) -> RuntimeRequest:
        """A retracted request resumes: kvlife gives it a new life (a new Lifecycle)."""
        old = self._request(request)
        return self.start(old.rid, tokens)

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
        return self._requests[copy.ticket.lifecycle.owner]  # type: ignore[index]

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

    def device_pages_allocated(self) -> int:
        """Device pages lives hold now."""
        return self.layout.num_pages - len(self._free_pages)

    def host_pages_free(self) -> int:
        """Host pages free now (a due chunk may wait for one)."""
        return self.host.num_free

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

    def _on_release(self, record: OffloadRequest, device_pages: Sequence[int]) -> None:
        req = self._requests[record]
        reading = [c for c in self.engine.in_flight() if c.ticket.lifecycle.owner is record]
        self._releases.append(Release(req, tuple(device_pages), len(reading)))
        # The runtime frees the pages it holds for the life: poisoned, reused first.
        for page in reversed(req.pages):
            self.layout.write_page(page, self._poison)
            self._free_pages.append(page)
        req.pages = []


def page_bytes_of(key: str, nbytes: int) -> bytes:
    """A page's bytes as a pure function of its key: the key's digest, repeated."""
    digest = bytes.fromhex(key) if len(key) % 2 == 0 else hashlib.sha256(key.encode()).digest()
    return (digest * (nbytes // len(digest) + 1))[:nbytes]


class DevicePages:
    """The device-page accounting hook, for a runtime that frees its own pages (it has no
    release callback): the adapter hands it to the runtime as its device allocator.

    ``alloc(n, owner)`` gives pages (the most recently freed first); ``write(page, key)``
    fills a page with :func:`page_bytes_of` its key; ``free(pages, owner)`` poisons the
    pages, takes them back and records one :class:`Release` of ``owner`` (so free all of a
    life's pages at once). The adapter's ``device_pages_allocated`` returns
    :meth:`allocated`, its ``releases`` returns :attr:`releases`.
    """

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
        #: Every free, in order, as a :class:`Release`.
        self.releases: list[Release] = []

    def alloc(self, n: int, owner: object) -> list[int]:
        """``n`` pages for ``owner``; :class:`DeviceFull` (nothing taken) if there are fewer."""
        if n > len(self._free):
            raise DeviceFull(f"no {n} free device pages for {owner!r}")
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._owner[page] = owner
        return pages

    def write(self, page: int, key: str) -> None:
        """Write the bytes of the page whose key is ``key`` into device page ``page``."""
        data = bytearray(page_bytes_of(key, self.layout.page_nbytes))
        self.layout.write_page(page, torch.frombuffer(data, dtype=self.layout.dtype))

    def free(self, pages: Sequence[int], owner: object) -> None:
        """Take ``owner``'s ``pages`` back (poisoned, reused first) and record its release."""
        for page in pages:
            if self._owner.get(page) is not owner:
                raise AdapterError(f"device page {page} is not held by {owner!r}")
        inflight = self._in_flight(owner) if self._in_flight is not None else 0
        self.releases.append(Release(owner, tuple(pages), inflight))
        for page in reversed(pages):
            del self._owner[page]
            self.layout.write_page(page, self._poison)
            self._free.append(page)

    def reserve(self, n: int) -> list[int]:
        """Take ``n`` pages out of the pool for good (a runtime's own staging buffer): never
        handed to a life, not counted by :meth:`allocated`."""
        if n > len(self._free):
            raise DeviceFull(f"no {n} free device pages to reserve")
        return [self._free.pop() for _ in range(n)]

    def allocated(self) -> int:
        """Pages held by owners now."""
        return len(self._owner)


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
    """Resume retracted life ``life`` as a new life (:meth:`RuntimeAdapter.resume`): same rid
    (often the same request object), its tokens so far as the prompt."""

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


@dataclass(frozen=True)
class Close:
    """The end of a run: finish every running life, complete every copy, poll, close, check."""

    def __str__(self) -> str:
        return "close"


#: One event of a run, as data (the exhaustive checker's traces, the strategies' sequences).
KitEvent = Start | Step | Finish | Resume | Complete | Poll | Close


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


class _Stuck(BaseException):
    """Raised by the deadline's alarm inside a runtime call that blocks too long."""


@contextlib.contextmanager
def _deadline(seconds: float | None) -> Iterator[None]:
    """Interrupt the block with :class:`_Stuck` after ``seconds`` (main thread, POSIX only;
    elsewhere no deadline). An outer alarm (pytest-timeout's) is put back afterwards."""
    if (
        seconds is None
        or not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    done = False

    def on_alarm(signum: int, frame: object) -> None:
        if not done:
            raise _Stuck  # again every 50 ms, in case a callback swallowed it

    t0 = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, _ = signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
    try:
        yield
    finally:
        done = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:
            left = old_delay - (time.monotonic() - t0)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))


class Oracle:
    """The trusted model: drives an adapter and checks every rule after every event.

    Under the adapter's ``progress`` model: with ``"drain"``, every copy in flight when a
    poll starts is complete when it returns. A copy submitted while a life finishes (a
    finish-time flush) belongs to that life. Every adapter call runs under
    ``options.stuck_after``: a call still blocked then is a ``stuck-copy`` violation.
    """

    def __init__(self, adapter: RuntimeAdapter, options: KitOptions | None = None) -> None:
        self.adapter = adapter
        self.options = options or KitOptions()
        self.progress: Progress = progress_of(adapter)
        self.lives: list[Life] = []
        self.trace: list[KitEvent] = []
        self._by_handle: dict[int, list[Life]] = {}
        self._owner: dict[int, Life] = {}  # id(copy) -> life (the copy is kept in life.copies)
        self._completed: set[int] = set()
        self._allowed: set[str] = set()
        self._verified: set[str] = set()
        self._releases_seen = 0
        self._flushing: Life | None = None
        #: A call did not return within the deadline: the adapter is left as it is.
        self.stuck = False

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

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            with _deadline(self.options.stuck_after):
                return fn(*args)
        except _Stuck:
            self.stuck = True
            raise InvariantViolation(
                "stuck-copy",
                f"{what} did not return within {self.options.stuck_after} s: it waits for a "
                f"copy whose ack never comes (copies in flight: {self.in_flight()})",
            ) from None

    def apply(self, event: KitEvent) -> None:
        """Run ``event`` on the adapter, update the model, check every rule."""
        if isinstance(event, Close):
            self.close()
            return
        self.trace.append(event)
        if isinstance(event, Start):
            self._start(event.rid, event.prompt)
        elif isinstance(event, Resume):
            life = self.lives[event.life]
            life.resumed = True
            self._start(life.rid, tuple(life.tokens), life)
        elif isinstance(event, Step):
            life = self.lives[event.life]
            life.tokens.extend(event.tokens)
            self._extend_keys(life)
            self._call(str(event), self.adapter.step, life.handle, event.tokens)
        elif isinstance(event, Finish):
            life = self.lives[event.life]
            self.check()  # copies submitted before the finish are not a flush
            life.reason = event.reason
            self._flushing = life
            try:
                self._call(str(event), self.adapter.finish, life.handle, event.reason)
                self._check_copies()  # a finish-time flush belongs to the finishing life
            finally:
                self._flushing = None
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
            self._call(str(event), self.adapter.complete, copy, event.ok)
            if event.poll:
                self._poll()
        else:
            self._poll()
        self.check()

    def _poll(self) -> None:
        if self.progress == "drain":
            self.check()  # registers the copies queued before the poll
            queued = self.in_flight()
            self._call("poll", self.adapter.poll)
            self._completed.update(id(c) for c in queued)  # the poll waited for each
        else:
            self._call("poll", self.adapter.poll)

    def complete(self, copy: object, ok: bool, poll: bool) -> None:
        """Complete one copy the adapter lists as in flight (the stateful machine's event)."""
        self.check()
        life = self._owner[id(copy)]
        self.apply(Complete(life.index, life.copies.index(copy), ok, poll))

    def _start(self, rid: str, prompt: tuple[int, ...], resumed: Life | None = None) -> None:
        if resumed is None:
            handle = self._call(f"start rid={rid}", self.adapter.start, rid, prompt)
        else:
            resume = getattr(self.adapter, "resume", None)
            if resume is None:  # an adapter from before resume was explicit
                handle = self._call(f"start rid={rid}", self.adapter.start, rid, prompt)
            else:
                handle = self._call(f"resume life {resumed.index}", resume, resumed.handle, prompt)
        same = self._by_handle.get(id(handle), [])
        if any(
            life.handle is handle and not (resumed is not None and life.handle is resumed.handle)
            for life in same
        ):
            raise InvariantViolation(
                "copy-owner", "start returned the handle of an older life (resume did not ask)"
            )
        life = Life(len(self.lives), rid, handle, list(prompt))
        self.lives.append(life)
        self._by_handle.setdefault(id(handle), []).append(life)
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
        self.trace.append(Close())
        self.check()
        if self.progress == "poll":
            for copy in self.in_flight():
                self._completed.add(id(copy))
                self._call(f"complete {copy!r}", self.adapter.complete, copy, True)
        self._poll()
        self.check()
        # A copy the kit completed may take a moment to leave a threaded engine's list.
        deadline = time.monotonic() + (self.options.stuck_after or 0.0)
        while self._listed_completed() and time.monotonic() < deadline:
            time.sleep(0.002)
            self._poll()
            self.check()
        self._call("close", self.adapter.close)
        self.check()
        left = self.adapter.copies_in_flight()
        if left:
            raise InvariantViolation(
                "stuck-copy",
                f"copies still in flight after close (their ack never came within "
                f"{self.options.stuck_after} s): {list(left)}",
            )
        never = [life for life in self.lives if not life.released]
        if never:
            raise InvariantViolation("unreleased", f"never released (device pages leaked): {never}")
        used = self.adapter.host_pages_allocated()
        if used:
            raise InvariantViolation("host-leak", f"{used} host pages still allocated after close")
        held = getattr(self.adapter, "device_pages_allocated", None)
        if held is not None and held():
            raise InvariantViolation(
                "device-leak", f"{held()} device pages still held after every life was released"
            )

    def _listed_completed(self) -> bool:
        return any(id(c) in self._completed for c in self.adapter.copies_in_flight())

    def abandon(self) -> None:
        """Close the adapter after a failure, bounded by the deadline; errors are dropped.
        An adapter that was stuck is not called again."""
        if self.stuck:
            return
        with contextlib.suppress(Exception, _Stuck), _deadline(self.options.stuck_after):
            self.adapter.close()

    # ---------------------------------------------------------------- the rules

    def check(self) -> None:
        """Compare what the adapter reports now with the model; raise on the first broken rule."""
        self._check_copies()
        self._check_releases()
        self._check_store()

    def _lives_of(self, handle: object, what: str) -> list[Life]:
        lives = [life for life in self._by_handle.get(id(handle), []) if life.handle is handle]
        if not lives:
            raise InvariantViolation("copy-owner", f"{what} names an unknown request {handle!r}")
        return lives

    def _check_copies(self) -> None:
        for copy in self.adapter.copies_in_flight():
            key = id(copy)
            if key in self._owner:
                continue  # known; a completed one still listed is waited for at close
            lives = self._lives_of(self.adapter.copy_request(copy), f"copy {copy!r}")
            life = next((lf for lf in lives if lf.running), None)
            if life is None and self._flushing in lives and not self._flushing.released:
                life = self._flushing
            if life is None:
                raise InvariantViolation(
                    "copy-owner", f"{copy!r} submitted for {lives[-1]}, which already finished"
                )
            self._owner[key] = life
            life.copies.append(copy)

    def _check_releases(self) -> None:
        releases = self.adapter.releases()
        while self._releases_seen < len(releases):
            release = releases[self._releases_seen]
            self._releases_seen += 1
            lives = self._lives_of(release.request, "a release")
            waiting = [lf for lf in lives if not lf.released]
            if not waiting:
                raise InvariantViolation("release-once", f"{lives[-1]} released twice")
            ended = [lf for lf in waiting if not lf.running]
            if not ended:
                raise InvariantViolation(
                    "release-once",
                    f"{waiting[0]} released before it finished (an ack moved a life it does "
                    "not belong to?)",
                )
            # Lives sharing one request object: the release is of one that may be released.
            life = next((lf for lf in ended if not self.in_flight(lf)), ended[0])
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
