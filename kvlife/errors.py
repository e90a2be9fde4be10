"""Typed refusals. Every error kvlife raises is a :class:`KVLifeError`.

A refused event changes nothing: the object that raised is exactly as it was
before the call. Lifecycle errors carry the Lifecycle's rid, identity and state
so a log line is enough to find the request and the event.
"""

from __future__ import annotations

from typing import Any


class KVLifeError(Exception):
    """Base of every error kvlife raises."""


class LifecycleError(KVLifeError):
    """An event refused by one Lifecycle; the Lifecycle is unchanged."""

    def __init__(self, message: str, *, event: str, state: Any, rid: object, ident: int) -> None:
        super().__init__(message)
        self.event = event
        self.state = state
        self.rid = rid
        self.ident = ident


class InvalidTransition(LifecycleError):
    """The transition table has no row for this event in this state."""


class AckError(LifecycleError):
    """An ack that cannot be applied to this Lifecycle."""


class DuplicateAck(AckError):
    """The chunk was already acked: each chunk is acked exactly once."""


class UnknownChunk(AckError):
    """The ticket names a chunk this Lifecycle never submitted."""


class ForeignAck(AckError):
    """The ticket belongs to another Lifecycle (perhaps one with the same rid)."""


class InvalidEvent(LifecycleError, ValueError):
    """An event whose arguments are malformed; refused before anything changes."""


class InvalidChunk(InvalidEvent):
    """A submitted chunk is malformed (empty, not whole pages, bad token ids)."""


class ReleaseCallbackError(KVLifeError):
    """The runtime's release callback raised. The Lifecycle *is* released
    (exactly once); the original exception is the ``__cause__``."""

    def __init__(self, message: str, *, rid: object, ident: int) -> None:
        super().__init__(message)
        self.rid = rid
        self.ident = ident


class ManagerError(KVLifeError, ValueError):
    """A call the offload manager refused; nothing changed. The message says why: a
    request this manager did not start, a step whose tokens or device pages do not fit
    the request (too few pages, tokens went back, a step after finish), a prompt it
    cannot hash, a second thread, or (vLLM backend, with ``strict``) a call naming no
    known job. Catch it to drop the one call; the request and the manager go on."""


class PoolError(KVLifeError, ValueError):
    """A host pool call refused; the pool is unchanged. The message says why: a page out
    of range or not an int, a page already free (or named twice in one ``free``), a page
    another owner holds, an allocation of ``n`` not a positive int or for owner ``None``.
    It is a bug in the caller's page bookkeeping, never a full pool (``alloc`` returns
    ``None`` then): catch it to log the bug, not to retry."""


class EngineError(KVLifeError, ValueError):
    """A copy engine refused a call; nothing was submitted and nothing changed. Raised as
    is for a chunk that is malformed (not a ticket, lengths that disagree with the ticket
    or each other, a page out of range, not an int or named twice) or, in the testing
    kit's scripted engine, a copy completed that is not in flight: a bug in the caller,
    the message says which. :class:`PageBusy`, :class:`UnallocatedHostPage` and
    :class:`EngineClosed` are the refusals a caller handles apart; :class:`CopyFault`
    is a failed copy."""


class PageBusy(EngineError):
    """A page of the chunk is still in use by a copy in flight: a host page a store is
    writing (or, for a store, one a load reads), a device page a load is writing (or,
    for a load, one a store reads). Wait for the copies in flight (``drain``), then
    submit again."""


class UnallocatedHostPage(EngineError):
    """A host page of the chunk is free in the pool: a chunk must copy into pages it was
    given. A runtime that freed the pages (a reset) skips the stale chunk."""


class EngineClosed(EngineError, RuntimeError):
    """The engine was closed; it takes no more chunks. Stop submitting to it."""


class CopyFault(EngineError):
    """A copy that failed: the error an :class:`~kvlife.engine.base.Ack` carries (the
    default error of fault injection). Never raised by ``submit``."""


class AgreementError(KVLifeError):
    """A submission or ack the agreement of a tensor-parallel group cannot take (not a
    ticket or an ack, a chunk submitted twice): a caller bug; nothing changed and the
    agreement stays usable. Also the error of an ack whose copy succeeded here but failed
    on another rank. Its subclass :class:`GroupBroken` is the one to stop on."""

    def __init__(
        self,
        message: str,
        *,
        index: int | None = None,
        chunks: list[str | None] | None = None,
    ) -> None:
        super().__init__(message)
        self.index = index
        self.chunks = chunks


class GroupBroken(AgreementError, RuntimeError):
    """The group's agreement is broken for good; every later call raises it again: stop
    the group's offload. The message says why: a peer rank crashed or its connection
    broke; it did not join the collective within the timeout ("no peer answer in time");
    or the ranks submitted different chunk sequences (a runtime bug, raised on every rank
    alike: ``index`` is the first submission index at which they differ and ``chunks[r]``
    rank r's chunk there, ``None`` if it had none; both ``None`` for the other causes).
    Nothing from the failing poll was applied."""


class TierError(KVLifeError, ValueError):
    """The host tier refused an event: a completion of a key with nothing in flight, a
    load of a key that is not ready, a key of the wrong type. Nothing changed; inside a
    host runtime it is counted (:class:`~kvlife.refusals.Refusals`), raised only when
    strict. ``key`` names the key refused (``None`` for a refusal of the whole call)."""

    def __init__(self, message: str, *, key: object = None) -> None:
        super().__init__(message)
        self.key = key


class StoreError(KVLifeError):
    """Base of every error the storage tier raises or reports. Raised as is, or reported as a
    put's ``StoreResult.error``, for a put or read that failed: a fault a test injected
    (``kvlife.testing.faults``; the message says "injected"), or a Mooncake call that
    answered an error code (``code`` and ``call`` say which; both ``None`` for other
    failures). A failed put leaves the stored pages as they were (all-or-nothing; a
    directory store's I/O error is reported as the ``OSError`` it is). Catch it to drop the
    one put (the manager counts a store failure and goes on without those pages).
    :class:`InvalidPut`, :class:`StoreClosed`, :class:`PageMismatch` and
    :class:`StoreUnavailable` are the ones a caller handles apart."""

    def __init__(self, message: str, *, code: int | None = None, call: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.call = call


class InvalidPut(StoreError, ValueError):
    """A malformed put or key, refused before anything changes (nothing queued, no
    counter moved): keys and pages of different lengths, no pages, a key twice, pages that
    are not a 2-D dense host tensor, or a key that is not 2 to 128 lowercase hex digits
    (the message says so; ``get`` and ``contains`` refuse such a key too). A bug in the
    caller (or a custom hasher's keys): fix it, do not retry."""


class StoreClosed(StoreError):
    """A put on a closed store. Stop putting to it (as after :class:`EngineClosed`)."""


class PageMismatch(StoreError):
    """A key already stored with different bytes: a content-hash corruption signal,
    counted apart (``stats().page_mismatches``). The stored page is kept; the put that
    carried the other bytes fails whole. ``key`` is the key."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


class StoreUnavailable(StoreError):
    """The store's backing service cannot be reached (Mooncake's master or memory pool),
    or its circuit breaker is open after such a failure and the put failed without
    calling it. ``code`` and ``call`` name the failing call. Transient: the store calls
    the service again after ``retry_after`` seconds, so a caller may put again later and
    treat a failed read as a miss."""


class ConfigError(KVLifeError, ValueError):
    """An argument that does not fit what it configures, refused before anything was
    built or copied: a constructor argument no run can use (a page size of ``True``, a NaN
    stride, a store namespace that could escape the store's root or makes page paths too
    long for the file system, a device layout and host pool that disagree on dtype or page
    width, KV buffers of two shapes, a device this machine cannot allocate on, pinned host
    pages without CUDA, a fault injection count or delay out of bounds), a layout
    call with pages, rows or a dtype the layout does not hold, or a diagram in a format it
    does not come in. A bug in how the runtime wires kvlife: fix the call, do not retry it."""


class MissingDependency(KVLifeError, ImportError):
    """An optional part is not installed (``prometheus_client``, Graphviz's ``dot`` or its
    png renderer, Mooncake's client); the message says what to install."""


class DrainTimeout(KVLifeError, TimeoutError):
    """A drain ran out of time (copies or store writes); nothing was lost, poll again."""


class HashingError(KVLifeError, ValueError):
    """Tokens that cannot be hashed as pages (not whole pages, bad ids)."""


__all__ = [
    "AckError",
    "AgreementError",
    "ConfigError",
    "CopyFault",
    "DrainTimeout",
    "DuplicateAck",
    "EngineClosed",
    "EngineError",
    "ForeignAck",
    "GroupBroken",
    "HashingError",
    "InvalidChunk",
    "InvalidEvent",
    "InvalidPut",
    "InvalidTransition",
    "KVLifeError",
    "LifecycleError",
    "ManagerError",
    "MissingDependency",
    "PageBusy",
    "PageMismatch",
    "PoolError",
    "ReleaseCallbackError",
    "StoreClosed",
    "StoreError",
    "StoreUnavailable",
    "TierError",
    "UnallocatedHostPage",
    "UnknownChunk",
]
