"""One request life's KV-offload lifecycle: the states, the table, the Lifecycle.

A :class:`Lifecycle` is one request *life*: it counts the chunks (stores) and loads
in flight, records the hash-chain key of every page it submitted, and decides when
the runtime may take its device pages back (*release*, the one automatic event:
exactly once, as soon as a finished Lifecycle has nothing in flight). The design
and the table are explained in docs/design.md ("Why the lifecycle is a table") and
docs/lifecycle.md; two rules govern this file:

1. Everything that affects the lifecycle's state lives here. :data:`TABLE` is the
   only definition of which event may happen in which state and where it leads
   (per class of stores and loads in flight: 0, 1, "2 or more"); the fast path,
   the diagrams and the docs table are made from it, and the tests hold the
   hand-coded parts (argument and ack checks, bookkeeping, the hash chain) to it
   with a ``transitions`` twin (``tests/reference_lifecycle.py``).
2. It does not know what carries the copies or what the runtime does with a
   released request. It imports no torch.

Identity, not rid: an ack carries its ticket, the ticket its Lifecycle, compared
by identity; nothing here is looked up by rid. Chunks from the oldest one in
flight onwards are kept in seq order; an ack out of order only marks its entry,
so ``last_hash`` moves in page order. A refused event raises a
:class:`~kvlife.errors.LifecycleError` and leaves the Lifecycle as it was: all
checks run before the first assignment.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, TypeGuard

from kvlife.errors import (
    ConfigError,
    DuplicateAck,
    ForeignAck,
    HashingError,
    InvalidChunk,
    InvalidEvent,
    InvalidTransition,
    LifecycleError,
    ReleaseCallbackError,
    UnknownChunk,
)
from kvlife.hashing import PageHasher, sglang_page_hashes

__all__ = [
    "AUTOMATIC",
    "DECODING",
    "GUARDS",
    "TABLE",
    "Event",
    "FinishReason",
    "Lifecycle",
    "LifecycleSnapshot",
    "LoadTicket",
    "State",
    "Ticket",
    "Transition",
    "compile_table",
    "is_ticket",
]


class State(Enum):
    """Where one request life stands in its offload."""

    #: Decoding; no chunk in flight.
    IDLE = "idle"
    #: Decoding; one or more chunks in flight, a store among them (loads may be too).
    OFFLOADING = "offloading"
    #: Decoding, or waiting for its prefix; one or more loads in flight and no store.
    LOADING = "loading"
    #: No more decoding (finished, aborted or retracted); chunks still draining.
    FINISHED = "finished"
    #: Terminal: nothing in flight, device pages handed back exactly once.
    RELEASED = "released"

    # Members are singletons compared by identity; hashing by identity too keeps
    # the compiled table's lookup in C (Enum's own __hash__ is Python code).
    __hash__ = object.__hash__


class Event(Enum):
    """What can happen to a Lifecycle."""

    #: Submit one chunk of whole pages for copying to the host (a store).
    SUBMIT = "submit"
    #: Start one load: whole pages copied from the host back into device pages.
    LOAD = "load"
    #: One chunk's copy (a store) completed, successfully or not.
    ACK = "ack"
    #: One load's copy completed, successfully or not.
    LOAD_ACK = "load_ack"
    #: Decoding ended, with a :class:`FinishReason`.
    FINISH = "finish"
    #: Hand the device pages back; automatic once a finished Lifecycle drained.
    RELEASE = "release"

    __hash__ = object.__hash__  # identity, as for State


class FinishReason(Enum):
    """Why decoding ended. All three drain before release."""

    #: The request completed normally.
    FINISHED = "finished"
    #: The client or the runtime aborted the request.
    ABORTED = "aborted"
    #: Preempted: the runtime takes the pages back; a resumed request gets a new Lifecycle.
    RETRACTED = "retracted"


#: Guards, by name: predicates of what is in flight before the event, as classes of
#: (stores, loads), each 0, 1 or 2 meaning "2 or more".
GUARDS: dict[str, Callable[[int, int], bool]] = {
    "more_stores": lambda stores, loads: stores >= 2,
    "last_store": lambda stores, loads: stores == 1 and loads == 0,
    "last_store_loads_left": lambda stores, loads: stores == 1 and loads >= 1,
    "stores_in_flight": lambda stores, loads: stores >= 1,
    "more_loads": lambda stores, loads: loads >= 2,
    "last_load": lambda stores, loads: loads == 1 and stores == 0,
    "loads_in_flight": lambda stores, loads: loads >= 1,
    "drained": lambda stores, loads: stores == 0 and loads == 0,
}

#: The in-flight classes guards are evaluated on: (stores, loads) pairs, in the order the
#: hot path indexes them (``stores + 3 * loads``).
INFLIGHT_CLASSES: tuple[tuple[int, int], ...] = tuple(
    (stores, loads) for loads in (0, 1, 2) for stores in (0, 1, 2)
)


@dataclass(frozen=True, slots=True)
class Transition:
    """One row of the table: in ``source``, ``event`` (when ``guard`` holds) leads to ``dest``."""

    source: State
    event: Event
    dest: State
    guard: str | None
    #: What the row does besides moving the state, in words (for the docs table).
    effect: str


_S, _E = State, Event

#: The lifecycle, written once. Every (state, event) pair not here is refused.
TABLE: tuple[Transition, ...] = (
    Transition(_S.IDLE, _E.SUBMIT, _S.OFFLOADING, None, "record chunk, stores += 1"),
    Transition(_S.OFFLOADING, _E.SUBMIT, _S.OFFLOADING, None, "record chunk, stores += 1"),
    Transition(_S.LOADING, _E.SUBMIT, _S.OFFLOADING, None, "record chunk, stores += 1"),
    Transition(_S.OFFLOADING, _E.ACK, _S.OFFLOADING, "more_stores", "settle chunk, stores -= 1"),
    Transition(
        _S.OFFLOADING, _E.ACK, _S.LOADING, "last_store_loads_left", "settle chunk, stores -= 1"
    ),
    Transition(_S.OFFLOADING, _E.ACK, _S.IDLE, "last_store", "settle chunk, stores -= 1"),
    Transition(_S.IDLE, _E.LOAD, _S.LOADING, None, "record load, loads += 1"),
    Transition(_S.LOADING, _E.LOAD, _S.LOADING, None, "record load, loads += 1"),
    Transition(_S.OFFLOADING, _E.LOAD, _S.OFFLOADING, None, "record load, loads += 1"),
    Transition(
        _S.OFFLOADING, _E.LOAD_ACK, _S.OFFLOADING, "loads_in_flight", "settle load, loads -= 1"
    ),
    Transition(_S.LOADING, _E.LOAD_ACK, _S.LOADING, "more_loads", "settle load, loads -= 1"),
    Transition(_S.LOADING, _E.LOAD_ACK, _S.IDLE, "last_load", "settle load, loads -= 1"),
    Transition(_S.IDLE, _E.FINISH, _S.FINISHED, None, "record reason"),
    Transition(_S.OFFLOADING, _E.FINISH, _S.FINISHED, None, "record reason"),
    Transition(_S.LOADING, _E.FINISH, _S.FINISHED, None, "record reason"),
    Transition(_S.FINISHED, _E.ACK, _S.FINISHED, "stores_in_flight", "settle chunk, stores -= 1"),
    Transition(_S.FINISHED, _E.LOAD_ACK, _S.FINISHED, "loads_in_flight", "settle load, loads -= 1"),
    Transition(_S.FINISHED, _E.RELEASE, _S.RELEASED, "drained", "call the release callback once"),
)

#: Events that fire themselves as soon as their guard holds.
AUTOMATIC: frozenset[Event] = frozenset({Event.RELEASE})


def compile_table(
    table: Sequence[Transition],
) -> dict[tuple[State, Event, tuple[int, int]], State]:
    """``(state, event, (stores, loads) class) -> next state``; refuses a non-deterministic
    table."""
    compiled: dict[tuple[State, Event, tuple[int, int]], State] = {}
    for row in table:
        if row.guard is not None and row.guard not in GUARDS:
            raise ValueError(f"row {row} names unknown guard {row.guard!r}")
        for inflight in INFLIGHT_CLASSES:
            if row.guard is not None and not GUARDS[row.guard](*inflight):
                continue
            key = (row.source, row.event, inflight)
            if key in compiled:
                raise ValueError(
                    f"table is not deterministic: two rows for {row.event.value} in "
                    f"{row.source.name} with (stores, loads) in flight {inflight}"
                )
            compiled[key] = row.dest
    return compiled


_NEXT = compile_table(TABLE)
_IDLE, _OFFLOADING, _LOADING, _FINISHED, _RELEASED = State
_SUBMIT, _LOAD, _ACK, _LOAD_ACK, _FINISH, _RELEASE = Event

#: A destination per in-flight class, indexed ``stores + 3 * loads``; ``None`` where the
#: table refuses.
_Row = tuple["State | None", ...]
_REFUSED: _Row = (None,) * len(INFLIGHT_CLASSES)


def _rows_of(
    compiled: dict[tuple[State, Event, tuple[int, int]], State], event: Event
) -> dict[State, _Row]:
    """The compiled table's entries for one event: state -> destination per in-flight class."""
    rows: dict[State, _Row] = {}
    for state in State:
        dests = tuple(compiled.get((state, event, c)) for c in INFLIGHT_CLASSES)
        if dests != _REFUSED:
            rows[state] = dests
    return rows


def _flat(rows: dict[State, _Row]) -> dict[State, State]:
    """``state -> destination`` of an event whose rows have no guard (one per state)."""
    flat: dict[State, State] = {}
    for state, dests in rows.items():
        first = dests[0]
        if first is None or any(d is not first for d in dests):
            raise ValueError(f"{state.name}: the event's destination depends on a guard")
        flat[state] = first
    return flat


# The hot path's view of _NEXT, split by event so one dict lookup keyed by the
# state (hashed by identity) gives the row; the in-flight class indexes it.
# Submit, load and finish have no guard: their view is one destination per state.
_ON_SUBMIT = _flat(_rows_of(_NEXT, _SUBMIT))
_ON_LOAD = _flat(_rows_of(_NEXT, _LOAD))
_ON_ACK = _rows_of(_NEXT, _ACK)
#: An ack of the one store in flight, no load in flight: the usual ack's own view.
_ON_LAST_ACK = {state: row[1] for state, row in _ON_ACK.items() if row[1] is not None}
_ON_LOAD_ACK = _rows_of(_NEXT, _LOAD_ACK)
_ON_FINISH = _flat(_rows_of(_NEXT, _FINISH))
_ON_RELEASE = _rows_of(_NEXT, _RELEASE)

#: Whether a life in each state is still decoding (the table lets it finish, and so submit
#: and load), read as ``DECODING[state]``; docs/lifecycle.md ("Still decoding") says why a dict.
DECODING: dict[State, bool] = {state: state in _ON_FINISH for state in State}


#: One submitted chunk, as a plain tuple ``(owner, seq, keys, first_page)``; unpack it.
#: ``owner`` is whoever the chunk's ack must reach, and only it: the :class:`Lifecycle`
#: that submitted the chunk (a request life), or a host's own record of one operation (a
#: vLLM transfer job, an SGLang linker operation), never a rid. ``seq`` is the chunk's
#: number inside its owner (0, 1, 2, ... in page order); ``keys`` holds the storage key of
#: each page, in page order (a Lifecycle's are hex digests; a host record's are its own
#: key type); ``first_page`` is the index of the chunk's first page among the pages that
#: owner submitted. The engine carries it to the ack and reads only its shape. Not a
#: NamedTuple: a plain tuple comes from CPython's free list, and a ticket is made on
#: every submit (docs/benchmarks.md prices the difference).
Ticket = tuple[Any, int, tuple[Any, ...], int]


def is_ticket(obj: object) -> TypeGuard[Ticket]:
    """Whether ``obj`` has a chunk :data:`Ticket`'s shape: a plain tuple of an owner (any
    object but ``None``), an int seq, a non-empty tuple of keys and an int first page.
    Engines refuse anything else before they change anything."""
    return (
        type(obj) is tuple
        and len(obj) == 4
        and obj[0] is not None
        and type(obj[1]) is int
        and type(obj[2]) is tuple
        and len(obj[2]) > 0
        and type(obj[3]) is int
    )


def _check_tokens(
    tokens: object, refuse: Callable[..., LifecycleError], event: Event = Event.SUBMIT
) -> None:
    """Refuse what is not an ordered, sized sequence (a generator, a set, a dict, None)."""
    if isinstance(tokens, (AbstractSet, Mapping)) or not hasattr(tokens, "__len__"):
        raise refuse(
            InvalidChunk, event, f"expected an ordered sequence, got {type(tokens).__name__}"
        )


class LoadTicket(NamedTuple):
    """One load (host pages copied back into device pages); acked like a chunk, to its own
    owner. A Lifecycle's loads have their own sequence numbers and never move ``last_hash``.
    Its first three fields line up with a chunk :data:`Ticket`'s; ``type(t) is LoadTicket``
    tells the two apart."""

    #: Whoever the load's ack must reach: the :class:`Lifecycle` that started it, or a host's
    #: own record of the operation (see :data:`Ticket`).
    owner: Any
    #: Sequence number among the owner's loads: 0, 1, 2, ...
    seq: int
    #: Storage key of each page loaded, in page order.
    keys: tuple[Any, ...]

    @property
    def n_pages(self) -> int:
        """Number of pages loaded."""
        return len(self.keys)


# LoadTicket(...) runs a generated Python __new__; load() builds the tuple directly.
_new_ticket = tuple.__new__


#: A Lifecycle's oldest chunk when no store is in flight: no ack is ever this object.
_NO_CHUNK: Any = object()


class _Settled:
    """A chunk acked while an earlier one is still in flight: only its last key matters."""

    __slots__ = ("last_key",)

    def __init__(self, last_key: str) -> None:
        self.last_key = last_key


class LifecycleSnapshot(NamedTuple):
    """Every observable field of a Lifecycle, for whole-state assertions."""

    state: State
    inflight: int
    tokens_submitted: int
    last_hash: str | None
    chain_tail: str | None
    in_flight_seqs: tuple[int, ...]
    next_seq: int
    finish_reason: FinishReason | None
    #: Sequence numbers of the loads in flight, ascending.
    loads_in_flight: tuple[int, ...] = ()


ReleaseCallback = Callable[["Lifecycle"], object]


class Lifecycle:
    """One request life's offload: state, chunks in flight, hash-chain tail.

    ``rid`` is a label for logs and metrics, never a key: two Lifecycles with
    the same rid are different objects, unequal, and each is reached only
    through its own tickets. ``on_release`` is called with the Lifecycle
    exactly once, when it is finished and nothing is in flight.

    ``owner`` is free for whoever drives the Lifecycle to attach its own record
    (an :class:`~kvlife.manager.OffloadManager` attaches its request record, so
    that an ack's ticket leads back to it); the Lifecycle never reads it.
    """

    __slots__ = (
        "__weakref__",
        "_finish_reason",
        "_hasher",
        "_head",
        "_last_hash",
        "_later",
        "_loads",
        "_loads_started",
        "_next_seq",
        "_on_release",
        "_page_size",
        "_pages_submitted",
        "_rid",
        "_state",
        "_stores",
        "_tail",
        "owner",
    )

    def __init__(
        self,
        rid: object,
        *,
        page_size: int,
        on_release: ReleaseCallback | None = None,
        prior_hash: str | None = None,
        hasher: PageHasher = sglang_page_hashes,
    ) -> None:
        if type(page_size) is not int or page_size <= 0:
            raise ConfigError(f"page_size must be a positive int, got {page_size!r}")
        if prior_hash is not None and type(prior_hash) is not str:
            raise HashingError(f"prior_hash must be a hex digest str, got {prior_hash!r}")
        self._rid = rid
        self._page_size = page_size
        self._on_release = on_release
        self._hasher = hasher
        self._state = _IDLE
        self._stores = 0  # chunks in flight
        self._pages_submitted = 0
        self._last_hash = prior_hash
        self._tail = prior_hash
        # Every chunk from the first one not yet in the acked prefix, in seq order: _head,
        # the oldest chunk in flight (_NO_CHUNK: no store in flight), then _later (a list made at
        # the first chunk submitted behind another). An entry of _later is the chunk's
        # Ticket while it is in flight; once acked out of order it becomes a _Settled
        # holding the chunk's last page key, until the prefix reaches it.
        self._head: Ticket = _NO_CHUNK
        self._later: list[Ticket | _Settled] | None = None
        self._next_seq = 0
        self._finish_reason: FinishReason | None = None
        # Loads in flight, by seq (made at the first load): their count is its length.
        self._loads: dict[int, LoadTicket] | None = None
        self._loads_started = 0
        self.owner: object = None

    # ---------------------------------------------------------------- reading

    @property
    def rid(self) -> object:
        """The request id: a label for logs and metrics, never a key."""
        return self._rid

    @property
    def page_size(self) -> int:
        """Tokens per page, fixed for the life."""
        return self._page_size

    @property
    def state(self) -> State:
        """The current :class:`State`."""
        return self._state

    @property
    def inflight(self) -> int:
        """Chunks and loads started and not yet acked."""
        return self._stores + len(self._loads or ())

    @property
    def stores_in_flight(self) -> int:
        """Chunks (stores) submitted and not yet acked."""
        return self._stores

    @property
    def loads_in_flight_count(self) -> int:
        """Loads started and not yet acked."""
        return len(self._loads or ())

    @property
    def tokens_submitted(self) -> int:
        """Tokens covered by every chunk submitted so far."""
        return self._pages_submitted * self._page_size

    @property
    def last_hash(self) -> str | None:
        """Key of the last page of the contiguous acked prefix (page order, not ack order)."""
        return self._last_hash

    @property
    def chain_tail(self) -> str | None:
        """Key of the last page submitted: the prior of the next chunk's first page."""
        return self._tail

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why decoding ended, once it has."""
        return self._finish_reason

    @property
    def next_seq(self) -> int:
        """Sequence number the next submitted chunk will get."""
        return self._next_seq

    def chunks_in_flight(self) -> tuple[Ticket, ...]:
        """Tickets submitted and not yet acked, in page order."""
        return tuple(chunk for chunk in self._window() if type(chunk) is not _Settled)  # type: ignore[misc]

    def loads_in_flight(self) -> tuple[LoadTicket, ...]:
        """Loads started and not yet acked, in seq order."""
        loads = self._loads or {}
        return tuple(loads[seq] for seq in sorted(loads))

    def snapshot(self) -> LifecycleSnapshot:
        """Every observable field, for comparing whole states."""
        return LifecycleSnapshot(
            self._state,
            self.inflight,
            self.tokens_submitted,
            self._last_hash,
            self._tail,
            tuple(t[1] for t in self.chunks_in_flight()),
            self.next_seq,
            self._finish_reason,
            tuple(sorted(self._loads or ())),
        )

    def __repr__(self) -> str:
        return (
            f"<Lifecycle rid={self._rid!r} {self._state.name} inflight={self.inflight} "
            f"id=0x{id(self):x}>"
        )

    # ---------------------------------------------------------------- events

    def submit(self, tokens: Sequence[int]) -> Ticket:
        """Record a chunk: the next whole pages of ``tokens``, in order; return its ticket."""
        kind = type(tokens)
        if kind is not list and kind is not tuple:
            _check_tokens(tokens, self._refuse)
        n = len(tokens)
        page_size = self._page_size
        try:  # _next_state, inlined: submit is the hot path
            dest = _ON_SUBMIT[self._state]
        except KeyError:
            raise self._partial(n) or self._refuse(
                InvalidTransition, _SUBMIT, "the table has no such transition"
            ) from None
        # Whole pages are checked on the keys: one key a page, each page whole. A hasher
        # that refuses a partial page is refused as the partial page, whatever it raised.
        try:
            # A list, usually (the ticket holds a tuple); tuple() returns a tuple as it is.
            keys = tuple(self._hasher(tokens, page_size, self._tail))
        except Exception as exc:
            partial = self._partial(n)
            if partial is None and not isinstance(exc, (HashingError, TypeError)):
                raise
            raise partial or self._refuse(InvalidChunk, _SUBMIT, str(exc)) from None
        pages = len(keys)
        if not pages or pages * page_size != n:
            raise self._partial(n) or self._refuse(
                InvalidChunk, _SUBMIT, f"the hasher gave {pages} keys for {n // page_size} pages"
            )
        tail = keys[-1]  # checked on its own: the usual chunk has no other key
        if type(tail) is not str or not tail:
            raise self._bad_key(tail)
        if pages > 1:
            for key in keys:  # a plain loop: no generator frame per chunk
                if type(key) is not str or not key:
                    raise self._bad_key(key)
        seq = self._next_seq
        first_page = self._pages_submitted
        ticket = (self, seq, keys, first_page)
        if self._head is _NO_CHUNK:  # the usual chunk: nothing else in flight
            self._head = ticket
        elif self._later is None:
            self._later = [ticket]
        else:
            self._later.append(ticket)
        self._next_seq = seq + 1
        self._pages_submitted = first_page + pages
        self._tail = tail
        self._stores += 1
        self._state = dest
        return ticket

    def ack(self, ticket: Ticket | LoadTicket) -> None:
        """Settle ``ticket``'s chunk (its copy completed, or failed: either way it is over).

        Refused with :class:`ForeignAck` if the ticket is another Lifecycle's,
        :class:`DuplicateAck` if it was already acked, :class:`UnknownChunk` if
        this Lifecycle never issued it. May release the Lifecycle.
        """
        if ticket is not self._head:
            return self._ack_other(ticket)
        if self._later or self._loads:
            return self._ack_oldest(ticket)
        # The one chunk in flight, and no load: the common case. It is this Lifecycle's
        # (only its own tickets are ever its _head) and in flight: no further check.
        try:
            dest = _ON_LAST_ACK[self._state]
        except KeyError:  # unreachable while the table and the checks agree
            raise self._refuse(
                InvalidTransition, _ACK, "the table has no such transition"
            ) from None
        self._head = _NO_CHUNK
        self._last_hash = ticket[2][-1]
        self._stores = 0
        self._state = dest
        if dest is _FINISHED:
            self._release()
        return None

    def _ack_oldest(self, ticket: Ticket) -> None:
        """An ack of the oldest chunk in flight, with other chunks or loads in flight."""
        stores, loads = self._stores, self._loads
        dest = self._ack_next_state(_ON_ACK, _ACK)
        # The acked prefix grows over this chunk and any acked early after it.
        if self._later:
            self._last_hash = self._advance(ticket[2][-1])
        else:
            self._head = _NO_CHUNK
            self._last_hash = ticket[2][-1]
        self._stores = stores - 1
        self._state = dest
        if dest is _FINISHED and stores == 1 and not loads:
            self._release()
        return None

    def _ack_other(self, ticket: Ticket | LoadTicket) -> None:
        """Every ack but the oldest chunk's own ticket: a load, a chunk acked out of order,
        an equal copy of a ticket (one that crossed a process), or a refusal."""
        if type(ticket) is LoadTicket:
            return self._ack_load(ticket)
        chunks = self._window()
        try:
            if type(ticket) is not tuple:  # a subclass could answer the equality test below
                raise TypeError
            owner, seq, _, _ = ticket  # type: ignore[misc]  # a LoadTicket went above
            index = seq - self._next_seq + len(chunks)
            chunk = chunks[index] if 0 <= index < len(chunks) else None
            # Not the chunk in flight: None, an acked chunk's key, or a forgery.
            other = chunk is not ticket and chunk != ticket
        except Exception:  # not a plain tuple, not unpackable, not comparable: not a Ticket
            what = type(ticket).__name__
            raise self._refuse(
                UnknownChunk, _ACK, f"an object of type {what} is not a Ticket"
            ) from None
        if owner is not self:
            raise self._refuse(ForeignAck, _ACK, f"chunk {seq} belongs to {owner!r}")
        if other:
            raise self._ack_refusal(seq, chunk)
        if not index:  # an equal copy of the oldest chunk's ticket: settle the original
            self.ack(chunk)
            return None
        dest = self._ack_next_state(_ON_ACK, _ACK)
        # An earlier chunk is still in flight: remember this one's last key (from the
        # ticket it issued, not the copy). That earlier chunk keeps the Lifecycle from
        # draining, so nothing is released here.
        self._later[index - 1] = _Settled(chunk[2][-1])  # type: ignore[index]
        self._stores -= 1
        self._state = dest
        return None

    def _window(self) -> list[Ticket | _Settled]:
        """Every chunk from the oldest in flight on, in seq order: entry ``i`` has seq
        ``_next_seq - len(window) + i``."""
        if self._head is _NO_CHUNK:
            return []
        return [self._head, *(self._later or ())]

    def _advance(self, last: str) -> str:
        """The oldest chunk was acked, with chunks behind it: the next one in flight becomes
        the oldest, past those acked early. Returns the new last key of the acked prefix."""
        later = self._later
        assert later
        while later and type(later[0]) is _Settled:
            last = later.pop(0).last_key  # type: ignore[union-attr]
        self._head = later.pop(0) if later else _NO_CHUNK  # type: ignore[assignment]
        return last

    def load(self, keys: Sequence[str]) -> LoadTicket:
        """Record a load of the pages stored under ``keys`` into device pages; return its ticket.

        The load is in flight until its ticket is acked: the Lifecycle does not
        release while it is, so the device pages it writes stay the request's.
        """
        if type(keys) is not list and type(keys) is not tuple:
            if isinstance(keys, (str, bytes, bytearray, memoryview)):  # not one key per item
                raise self._refuse(
                    InvalidChunk, _LOAD, f"expected a sequence of keys, got {type(keys).__name__}"
                )
            _check_tokens(keys, self._refuse, _LOAD)
        loaded = tuple(keys)
        if not loaded:
            raise self._refuse(InvalidChunk, _LOAD, "a load needs one or more str keys")
        for key in loaded:  # a plain loop: no generator frame per load
            if type(key) is not str or not key:
                raise self._refuse(InvalidChunk, _LOAD, f"key {key!r} is not a non-empty str")
        dest = self._next_state(_ON_LOAD, _LOAD)
        seq = self._loads_started
        ticket = _new_ticket(LoadTicket, (self, seq, loaded))
        if self._loads is None:
            self._loads = {}
        self._loads[seq] = ticket
        self._loads_started = seq + 1
        self._state = dest
        return ticket

    def _ack_load(self, ticket: LoadTicket) -> None:
        owner, seq = ticket.owner, ticket.seq
        if owner is not self:
            raise self._refuse(ForeignAck, _LOAD_ACK, f"load {seq!r} belongs to {owner!r}")
        loads = self._loads or {}
        known = loads.get(seq) if type(seq) is int else None  # a forged seq may not hash
        if known is None or known[2] != ticket[2]:
            if type(seq) is int and 0 <= seq < self._loads_started and seq not in loads:
                raise self._refuse(DuplicateAck, _LOAD_ACK, f"load {seq} was already acked")
            raise self._refuse(UnknownChunk, _LOAD_ACK, f"load {seq!r} was never started")
        dest = self._ack_next_state(_ON_LOAD_ACK, _LOAD_ACK)
        del loads[seq]
        self._state = dest
        if dest is _FINISHED and not self._stores and not loads:
            self._release()

    def finish(self, reason: FinishReason = FinishReason.FINISHED) -> None:
        """End decoding. Releases at once if nothing is in flight, else when the last ack comes."""
        if type(reason) is not FinishReason:
            raise self._refuse(InvalidEvent, _FINISH, f"reason {reason!r} is not a FinishReason")
        dest = _ON_FINISH.get(self._state)  # _next_state, inlined: once per life
        if dest is None:
            raise self._refuse(InvalidTransition, _FINISH, "the table has no such transition")
        self._finish_reason = reason
        self._state = dest
        if not self._stores and not self._loads:
            self._release()

    def _release(self) -> None:
        self._state = _ON_RELEASE[self._state][0]  # type: ignore[assignment]
        callback, self._on_release = self._on_release, None
        if callback is not None:
            try:
                callback(self)
            except Exception as exc:
                raise ReleaseCallbackError(
                    f"release callback of Lifecycle rid={self._rid!r} id=0x{id(self):x} raised "
                    f"{exc!r}; the Lifecycle is released and will not be released again",
                    rid=self._rid,
                    ident=id(self),
                ) from exc

    def _ack_next_state(self, rows: dict[State, _Row], event: Event) -> State:
        """The table's destination of an ack (``rows``: a store's or a load's) with what is
        in flight now, before it."""
        stores, loads = self._stores, len(self._loads or ())
        index = min(stores, 2) + 3 * min(loads, 2)
        dest = rows.get(self._state, _REFUSED)[index]
        if dest is None:  # unreachable while the table and the ack checks agree
            raise self._refuse(InvalidTransition, event, "the table has no such transition")
        return dest

    def _next_state(self, rows: dict[State, State], event: Event) -> State:
        """The table's destination of ``event`` (a guard-free one) from the current state."""
        try:
            return rows[self._state]
        except KeyError:
            raise self._refuse(
                InvalidTransition, event, "the table has no such transition"
            ) from None

    def _partial(self, n: int) -> LifecycleError | None:
        """The refusal of a chunk of ``n`` tokens that is not one or more whole pages."""
        if n and not n % self._page_size:
            return None
        why = f"{n} tokens are not one or more whole pages of {self._page_size}"
        return self._refuse(InvalidChunk, _SUBMIT, why)

    def _bad_key(self, key: object) -> LifecycleError:
        return self._refuse(
            InvalidChunk, _SUBMIT, f"the hasher gave key {key!r}, not a non-empty str"
        )

    def _ack_refusal(self, seq: int, chunk: Ticket | _Settled | None) -> LifecycleError:
        acked = self._next_seq - len(self._window())  # every chunk before it is settled
        if type(chunk) is _Settled or (chunk is None and 0 <= seq < acked):
            return self._refuse(DuplicateAck, _ACK, f"chunk {seq} was already acked")
        return self._refuse(UnknownChunk, _ACK, f"chunk {seq} was never submitted")

    def _refuse(self, kind: type[LifecycleError], event: Event, why: str) -> LifecycleError:
        return kind(
            f"{event.value} refused in state {self._state.name} for Lifecycle "
            f"rid={self._rid!r} id=0x{id(self):x}: {why}",
            event=event.value,
            state=self._state,
            rid=self._rid,
            ident=id(self),
        )
