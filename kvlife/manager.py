"""Decode-side offload orchestration: what a decode runtime calls each step.

The runtime's scheduler thread owns the manager (no locks on the hot path).
Its primitives, one line each:

* :meth:`OffloadManager.start` -- a request life begins: a new Lifecycle whose
  hash chain continues from the prefill side's pages;
* :meth:`OffloadManager.offload` -- after a decode step: submit the chunk that
  is due under the stride policy, if any;
* :meth:`OffloadManager.poll` -- each step: apply completed copies (ack the
  Lifecycle, hand host pages to the store), free host pages the store holds;
* :meth:`OffloadManager.finish` -- decoding ended (finished, aborted,
  retracted); the release callback gets the device pages once nothing is in flight;
* :meth:`OffloadManager.close` -- drain every copy and every store write;
* :meth:`OffloadManager.metrics` -- a snapshot of counters.

Page accounting, end to end: a chunk's host pages are allocated before its
Lifecycle is told of the chunk (so a full host pool changes nothing), are owned
in the host pool by that Lifecycle (a free by anyone else is refused), belong to
that chunk alone, and are freed exactly once: when the store reports the pages
written, or at once when the copy or the store failed. A chunk's device
pages go back to the runtime only through the release callback, which the
Lifecycle calls only when nothing is in flight.

Stride policy (the SGLang decode-offload rules): the first ``prefill_len`` =
prompt length rounded down to whole pages were stored by the prefill side;
tokens with KV are all tokens but the newest; the next chunk starts at
``prefill_len + submitted`` and covers the largest multiple of the stride that
has KV; a tail shorter than the stride is never offloaded (its device pages go
back with the rest at release).
"""

from __future__ import annotations

import operator
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from itertools import islice
from threading import get_ident
from typing import TYPE_CHECKING, Any, Protocol

from kvlife._lifecycle import FinishReason, Lifecycle, LoadTicket, State, Ticket
from kvlife.engine.base import Ack, CopyFault
from kvlife.errors import (
    ConfigError,
    DrainTimeout,
    ForeignLifecycle,
    HashingError,
    InvalidStep,
    KVLifeError,
    LifecycleError,
    ManagerError,
    ReleaseCallbackError,
)
from kvlife.hashing import PageHasher, namespace_prior, sglang_page_hashes
from kvlife.store.base import StoreError

if TYPE_CHECKING:
    import torch

    from kvlife.engine.base import CopyEngine
    from kvlife.pool import HostPagePool
    from kvlife.store.base import Store, StoreResult

_IDLE, _OFFLOADING = State.IDLE, State.OFFLOADING

__all__ = ["Agreement", "ManagedLifecycle", "ManagerMetrics", "OffloadManager", "ReleaseHandler"]

#: The runtime's release callback: ``(lifecycle, device_pages)``, called exactly once.
ReleaseHandler = Callable[["ManagedLifecycle", Sequence[int]], object]


class Agreement(Protocol):
    """How the ranks of one tensor-parallel group agree on which acks to apply.

    Without one (the single-process default) every completed ack is applied
    at once. With one, the manager tells it of every submission, in order,
    and applies only the acks it returns: those every rank has completed, in
    submission order.
    """

    def submitted(self, ticket: Ticket) -> None:
        """Record one submission (every rank must submit the same sequence)."""

    def agree(self, acks: list[Ack]) -> list[Ack]:
        """Take this rank's newly completed acks; return those every rank completed."""

    def admit(self, n_pages: int) -> bool:
        """Whether to take ``n_pages`` host pages for a chunk now: the same answer on every rank."""

    @property
    def pending(self) -> int:
        """Submissions not yet returned by :meth:`agree`."""


class ManagedLifecycle(Lifecycle):
    """A Lifecycle started by an :class:`OffloadManager`, with the request data the manager needs.

    The runtime keeps it on its own request object; the manager never needs the rid.
    """

    __slots__ = ("_manager", "device_pages", "next_page", "prefill_len", "release_handler")

    _manager: OffloadManager

    # Its events go through the manager, which keeps the counters and the pages;
    # a direct call would bypass both, so it is refused before anything changes.
    def submit(self, tokens: Sequence[int]) -> Ticket:
        """Refused: use :meth:`OffloadManager.offload`."""
        raise ManagerError(f"{self!r}: submit through its manager (offload)")

    def ack(self, ticket: Ticket | LoadTicket) -> None:
        """Refused: the manager applies acks in :meth:`OffloadManager.poll`."""
        raise ManagerError(f"{self!r}: acks reach it through its manager (poll)")

    def finish(self, reason: FinishReason = FinishReason.FINISHED) -> None:
        """Refused: use :meth:`OffloadManager.finish`."""
        raise ManagerError(f"{self!r}: finish through its manager (finish)")

    #: The request's device page table as last given (page i holds tokens [i*P, (i+1)*P)).
    #: Kept by reference, not copied (a copy per step would cost the hot path): the
    #: release callback receives this same object, so mutate it only through steps.
    device_pages: Sequence[int]
    #: Tokens the prefill side already stored (prompt rounded down to whole pages).
    prefill_len: int
    #: The first page not prefilled and not yet offloaded: where the next chunk starts.
    next_page: int
    release_handler: ReleaseHandler | None


@dataclass
class ManagerMetrics:
    """A snapshot of the manager's counters (see :meth:`OffloadManager.metrics`)."""

    lifecycles_started: int = 0
    lifecycles_by_state: dict[str, int] = field(default_factory=dict)
    chunks_submitted: int = 0
    chunks_in_flight: int = 0
    chunks_acked: int = 0
    pages_offloaded: int = 0
    bytes_offloaded: int = 0
    pages_stored: int = 0
    store_writes_pending: int = 0
    host_pages_used: int = 0
    host_pool_exhausted: int = 0
    copy_failures: int = 0
    store_failures: int = 0
    release_callback_errors: int = 0
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


def _tokens_of(tokens: Sequence[int], start: int, stop: int) -> Sequence[int]:
    """``tokens[start:stop]`` for any ordered sequence (a deque cannot be sliced)."""
    if type(tokens) is list or type(tokens) is tuple:
        return tokens[start:stop]
    if isinstance(tokens, (Set, Mapping)):
        raise TypeError(f"tokens must be an ordered sequence, got {type(tokens).__name__}")
    try:
        return tokens[start:stop]
    except TypeError:
        if not isinstance(tokens, Sequence):
            raise
        return tuple(islice(tokens, start, stop))


class OffloadManager:
    """Decode-side KV offload: stride policy, acks, backup to a store, release exactly once.

    Call it from one thread, the scheduler's: the first call binds it, and a
    call from another thread while that one runs is refused with
    :class:`~kvlife.errors.ManagerError` (reading :meth:`metrics` is allowed
    from any thread). ``stride`` is in tokens, rounded down to whole pages (at least one
    page); ``None`` means one page. Managers may share an engine, a store or a
    host pool: an ack or a store result one manager's poll takes for another's
    Lifecycle is handed to that manager, applied at its next poll or close.
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
    ) -> None:
        page_size = _count("page_size", page_size, 1)
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
        self._refused: Counter[str] = Counter()
        self._acks: deque[Ack] = deque()  # taken from the engine, not yet applied
        self._results: deque[StoreResult] = deque()  # taken from the store, not yet applied
        self._live: set[ManagedLifecycle] = set()  # started, not yet released
        self._started = 0
        self._released = 0
        self._chunks_submitted = 0
        self._chunks_acked = 0
        self._pages_offloaded = 0
        self._pages_stored = 0
        self._exhausted = 0
        self._copy_failures = 0
        self._store_failures = 0
        self._callback_errors = 0
        self._latency_count = 0
        self._latency_sum = 0.0
        self._latency_max = 0.0
        #: Errors raised by release callbacks, newest last (bounded), for the runtime to log.
        self.callback_errors: list[ReleaseCallbackError] = []

    # ------------------------------------------------------------ lifecycles

    def start(
        self,
        rid: object,
        prompt: Sequence[int],
        on_release: ReleaseHandler | None = None,
        *,
        prior_hash: str | None = None,
    ) -> ManagedLifecycle:
        """Begin one request life; the chain continues from the prompt's whole pages.

        ``prior_hash`` is the key of the prompt's last whole page if the
        runtime has it from the prefill side; otherwise it is computed here.
        """
        if get_ident() != self._thread:
            self._check_thread()
        try:
            prefill_len = len(prompt) // self.page_size * self.page_size
            if prior_hash is None:
                prior_hash = self._seed
                if prefill_len:
                    prefix = _tokens_of(prompt, 0, prefill_len)
                    prior_hash = self.hasher(prefix, self.page_size, prior_hash)[-1]
            else:  # the scheme checks a prior it is given even with no page to hash
                self.hasher((), self.page_size, prior_hash)
        except (HashingError, TypeError) as exc:
            self._refused[InvalidStep.__name__] += 1
            raise InvalidStep(f"cannot start rid={rid!r}: {exc}") from None
        lc = ManagedLifecycle(
            rid,
            page_size=self.page_size,
            on_release=self._on_release,
            prior_hash=prior_hash,
            hasher=self.hasher,
        )
        lc._manager = self
        lc.device_pages = ()
        lc.prefill_len = prefill_len
        lc.next_page = prefill_len // self.page_size
        lc.release_handler = on_release
        self._live.add(lc)
        self._started += 1
        return lc

    def offload(
        self, lc: ManagedLifecycle, tokens: Sequence[int], device_pages: Sequence[int]
    ) -> Ticket | None:
        """After a decode step: submit the chunk that is due, if any; return its ticket.

        ``tokens`` are the request's tokens so far (prompt and outputs; the
        newest has no KV yet); ``device_pages`` its device page table. Returns
        ``None`` when nothing is due, or when the host pool is full (nothing
        changed; the same chunk is due again next step). A refusal raises
        before anything changes, the page table kept included.
        """
        # The hot path: most steps submit nothing, so this prefix must cost about
        # what a dict lookup does. It reads the Lifecycle's slots directly. It
        # changes only the page table (one atomic store), so the thread is checked
        # only once a chunk is due.
        if lc.__class__ is not ManagedLifecycle or lc._manager is not self:
            self._check_owned(lc)
        state = lc._state
        if state is not _IDLE and state is not _OFFLOADING:
            raise self._invalid_step(lc, "decoding has ended; no more steps")
        first = lc.next_page  # pages prefilled or already offloaded
        start = first * self.page_size
        try:  # free in CPython 3.11+ unless it raises
            ready = len(tokens) - 1 - start  # tokens with KV not yet offloaded
            if ready < self.stride:
                if ready < -1:
                    raise self._invalid_step(
                        lc, f"{len(tokens)} tokens, but {start} are already offloaded or prefilled"
                    )
                if len(device_pages) < first:
                    raise self._invalid_step(
                        lc,
                        f"{len(device_pages)} device pages cannot hold the {start} tokens "
                        "before them",
                    )
                lc.device_pages = device_pages
                return None
            n_device = len(device_pages)
        except TypeError:
            raise self._invalid_step(lc, "tokens and device_pages must be sequences") from None
        if get_ident() != self._thread:
            self._check_thread()
        n = ready // self.stride * self.stride
        end = (start + n) // self.page_size
        if n_device < end:
            raise self._invalid_step(lc, f"{n_device} device pages cannot hold {start + n} tokens")
        try:
            chunk_tokens = _tokens_of(tokens, start, start + n)
            chunk_pages = _tokens_of(device_pages, first, end)
        except TypeError as exc:
            raise self._invalid_step(lc, str(exc)) from None
        if self.agreement is not None and not self.agreement.admit(end - first):
            self._exhausted += 1  # host pool full on some rank: no rank submits
            return None
        return self._submit(lc, chunk_tokens, chunk_pages, device_pages)

    def _submit(
        self,
        lc: ManagedLifecycle,
        tokens: Sequence[int],
        chunk_pages: Sequence[int],
        device_pages: Sequence[int],
    ) -> Ticket | None:
        """Allocate host pages, then commit: until the Lifecycle holds the chunk,
        any exception (a refusal, a bug in a hasher or engine, Ctrl-C) gives them back."""
        host_pages = self.host.alloc(len(chunk_pages), owner=lc)
        if host_pages is None:
            self._exhausted += 1
            return None
        try:
            self.engine.check(chunk_pages, host_pages)
            ticket = Lifecycle.submit(lc, tokens)
        except BaseException as exc:
            self.host.free(host_pages, owner=lc)
            if isinstance(exc, KVLifeError):
                self._refused[type(exc).__name__] += 1
            raise
        lc.device_pages = device_pages
        lc.next_page += len(chunk_pages)
        self._chunks_submitted += 1
        try:
            self.engine.submit(ticket, chunk_pages, host_pages)
        except BaseException as exc:
            # check() passed, so this is the engine failing, not a refusal: the
            # Lifecycle already holds the chunk, so settle it as a failed copy.
            fault = CopyFault(f"the engine failed to take chunk {ticket.seq}: {exc!r}")
            self._apply_ack(Ack(ticket, tuple(chunk_pages), tuple(host_pages), fault))
            raise
        if self.agreement is not None:
            self.agreement.submitted(ticket)
        return ticket

    def finish(
        self,
        lc: ManagedLifecycle,
        reason: FinishReason = FinishReason.FINISHED,
        device_pages: Sequence[int] | None = None,
    ) -> None:
        """End decoding; release runs now if nothing is in flight, else at the last ack.

        ``device_pages`` is the request's final page table, if it changed since
        the last :meth:`offload` (or there was none): the release callback gets it.
        """
        if get_ident() != self._thread:
            self._check_thread()
        self._check_owned(lc)
        kept = lc.device_pages
        if device_pages is not None:
            lc.device_pages = device_pages
        try:
            Lifecycle.finish(lc, reason)
        except ReleaseCallbackError as exc:
            self._record_callback_error(exc)
        except LifecycleError as exc:
            lc.device_pages = kept
            self._refused[type(exc).__name__] += 1
            raise

    # ------------------------------------------------------------ progress

    def poll(self) -> None:
        """Apply completed copies and completed store writes. Never blocks (but an
        :class:`Agreement` across ranks runs its collective here, every call).

        Acks and store results taken from the engine and the store wait in the
        manager until applied, so an exception from one (a release callback is
        reported, not raised; a store or pool error is) leaves the others for
        the next call, none lost.
        """
        if get_ident() != self._thread:
            self._check_thread()
        acks = self.engine.poll()
        if self.agreement is not None:
            acks = self.agreement.agree(acks)
        self._apply_acks(acks)
        self._apply_store_results(self.store.poll())

    def close(self, timeout: float | None = None) -> None:
        """Drain every copy and every store write; afterwards nothing is in flight or allocated.

        A release callback that starts and offloads another request while this
        runs is drained too. ``timeout`` bounds the whole call; past it
        :class:`~kvlife.errors.DrainTimeout` is raised with nothing lost: what
        was not applied yet is applied by a later :meth:`poll` or :meth:`close`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if get_ident() != self._thread:
            self._check_thread()
        while True:
            try:
                self._drain_copies(deadline, timeout)
            finally:
                self._apply_store_results(self.store.drain(_left(deadline)))
            if not self._busy():
                return
            if deadline is not None and time.monotonic() > deadline:
                raise DrainTimeout(f"work still in flight after {timeout} s")

    def _busy(self) -> bool:
        agreed = self.agreement is None or not self.agreement.pending
        return bool(self.engine.inflight or self._acks or self.store.pending or not agreed)

    def _drain_copies(self, deadline: float | None, timeout: float | None) -> None:
        acks = self.engine.drain(_left(deadline))
        if self.agreement is None:
            self._apply_acks(acks)
            return
        self._apply_acks(self.agreement.agree(acks))
        while self.agreement.pending:
            if deadline is not None and time.monotonic() > deadline:
                raise DrainTimeout(
                    f"{self.agreement.pending} chunks not yet complete on every rank "
                    f"after {timeout} s"
                )
            self._apply_acks(self.agreement.agree([]))

    def _apply_acks(self, acks: list[Ack]) -> None:
        pending = self._acks
        pending.extend(acks)
        while pending:
            self._apply_ack(pending.popleft())

    def _apply_ack(self, ack: Ack) -> None:
        ticket = ack.ticket
        lc = ticket.lifecycle
        if lc.__class__ is not ManagedLifecycle:  # forged: no manager's to touch
            self._refused[ForeignLifecycle.__name__] += 1
            return
        if lc._manager is not self:  # an engine shared with another manager: hand it over
            lc._manager._acks.append(ack)
            return
        inflight = lc._inflight
        try:
            Lifecycle.ack(lc, ticket)
        except ReleaseCallbackError as exc:
            self._record_callback_error(exc)
        except LifecycleError as exc:  # a duplicate ack from the engine: its pages are not ours
            self._refused[type(exc).__name__] += 1
            return
        except BaseException:
            # The release callback raised KeyboardInterrupt or SystemExit: the ack
            # is applied, so its pages are settled before the exception goes on.
            if lc._inflight != inflight:
                self._settle(lc, ack)
            raise
        self._settle(lc, ack)

    def _settle(self, lc: ManagedLifecycle, ack: Ack) -> None:
        """An applied ack's pages: freed if the copy failed, else handed to the store."""
        self._chunks_acked += 1
        latency = ack.completed_at - ack.submitted_at
        self._latency_count += 1
        self._latency_sum += latency
        self._latency_max = max(self._latency_max, latency)
        if not ack.ok:
            self._copy_failures += 1
            self.host.free(ack.host_pages, owner=lc)
            return
        self._pages_offloaded += len(ack.host_pages)  # on the host now, whatever the store does
        try:
            rows = self._host_rows(ack.host_pages)
            self.store.put((lc, ack.host_pages), ack.ticket.keys, rows)
        except BaseException as exc:  # refused or broken at once: never stored
            self._store_failures += 1
            self.host.free(ack.host_pages, owner=lc)
            if not isinstance(exc, StoreError):
                raise
            self._refused[type(exc).__name__] += 1

    def _apply_store_results(self, results: list[StoreResult]) -> None:
        pending = self._results
        pending.extend(results)
        while pending:
            result = pending.popleft()
            owner: ManagedLifecycle
            host_pages: tuple[int, ...]
            owner, host_pages = result.token  # type: ignore[misc]
            if owner._manager is not self:  # a store shared with another manager
                owner._manager._results.append(result)
                continue
            self.host.free(host_pages, owner=owner)
            if result.ok:
                self._pages_stored += len(result.keys)
            else:
                self._store_failures += 1

    def _host_rows(self, pages: Sequence[int]) -> torch.Tensor:
        """The host pages as one [n, page_numel] tensor: a view when they are consecutive."""
        first = pages[0]
        if len(pages) == 1 or all(p == first + i for i, p in enumerate(pages)):
            return self.host.tensor[first : first + len(pages)]
        return self.host.tensor[list(pages)]

    def _on_release(self, lc: Lifecycle) -> None:
        assert isinstance(lc, ManagedLifecycle)
        self._live.discard(lc)
        self._released += 1
        handler = lc.release_handler
        if handler is not None:
            handler(lc, lc.device_pages)

    def _check_thread(self) -> None:
        """Bind the manager to the calling thread, or refuse a second thread.

        The first call binds it; a call from another thread while the bound one
        is alive raises :class:`~kvlife.errors.ManagerError` before anything
        changes (two threads would corrupt the counters and the Lifecycles).
        Once the bound thread has ended, the next caller takes over.
        """
        bound = self._thread_obj
        if bound is not None and bound.is_alive():
            self._refused[ManagerError.__name__] += 1
            raise ManagerError(
                f"called from thread {threading.current_thread().name!r}, but this manager is "
                f"driven by {bound.name!r}: call it from one thread (its scheduler's)"
            )
        self._thread_obj = threading.current_thread()
        self._thread = get_ident()

    def _invalid_step(self, lc: ManagedLifecycle, why: str) -> InvalidStep:
        self._refused[InvalidStep.__name__] += 1
        return InvalidStep(f"Lifecycle rid={lc.rid!r} id=0x{id(lc):x}: {why}")

    def _record_callback_error(self, exc: ReleaseCallbackError) -> None:
        self._callback_errors += 1
        self.callback_errors.append(exc)
        del self.callback_errors[:-100]

    def _check_owned(self, lc: Lifecycle) -> None:
        if not isinstance(lc, ManagedLifecycle) or lc._manager is not self:
            self._refused[ForeignLifecycle.__name__] += 1
            raise ForeignLifecycle(f"{lc!r} was not started by this manager")

    # ------------------------------------------------------------ metrics

    def metrics(self) -> ManagerMetrics:
        """Counters now: Lifecycles per state, chunks, pages, bytes, failures, refusals, latency."""
        by_state = Counter(lc._state.name for lc in tuple(self._live))  # any thread may read
        return ManagerMetrics(
            lifecycles_started=self._started,
            lifecycles_by_state={
                State.IDLE.name: by_state[State.IDLE.name],
                State.OFFLOADING.name: by_state[State.OFFLOADING.name],
                State.FINISHED.name: by_state[State.FINISHED.name],
                State.RELEASED.name: self._released,
            },
            chunks_submitted=self._chunks_submitted,
            chunks_in_flight=self._chunks_submitted - self._chunks_acked,
            chunks_acked=self._chunks_acked,
            pages_offloaded=self._pages_offloaded,
            bytes_offloaded=self._pages_offloaded * self._page_bytes,
            pages_stored=self._pages_stored,
            store_writes_pending=self.store.pending,
            host_pages_used=self.host.num_used,
            host_pool_exhausted=self._exhausted,
            copy_failures=self._copy_failures,
            store_failures=self._store_failures,
            release_callback_errors=self._callback_errors,
            refused_events=dict(self._refused),
            ack_latency_count=self._latency_count,
            ack_latency_sum_s=self._latency_sum,
            ack_latency_max_s=self._latency_max,
        )


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (never negative), or ``None`` for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
