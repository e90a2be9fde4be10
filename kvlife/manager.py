"""Decode-side offload orchestration: what a decode runtime calls each step.

The runtime's scheduler thread owns the manager (no locks on the hot path): ``start`` a
request life, ``offload`` after each decode step (the stride policy picks the due chunk),
``poll`` each step, ``finish`` (the release callback gets the device pages once nothing is in
flight), ``close`` to drain; ``lookup`` and ``load`` are the load half. It sits on the copy
pipeline and the host tier (``docs/design.md``); the stride policy is in
``docs/integration.md``, page accounting and every failure path in ``docs/failures.md``.
"""

from __future__ import annotations

import operator
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from itertools import islice
from threading import get_ident
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvlife._lifecycle import (
    DECODING,
    FinishReason,
    Lifecycle,
    LifecycleSnapshot,
    LoadTicket,
    State,
    Ticket,
)
from kvlife.engine.base import Ack
from kvlife.errors import (
    ConfigError,
    HashingError,
    KVLifeError,
    LifecycleError,
    ManagerError,
    ReleaseCallbackError,
)
from kvlife.hashing import PageHasher, namespace_prior, sglang_page_hashes
from kvlife.host_tier import HostTier, Lookup
from kvlife.refusals import Refusals
from kvlife.transfers import Transfers

if TYPE_CHECKING:
    from kvlife.engine.base import CopyEngine
    from kvlife.pool import HostPagePool
    from kvlife.store.base import Store

__all__ = [
    "Agreement",
    "ManagerMetrics",
    "OffloadManager",
    "OffloadRequest",
    "PrefixLookup",
    "ReleaseHandler",
]

#: The runtime's release callback: ``(request, device_pages)``, called exactly once.
ReleaseHandler = Callable[["OffloadRequest", Sequence[int]], object]


class Agreement(Protocol):
    """How the ranks of a tensor-parallel group agree on acks: the manager tells it of every
    submission, in order, and applies only the acks it returns, those every rank completed, in
    submission order (``docs/distributed.md``); without one, every ack is applied at once."""

    def submitted(self, ticket: Ticket | LoadTicket) -> None:
        """Record one submission, a chunk or a load (every rank submits the same sequence)."""

    def agree(self, acks: list[Ack]) -> list[Ack]:
        """Take this rank's newly completed acks; return those every rank completed."""

    def admit(self, n_pages: int) -> bool:
        """Whether to take ``n_pages`` host pages now: the same answer on every rank."""

    def least(self, value: int) -> int:
        """The smallest of every rank's ``value`` (a collective, called by every rank)."""

    @property
    def pending(self) -> int:
        """Submissions not yet returned by :meth:`agree`."""


class PrefixLookup(NamedTuple):
    """What :meth:`OffloadManager.lookup` found of a prompt's whole pages, in page order."""

    #: The storage key of each whole page of the prompt.
    keys: tuple[str, ...]
    #: Leading pages loadable now: ready on the host tier, or whole and verified in the store.
    ready: int
    #: Whether the page after those is still being copied or written (wait, or recompute).
    pending: bool


class OffloadRequest:
    """One request life, from :meth:`OffloadManager.start`: the runtime passes it back to
    the manager, and its release handler receives it. Its events go through the manager; it
    shows its Lifecycle read-only."""

    __slots__ = (
        "__weakref__",
        "_lifecycle",
        "device_pages",
        "load_failures",
        "loaded_pages",
        "manager",
        "next_page",
        "prefill_len",
        "prompt_keys",
        "release_handler",
    )

    def __init__(
        self,
        manager: OffloadManager,
        lifecycle: Lifecycle,
        prefill_len: int,
        release_handler: ReleaseHandler | None,
    ) -> None:
        #: The manager that started the life (the only one that takes it).
        self.manager = manager
        self._lifecycle = lifecycle
        #: The device page table as last given (page i holds tokens [i*P, (i+1)*P)), kept by
        #: reference (the release handler receives this object): mutate it only through steps.
        self.device_pages: Sequence[int] = ()
        #: Tokens the prefill side already stored (prompt rounded down to whole pages).
        self.prefill_len = prefill_len
        #: The first page not prefilled and not yet offloaded: where the next chunk starts.
        self.next_page = prefill_len // manager.page_size
        self.release_handler = release_handler
        #: Keys of the prompt's whole pages (what :meth:`OffloadManager.load` reads).
        self.prompt_keys: tuple[str, ...] = ()
        #: Prompt pages loads copied into the device pages successfully so far.
        self.loaded_pages = 0
        #: Loads whose copy failed (the runtime recomputes those pages).
        self.load_failures = 0

    @property
    def rid(self) -> object:
        """The request id: a label for logs, never a key."""
        return self._lifecycle.rid

    @property
    def state(self) -> State:
        """The Lifecycle's :class:`~kvlife.State`."""
        return self._lifecycle.state

    @property
    def inflight(self) -> int:
        """Chunks and loads started and not yet acked."""
        return self._lifecycle.inflight

    @property
    def decoding(self) -> bool:
        """Whether the request still decodes (steps and loads are taken): not finished."""
        return DECODING[self._lifecycle._state]

    @property
    def loading(self) -> bool:
        """Whether a load of this request is in flight (its device pages are being written)."""
        return self._lifecycle.loads_in_flight_count > 0

    def snapshot(self) -> LifecycleSnapshot:
        """Every observable field of the Lifecycle, for comparing whole states."""
        return self._lifecycle.snapshot()

    def __repr__(self) -> str:
        lc = self._lifecycle
        return (
            f"<OffloadRequest rid={lc.rid!r} {lc.state.name} inflight={lc.inflight} "
            f"id=0x{id(self):x}>"
        )


def _metric(kind: str, help_text: str) -> Any:
    """A scalar field of :class:`ManagerMetrics`: its Prometheus kind and help travel with it."""
    return field(default=0, metadata={"kind": kind, "help": help_text})


@dataclass
class ManagerMetrics:
    """The manager's counters (:meth:`OffloadManager.metrics`: a copy, gauges read then);
    scalar fields carry their Prometheus kind and help (``field.metadata``)."""

    lifecycles_started: int = _metric("counter", "Request lives started")
    lifecycles_by_state: dict[str, int] = field(default_factory=dict)
    chunks_submitted: int = _metric("counter", "Chunks submitted for device-to-host copy")
    chunks_in_flight: int = _metric("gauge", "Chunks submitted and not yet acked")
    chunks_acked: int = _metric("counter", "Chunks whose copy completed (or failed)")
    pages_offloaded: int = _metric("counter", "Pages copied to host successfully")
    bytes_offloaded: int = _metric("counter", "Bytes copied to host successfully")
    pages_stored: int = _metric("counter", "Pages the store reported written")
    store_writes_pending: int = _metric("gauge", "Store writes not yet reported")
    host_pages_used: int = _metric("gauge", "Host pages allocated")
    host_pool_exhausted: int = _metric(
        "counter", "Due chunks deferred because the host pool was full"
    )
    copy_failures: int = _metric("counter", "Chunks whose copy failed")
    store_failures: int = _metric("counter", "Store writes that failed or were refused")
    release_callback_errors: int = _metric("counter", "Release callbacks that raised")
    loads_started: int = _metric("counter", "Loads of a prompt prefix into device pages started")
    pages_loaded: int = _metric("counter", "Pages loaded into device pages successfully")
    load_failures: int = _metric("counter", "Loads whose copy failed")
    pages_promoted: int = _metric("counter", "Store pages read into the host tier for a load")
    lookups_pending: int = _metric(
        "counter", "Lookups that stopped at a page still being copied or written"
    )
    host_tier_keys: int = _metric("gauge", "Keys held ready or pending on the host tier")
    host_tier_evicted: int = _metric("counter", "Host-tier keys evicted to make room")
    refused_events: dict[str, int] = field(default_factory=dict)
    ack_latency_count: int = 0
    ack_latency_sum_s: float = 0.0
    ack_latency_max_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain dict, for JSON."""
        return dict(self.__dict__)


def _count(name: str, value: object, least: int) -> int:
    """A whole number >= ``least`` (numpy integers too), else :class:`ConfigError`."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name} must be an int, got {value!r}") from None
    if number < least:
        raise ConfigError(f"{name} must be at least {least}, got {number}")
    return number


def _slice(items: Sequence[int], start: int, stop: int) -> Sequence[int]:
    """``items[start:stop]`` (tokens or pages) of any ordered sequence; a deque cannot be sliced."""
    if type(items) is list or type(items) is tuple:
        return items[start:stop]
    if isinstance(items, (Set, Mapping)):
        raise TypeError(f"expected an ordered sequence, got {type(items).__name__}")
    try:
        return items[start:stop]
    except TypeError:
        if not isinstance(items, Sequence):
            raise
        return tuple(islice(items, start, stop))


class OffloadManager:
    """Decode-side KV offload: stride policy, acks, backup to a store, release exactly once.

    Call it from one thread, the scheduler's: the first call binds it, and a call from another
    while that one runs is refused (:class:`~kvlife.errors.ManagerError`; :meth:`metrics` may
    be read from any). ``stride``: tokens, rounded down to whole pages (one page at least;
    ``None``: one). Managers may share an engine, a store or a host pool: what one's poll takes
    for another's request is handed over, applied at that one's next poll or close.
    """

    def __init__(
        self,
        engine: CopyEngine,
        host: HostPagePool,
        store: Store,
        *,
        page_size: int,
        stride: int | None = None,
        namespace: str | None = None,
        hasher: PageHasher = sglang_page_hashes,
        agreement: Agreement | None = None,
        keep_on_host: bool = False,
    ) -> None:
        page_size = _count("page_size", page_size, 1)
        if type(keep_on_host) is not bool:
            raise ConfigError(f"keep_on_host must be a bool, got {keep_on_host!r}")
        if keep_on_host and agreement is not None:
            raise ConfigError("keep_on_host is not supported with a rank agreement yet")
        stride = page_size if stride is None else _count("stride", stride, page_size)
        self.engine = engine
        self.host = host
        self.store = store
        self.page_size = page_size
        self.stride = stride // page_size * page_size
        self.namespace = namespace
        self.hasher = hasher
        self.agreement = agreement
        self._seed = namespace_prior(namespace) if namespace is not None else None
        self._page_bytes = host.tensor[0].numel() * host.tensor.element_size()
        self._thread: int | None = None  # the scheduler thread, bound at the first call
        self._thread_obj: threading.Thread | None = None
        self._live: set[OffloadRequest] = set()  # started, not yet released
        self._released = 0
        #: Refusals by kind: a refused call raises (counted), a refused ack or write is logged.
        self.refusals = Refusals()
        #: Written chunks' pages with ``keep_on_host``, and store pages promoted for a load.
        self.tier: HostTier[str] = HostTier(
            host, keep=keep_on_host, refusals=Refusals(strict=True), events=False
        )
        #: The counters, mutated in place (by the pipeline too); :meth:`metrics` copies them.
        self._metrics = ManagerMetrics()
        #: The copy pipeline: acks to their requests, pages to the store, freed or kept.
        self.transfers = Transfers(
            engine,
            host,
            store,
            refusals=self.refusals,
            tier=self.tier,
            agreement=agreement,
            counts=self._metrics,
            route=_route,
            acked=_loaded,
        )
        #: Errors raised by release callbacks, newest last (bounded), for the runtime to log.
        self.callback_errors = self.transfers.callback_errors

    def start(
        self,
        rid: object,
        prompt: Sequence[int],
        on_release: ReleaseHandler | None = None,
        *,
        prior_hash: str | None = None,
    ) -> OffloadRequest:
        """Begin one request life; the chain continues from the prompt's whole pages (from
        ``prior_hash``, their last key, where the prefill side gave it; else hashed here)."""
        self._check_thread()
        keys: tuple[str, ...] = ()
        try:
            prefill_len = len(prompt) // self.page_size * self.page_size
            if prior_hash is None:
                prior_hash = self._seed
                if prefill_len:
                    keys = self._prompt_keys(prompt, prefill_len)
                    prior_hash = keys[-1]
            else:  # the scheme checks a prior it is given even with no page to hash
                self.hasher((), self.page_size, prior_hash)
        except (HashingError, TypeError) as exc:
            raise self._refuse(f"cannot start rid={rid!r}: {exc}") from None
        lc = Lifecycle(
            rid,
            page_size=self.page_size,
            on_release=self._on_release,
            prior_hash=prior_hash,
            hasher=self.hasher,
        )
        req = lc.owner = OffloadRequest(self, lc, prefill_len, on_release)
        req.prompt_keys = keys
        self._live.add(req)
        self._metrics.lifecycles_started += 1
        return req

    def offload(
        self, req: OffloadRequest, tokens: Sequence[int], device_pages: Sequence[int]
    ) -> Ticket | None:
        """After a decode step, submit the chunk due, if any, and return its ticket. ``tokens``:
        the request's so far (the newest has no KV yet); ``device_pages``: its page table.
        ``None`` when nothing is due or the host pool is full (nothing changed; due again next
        step). A refusal raises before anything changes."""
        # The hot path: most steps submit nothing, so this prefix reads the record's slots
        # only; it changes only the page table, so the thread is checked once a chunk is due.
        if req.__class__ is not OffloadRequest or req.manager is not self:
            self._check_owned(req)
        if not DECODING[req._lifecycle._state]:
            raise self._invalid_step(req, "decoding has ended; no more steps")
        first = req.next_page  # pages prefilled or already offloaded
        start = first * self.page_size
        try:  # free in CPython 3.11+ unless it raises
            ready = len(tokens) - 1 - start  # tokens with KV not yet offloaded
            if ready < self.stride:
                if ready < -1:
                    raise self._invalid_step(
                        req, f"{len(tokens)} tokens, but {start} are already offloaded or prefilled"
                    )
                if len(device_pages) < first:
                    raise self._invalid_step(
                        req,
                        f"{len(device_pages)} device pages cannot hold the {start} tokens "
                        "before them",
                    )
                req.device_pages = device_pages
                return None
            n_device = len(device_pages)
        except TypeError:
            raise self._invalid_step(req, "tokens and device_pages must be sequences") from None
        if get_ident() != self._thread:  # inline: offload and poll run every step
            self._check_thread()
        n = ready // self.stride * self.stride
        end = (start + n) // self.page_size
        if n_device < end:
            raise self._invalid_step(req, f"{n_device} device pages cannot hold {start + n} tokens")
        try:
            chunk_tokens = _slice(tokens, start, start + n)
            chunk_pages = _slice(device_pages, first, end)
        except TypeError as exc:
            raise self._invalid_step(req, str(exc)) from None
        agreement = self.agreement
        # host pool full (on some rank, with an agreement: then none submits)
        if agreement is not None and not agreement.admit(end - first):
            host_pages = None
        else:
            host_pages = self.host.alloc(end - first, owner=req)
            if host_pages is None and self.tier.make_room(end - first):  # evict cached pages
                host_pages = self.host.alloc(end - first, owner=req)
        if host_pages is None:
            self._metrics.host_pool_exhausted += 1
            return None
        # Until the Lifecycle holds the chunk, any exception gives the host pages back.
        try:
            self.engine.check(chunk_pages, host_pages)
            ticket = req._lifecycle.submit(chunk_tokens)
        except BaseException as exc:
            self.host.free(host_pages, owner=req)
            if isinstance(exc, KVLifeError):
                self.refusals.counted(exc)
            raise
        req.device_pages = device_pages
        req.next_page = end
        self._metrics.chunks_submitted += 1
        # check() passed, so an engine failing now is a failed copy, settled there.
        self.transfers.submit(ticket, chunk_pages, host_pages)
        return ticket

    def finish(
        self,
        req: OffloadRequest,
        reason: FinishReason = FinishReason.FINISHED,
        device_pages: Sequence[int] | None = None,
    ) -> None:
        """End decoding; release runs now if nothing is in flight, else at the last ack.
        ``device_pages``: the final page table, if it changed since the last step."""
        self._check_thread()
        self._check_owned(req)
        kept = req.device_pages
        if device_pages is not None:
            req.device_pages = device_pages
        try:  # the release handler runs after the state moved on: it may step no more
            req._lifecycle.finish(reason)
        except ReleaseCallbackError as exc:
            self.transfers.record_callback_error(exc)
        except LifecycleError as exc:  # refused before anything changed
            req.device_pages = kept
            self.refusals.counted(exc)
            raise

    def lookup(self, prompt: Sequence[int]) -> PrefixLookup:
        """How much of ``prompt``'s whole-page prefix can be loaded now (ready on the host
        tier, or in the store); ``pending``: the next page is still being copied or written
        (wait, never load it). Changes nothing."""
        self._check_thread()
        full = len(prompt) // self.page_size * self.page_size
        try:
            keys = self._prompt_keys(prompt, full) if full else ()
        except (HashingError, TypeError) as exc:
            raise self._refuse(f"cannot look up a prompt: {exc}") from None
        ready = self._leading(keys, self.transfers.in_store)
        # "pending": that page's copy to the host or write to the store is in flight
        pending = ready < len(keys) and (
            self.transfers.writing(keys[ready])
            or any(
                keys[ready] in ticket[2]
                for req in tuple(self._live)
                for ticket in req._lifecycle.chunks_in_flight()
            )
        )
        if self.agreement is not None:  # every rank's answer: the shortest prefix, and
            # "pending" where a rank with that prefix waits on the next page
            agreed = self.agreement.least(2 * ready + (not pending))
            ready, pending = agreed >> 1, not agreed & 1
        if pending:
            self._metrics.lookups_pending += 1
        return PrefixLookup(keys, ready, pending)

    def load(
        self, req: OffloadRequest, device_pages: Sequence[int], pages: int | None = None
    ) -> LoadTicket | None:
        """Copy the ready prefix of the request's prompt (at most ``pages``; page ``i`` to
        ``device_pages[i]``) and return the load's ticket, or ``None`` if no page is ready.
        Store pages are read and verified into the host tier first (a bad one is a miss); the
        host pages stay pinned, the request unreleased, until the ack. A refusal raises before
        anything changes. With an :class:`Agreement` every rank loads the prefix all hold (a
        collective: call it on every rank)."""
        self._check_thread()
        self._check_owned(req)
        if not DECODING[req._lifecycle._state]:
            raise self._invalid_step(req, "decoding has ended; nothing to load into")
        keys = req.prompt_keys
        limit = len(keys) if pages is None else _count("pages", pages, 0)
        try:
            if len(device_pages) < min(limit, len(keys)):
                raise self._invalid_step(
                    req, f"{len(device_pages)} device pages cannot hold the prefix to load"
                )
        except TypeError:
            raise self._invalid_step(req, "device_pages must be a sequence") from None
        tier, agreement, transfers = self.tier, self.agreement, self.transfers
        wanted = todo = keys[:limit]
        if agreement is not None:  # promote only what every rank can: the same on each
            wanted = todo = wanted[: agreement.least(self._leading(wanted, transfers.in_store))]
            # One host page admitted per page to promote, before any read, from what every
            # rank sees alike (the agreed keys, the tier, the agreed budget); a page admitted
            # and not loaded comes back with the budget at the next poll.
            todo = wanted[: self._leading(wanted, lambda key: agreement.admit(1))]
        host_pages = transfers.pin_for_load(todo)
        ready = list(todo[: len(host_pages)])
        if agreement is not None and wanted:  # a promotion failed on some rank: load less
            agreed = agreement.least(len(ready))
            tier.complete_load(ready[agreed:])
            del ready[agreed:], host_pages[agreed:]
        if not ready:
            return None
        device = list(_slice(device_pages, 0, len(ready)))
        try:
            self.engine.check(device, host_pages, load=True)
            ticket = req._lifecycle.load(ready)
        except BaseException as exc:
            tier.complete_load(ready)
            if isinstance(exc, KVLifeError):
                self.refusals.counted(exc)
            raise
        self._metrics.loads_started += 1
        req.device_pages = device_pages  # the page table the release hands back, as offload's
        transfers.submit(ticket, device, host_pages)
        return ticket

    def _leading(self, keys: Sequence[str], missing: Callable[[str], bool]) -> int:
        """How many leading ``keys`` are ready on the host tier, or missing and ``missing``."""
        tier, n = self.tier, 0
        for key in keys:
            found = tier.lookup(key)
            if found is not Lookup.HIT and (found is not Lookup.MISS or not missing(key)):
                break
            n += 1
        return n

    def _prompt_keys(self, prompt: Sequence[int], full: int) -> tuple[str, ...]:
        return tuple(self.hasher(_slice(prompt, 0, full), self.page_size, self._seed))

    def poll(self) -> None:
        """Apply completed copies and store writes. Never blocks (an :class:`Agreement` runs
        its collective here, every call). An exception from one (a store or pool error; a
        release callback's is reported, not raised) loses no other: they wait for the next."""
        if get_ident() != self._thread:  # inline: offload and poll run every step
            self._check_thread()
        self.transfers.poll()

    def close(self, timeout: float | None = None) -> None:
        """Drain every copy and store write (a release callback's new request's too): then
        nothing is in flight or allocated. ``timeout`` bounds the whole call; past it
        :class:`~kvlife.errors.DrainTimeout`, nothing lost (a later call applies the rest)."""
        self._check_thread()
        self.transfers.drain(timeout)

    def _on_release(self, lc: Lifecycle) -> None:
        req = lc.owner
        assert isinstance(req, OffloadRequest)
        self._live.discard(req)
        self._released += 1
        handler = req.release_handler
        try:
            if handler is not None:
                handler(req, req.device_pages)
        finally:  # no ack can reach the request now; no cycle keeps it from being freed
            lc.owner = self

    def _check_thread(self) -> None:
        """Bind the manager to the calling thread; refuse another while that one is alive."""
        if get_ident() == self._thread:
            return
        bound = self._thread_obj
        if bound is not None and bound.is_alive():
            raise self._refuse(
                f"called from thread {threading.current_thread().name!r}, but this manager is "
                f"driven by {bound.name!r}: call it from one thread (its scheduler's)"
            )
        self._thread_obj = threading.current_thread()
        self._thread = get_ident()

    def _refuse(self, message: str) -> ManagerError:
        """Count a refused call; return its error, for the caller to raise."""
        return self.refusals.counted(ManagerError(message))

    def _invalid_step(self, req: OffloadRequest, why: str) -> ManagerError:
        return self._refuse(f"request rid={req.rid!r} id=0x{id(req):x}: {why}")

    def _check_owned(self, req: object) -> None:
        if not isinstance(req, OffloadRequest) or req.manager is not self:
            raise self._refuse(f"{req!r} was not started by this manager")

    def metrics(self) -> ManagerMetrics:
        """A copy of the counters, with the gauges read now (any thread may call it)."""
        m = self._metrics
        by_state = Counter(req.state.name for req in tuple(self._live))
        return replace(
            m,
            lifecycles_by_state={  # every state: live requests by state, then the released
                **{s.name: by_state[s.name] for s in State},
                State.RELEASED.name: self._released,
            },
            chunks_in_flight=m.chunks_submitted - m.chunks_acked,
            bytes_offloaded=m.pages_offloaded * self._page_bytes,
            store_writes_pending=self.store.pending,
            host_pages_used=self.host.num_used,
            host_tier_keys=self.tier.counts.entries,
            host_tier_evicted=self.tier.counts.evicted,
            refused_events=self.refusals.snapshot(),
        )


def _route(owner: object) -> tuple[Transfers, object] | None:
    """The pipeline and the request of the Lifecycle ``owner``; ``None`` if forged."""
    req = getattr(owner, "owner", None)
    if isinstance(req, OffloadRequest):
        return req.manager.transfers, req
    if isinstance(req, OffloadManager):  # released: its Lifecycle refuses every ack
        return req.transfers, None
    return None


def _loaded(req: object, ack: Ack) -> None:
    """A load applied: the request learns what it got (the runtime recomputes a failure)."""
    if type(ack.ticket) is LoadTicket and isinstance(req, OffloadRequest):  # ack.is_load
        if ack.error is None:
            req.loaded_pages += len(ack.keys)
        else:
            req.load_failures += 1
