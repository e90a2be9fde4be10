"""Typed refusals. Every error kvlife raises is a :class:`KVLifeError`.

A refusal changes nothing: the object that raised is exactly as it was before the call,
and the message says why (every case: ``docs/failures.md``). Lifecycle errors carry the
Lifecycle's rid, identity and state, so a log line finds the request and the event.
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
    """A call the offload manager refused: a request it did not start, a step that does not
    fit the request, a prompt it cannot hash, a second thread. Catch it to drop the one
    call; the request and the manager go on."""


class PoolError(KVLifeError, ValueError):
    """A host pool call refused: a page out of range, already free or another owner's, a
    bad allocation. A bug in the caller's page bookkeeping, never a full pool (``alloc``
    returns ``None`` then): catch it to log the bug, not to retry."""


class EngineError(KVLifeError, ValueError):
    """A copy engine refused a chunk; nothing was submitted. Raised as is for a malformed
    chunk (a bug in the caller). :class:`PageBusy`, :class:`UnallocatedHostPage` and
    :class:`EngineClosed` are the refusals a caller handles apart; :class:`CopyFault` is
    a failed copy."""


class PageBusy(EngineError):
    """A page of the chunk is in use by a copy in flight (one writes it, or this chunk
    would write a page another reads). Wait for the copies in flight, then submit again."""


class UnallocatedHostPage(EngineError):
    """A host page of the chunk is free in the pool: a chunk must copy into pages it was
    given. A runtime that freed the pages (a reset) skips the stale chunk."""


class EngineClosed(EngineError, RuntimeError):
    """The engine was closed; it takes no more chunks. Stop submitting to it."""


class CopyFault(EngineError):
    """A copy that failed: the error an :class:`~kvlife.engine.base.Ack` carries (the
    default error of fault injection). Never raised by ``submit``."""


class AgreementError(KVLifeError):
    """A submission or ack a tensor-parallel group's agreement cannot take (a caller bug;
    the agreement stays usable), or the error of an ack whose copy failed on another
    rank. Its subclass :class:`GroupBroken` is the one to stop on."""

    def __init__(
        self, message: str, *, index: int | None = None, chunks: list[str | None] | None = None
    ) -> None:
        super().__init__(message)
        self.index = index
        self.chunks = chunks


class GroupBroken(AgreementError, RuntimeError):
    """The group's agreement is broken for good (a peer crashed or did not answer in time,
    or the ranks submitted different chunks); every later call raises it again: stop the
    group's offload. Nothing of the failing poll was applied. For different chunks,
    ``index`` is the first submission where they differ and ``chunks[r]`` rank r's chunk
    there (``None``: none); both are ``None`` for the other causes."""


class TierError(KVLifeError, ValueError):
    """The host tier refused an event (a completion of a key with nothing in flight, a load
    of a key not ready); counted by :class:`~kvlife.refusals.Refusals`, raised only when
    strict. ``key`` is the key refused (``None`` for a refusal of the whole call)."""

    def __init__(self, message: str, *, key: object = None) -> None:
        super().__init__(message)
        self.key = key


class StoreError(KVLifeError):
    """Base of the storage tier's errors. As is, a failed put or read (a put's
    ``StoreResult.error``): an injected fault (the message says "injected"), or a Mooncake
    call that answered an error (``code`` and ``call`` say which; else ``None``). A failed
    put leaves the stored pages as they were; drop that put. :class:`InvalidPut`,
    :class:`StoreClosed`, :class:`PageMismatch` and :class:`StoreUnavailable` are the
    ones a caller handles apart."""

    def __init__(self, message: str, *, code: int | None = None, call: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.call = call


class InvalidPut(StoreError, ValueError):
    """A malformed put (``docs/store.md``, "What put refuses") or a key that is not 2 to
    128 lowercase hex digits (``get`` refuses it too): nothing queued, no counter moved.
    A bug in the caller (or a custom hasher's keys): fix it, do not retry."""


class StoreClosed(StoreError):
    """A put on a closed store. Stop putting to it (as after :class:`EngineClosed`)."""


class PageMismatch(StoreError):
    """``key`` is already stored with other bytes (counted in ``stats().page_mismatches``):
    the stored page is kept, and the put that carried the other bytes fails whole."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


class StoreUnavailable(StoreError):
    """The store's service (Mooncake's master or pool) cannot be reached, or the breaker
    opened by such a failure failed the put at once. Transient: the store calls it again
    after ``retry_after`` seconds; put again later, and treat a failed read as a miss."""


class ConfigError(KVLifeError, ValueError):
    """An argument that does not fit what it configures (a page size of ``True``, a
    namespace that could escape a store's root, a layout and pool that disagree, a device
    this machine lacks), refused before anything was built or copied. A bug in how the
    runtime wires kvlife: fix the call, do not retry it."""


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
