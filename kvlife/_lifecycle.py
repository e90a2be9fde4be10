"""One request life's KV-offload lifecycle: the states, the table, the Lifecycle.

Theory of operation
===================

A decode runtime copies a request's KV pages from device to host in *chunks*
while the request keeps decoding. Each copy completes later, asynchronously,
with an *ack*. A :class:`Lifecycle` is one request *life*: it counts the chunks
in flight, records the hash-chain keys of every page it submitted, and decides
when the runtime may take its device pages back (*release*).

Two rules govern this file:

1. Everything that affects the lifecycle's state lives here. :data:`TABLE` is
   the only definition of which event may happen in which state and where it
   leads; the fast path (:class:`Lifecycle`), the ``transitions`` reference
   machine, the diagrams and the docs table are all made from it. No other
   module assigns a state.
2. This file does not know what carries the copies (torch, a thread, a test
   script) or what the runtime does with a released request. It imports no
   torch.

Identity, not rid: an ack carries its :class:`Ticket`, and the ticket carries
the Lifecycle it belongs to. A Lifecycle compares and hashes by identity, so a
new request that reuses a rid gets a new Lifecycle that no late ack of the old
one can reach. Nothing here is looked up by rid; the rid is a label for logs.

Guards are predicates of the number of chunks in flight, seen through three
classes: 0, 1 and "2 or more". The table is compiled once, at import, into a
dict keyed by ``(state, event, class)``: one lookup per event, no per-request
machine. Compilation refuses a table in which two rows match the same key.

Release is the one automatic event: it fires itself, exactly once, as soon as
its guard holds (a finished Lifecycle with nothing in flight). Every event the
table does not allow raises a :class:`~kvlife.errors.LifecycleError` and leaves
the Lifecycle exactly as it was: all checks run before the first assignment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from kvlife.errors import (
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
    "GUARDS",
    "TABLE",
    "Event",
    "FinishReason",
    "Lifecycle",
    "LifecycleSnapshot",
    "State",
    "Ticket",
    "Transition",
    "compile_table",
]


class State(Enum):
    """Where one request life stands in its offload."""

    #: Decoding; no chunk in flight.
    IDLE = "idle"
    #: Decoding; one or more chunks in flight.
    OFFLOADING = "offloading"
    #: No more decoding (finished, aborted or retracted); chunks still draining.
    FINISHED = "finished"
    #: Terminal: nothing in flight, device pages handed back exactly once.
    RELEASED = "released"


class Event(Enum):
    """What can happen to a Lifecycle."""

    #: Submit one chunk of whole pages for copying.
    SUBMIT = "submit"
    #: One chunk's copy completed (successfully or not).
    ACK = "ack"
    #: Decoding ended, with a :class:`FinishReason`.
    FINISH = "finish"
    #: Hand the device pages back; automatic once a finished Lifecycle drained.
    RELEASE = "release"


class FinishReason(Enum):
    """Why decoding ended. All three drain before release."""

    #: The request completed normally.
    FINISHED = "finished"
    #: The client or the runtime aborted the request.
    ABORTED = "aborted"
    #: Preempted: the runtime takes the pages back; a resumed request gets a new Lifecycle.
    RETRACTED = "retracted"


#: Guards, by name: predicates of the in-flight class (0, 1, or 2 meaning "2 or more").
GUARDS: dict[str, Callable[[int], bool]] = {
    "last_in_flight": lambda inflight: inflight == 1,
    "more_in_flight": lambda inflight: inflight >= 2,
    "drained": lambda inflight: inflight == 0,
}

#: The in-flight classes guards are evaluated on.
INFLIGHT_CLASSES = (0, 1, 2)


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
    Transition(_S.IDLE, _E.SUBMIT, _S.OFFLOADING, None, "record chunk, inflight += 1"),
    Transition(_S.OFFLOADING, _E.SUBMIT, _S.OFFLOADING, None, "record chunk, inflight += 1"),
    Transition(_S.OFFLOADING, _E.ACK, _S.OFFLOADING, "more_in_flight", "settle chunk, inflight -= 1"),
    Transition(_S.OFFLOADING, _E.ACK, _S.IDLE, "last_in_flight", "settle chunk, inflight -= 1"),
    Transition(_S.IDLE, _E.FINISH, _S.FINISHED, None, "record reason"),
    Transition(_S.OFFLOADING, _E.FINISH, _S.FINISHED, None, "record reason"),
    Transition(_S.FINISHED, _E.ACK, _S.FINISHED, "more_in_flight", "settle chunk, inflight -= 1"),
    Transition(_S.FINISHED, _E.ACK, _S.FINISHED, "last_in_flight", "settle chunk, inflight -= 1"),
    Transition(_S.FINISHED, _E.RELEASE, _S.RELEASED, "drained", "call the release callback once"),
)

#: Events that fire themselves as soon as their guard holds.
AUTOMATIC: frozenset[Event] = frozenset({Event.RELEASE})


def compile_table(table: Sequence[Transition]) -> dict[tuple[State, Event, int], State]:
    """``(state, event, inflight class) -> next state``; refuses a non-deterministic table."""
    compiled: dict[tuple[State, Event, int], State] = {}
    for row in table:
        if row.guard is not None and row.guard not in GUARDS:
            raise ValueError(f"row {row} names unknown guard {row.guard!r}")
        for inflight in INFLIGHT_CLASSES:
            if row.guard is not None and not GUARDS[row.guard](inflight):
                continue
            key = (row.source, row.event, inflight)
            if key in compiled:
                raise ValueError(
                    f"table is not deterministic: two rows for {row.event.value} in "
                    f"{row.source.name} with inflight class {inflight}"
                )
            compiled[key] = row.dest
    return compiled


_NEXT = compile_table(TABLE)
_IDLE, _OFFLOADING, _FINISHED, _RELEASED = State
_SUBMIT, _ACK, _FINISH, _RELEASE = Event


class Ticket(NamedTuple):
    """One submitted chunk. The engine carries it to the ack; it names its own Lifecycle."""

    #: The Lifecycle that submitted the chunk (never looked up by rid).
    lifecycle: Lifecycle
    #: Sequence number inside that Lifecycle: 0, 1, 2, ... in page order.
    seq: int
    #: Index of the chunk's first page among the pages this Lifecycle submitted.
    first_page: int
    #: Storage key of each page of the chunk, in page order.
    keys: tuple[str, ...]

    @property
    def n_pages(self) -> int:
        """Number of pages in the chunk."""
        return len(self.keys)


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


ReleaseCallback = Callable[["Lifecycle"], object]


class Lifecycle:
    """One request life's offload: state, chunks in flight, hash-chain tail.

    ``rid`` is a label for logs and metrics, never a key: two Lifecycles with
    the same rid are different objects, unequal, and each is reached only
    through its own tickets. ``on_release`` is called with the Lifecycle
    exactly once, when it is finished and nothing is in flight.
    """

    __slots__ = (
        "__weakref__",
        "_acked_early",
        "_base_seq",
        "_chunks",
        "_finish_reason",
        "_hasher",
        "_inflight",
        "_last_hash",
        "_on_release",
        "_pages_submitted",
        "_state",
        "_tail",
        "page_size",
        "rid",
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
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.rid = rid
        self.page_size = page_size
        self._on_release = on_release
        self._hasher = hasher
        self._state = _IDLE
        self._inflight = 0
        self._pages_submitted = 0
        self._last_hash = prior_hash
        self._tail = prior_hash
        # Chunks not yet in the acked prefix, by seq, in page order.
        self._chunks: dict[int, Ticket] = {}
        # Seqs acked while an earlier chunk was still in flight (created on first need).
        self._acked_early: set[int] | None = None
        self._base_seq = 0
        self._finish_reason: FinishReason | None = None

    # ---------------------------------------------------------------- reading

    @property
    def state(self) -> State:
        """The current :class:`State`."""
        return self._state

    @property
    def inflight(self) -> int:
        """Chunks submitted and not yet acked."""
        return self._inflight

    @property
    def tokens_submitted(self) -> int:
        """Tokens covered by every chunk submitted so far."""
        return self._pages_submitted * self.page_size

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
        return self._base_seq + len(self._chunks)

    def chunks_in_flight(self) -> tuple[Ticket, ...]:
        """Tickets submitted and not yet acked, in page order."""
        early = self._acked_early or ()
        return tuple(t for seq, t in self._chunks.items() if seq not in early)

    def snapshot(self) -> LifecycleSnapshot:
        """Every observable field, for comparing whole states."""
        return LifecycleSnapshot(
            self._state,
            self._inflight,
            self.tokens_submitted,
            self._last_hash,
            self._tail,
            tuple(t.seq for t in self.chunks_in_flight()),
            self.next_seq,
            self._finish_reason,
        )

    def __repr__(self) -> str:
        return (
            f"<Lifecycle rid={self.rid!r} {self._state.name} inflight={self._inflight} "
            f"id=0x{id(self):x}>"
        )

    # ---------------------------------------------------------------- events

    def submit(self, tokens: Sequence[int]) -> Ticket:
        """Record a chunk of whole pages of ``tokens`` (the next pages in order); return its ticket."""
        n = len(tokens)
        if n == 0 or n % self.page_size:
            raise self._refuse(
                InvalidChunk, _SUBMIT, f"{n} tokens are not one or more whole pages of {self.page_size}"
            )
        inflight = self._inflight
        dest = _NEXT.get((self._state, _SUBMIT, inflight if inflight < 2 else 2))
        if dest is None:
            raise self._refuse(InvalidTransition, _SUBMIT, "the table has no such transition")
        try:
            keys = tuple(self._hasher(tokens, self.page_size, self._tail))
        except HashingError as exc:
            raise self._refuse(InvalidChunk, _SUBMIT, str(exc)) from None
        seq = self._base_seq + len(self._chunks)
        ticket = Ticket(self, seq, self._pages_submitted, keys)
        self._chunks[seq] = ticket
        self._pages_submitted += len(keys)
        self._tail = keys[-1]
        self._inflight = inflight + 1
        self._state = dest
        return ticket

    def ack(self, ticket: Ticket) -> None:
        """Settle ``ticket``'s chunk (its copy completed, or failed: either way it is over).

        Refused with :class:`ForeignAck` if the ticket is another Lifecycle's,
        :class:`DuplicateAck` if it was already acked, :class:`UnknownChunk` if
        this Lifecycle never issued it. May release the Lifecycle.
        """
        if ticket.lifecycle is not self:
            raise self._refuse(
                ForeignAck, _ACK, f"chunk {ticket.seq} belongs to {ticket.lifecycle!r}"
            )
        seq = ticket.seq
        chunk = self._chunks.get(seq)
        if chunk is not ticket and chunk != ticket:
            if 0 <= seq < self._base_seq:
                raise self._refuse(DuplicateAck, _ACK, f"chunk {seq} was already acked")
            raise self._refuse(UnknownChunk, _ACK, f"chunk {seq} was never submitted")
        early = self._acked_early
        if early is not None and seq in early:
            raise self._refuse(DuplicateAck, _ACK, f"chunk {seq} was already acked")
        inflight = self._inflight
        dest = _NEXT.get((self._state, _ACK, inflight if inflight < 2 else 2))
        if dest is None:  # unreachable while the table and the checks above agree
            raise self._refuse(InvalidTransition, _ACK, "the table has no such transition")
        if seq == self._base_seq:
            chunks = self._chunks
            last = chunks.pop(seq)
            seq += 1
            while early and seq in early:
                early.discard(seq)
                last = chunks.pop(seq)
                seq += 1
            self._base_seq = seq
            self._last_hash = last.keys[-1]
        elif early is None:
            self._acked_early = {seq}
        else:
            early.add(seq)
        self._inflight = inflight - 1
        self._state = dest
        if dest is _FINISHED and inflight == 1:
            self._release()

    def finish(self, reason: FinishReason = FinishReason.FINISHED) -> None:
        """End decoding. Releases at once if nothing is in flight, else when the last ack comes."""
        if not isinstance(reason, FinishReason):
            raise self._refuse(InvalidEvent, _FINISH, f"reason {reason!r} is not a FinishReason")
        inflight = self._inflight
        dest = _NEXT.get((self._state, _FINISH, inflight if inflight < 2 else 2))
        if dest is None:
            raise self._refuse(InvalidTransition, _FINISH, "the table has no such transition")
        self._finish_reason = reason
        self._state = dest
        if inflight == 0:
            self._release()

    def _release(self) -> None:
        dest = _NEXT[(self._state, _RELEASE, 0)]
        self._state = dest
        callback, self._on_release = self._on_release, None
        if callback is not None:
            try:
                callback(self)
            except Exception as exc:
                raise ReleaseCallbackError(
                    f"release callback of Lifecycle rid={self.rid!r} id=0x{id(self):x} raised "
                    f"{exc!r}; the Lifecycle is released and will not be released again",
                    rid=self.rid,
                    ident=id(self),
                ) from exc

    def _refuse(self, kind: type[LifecycleError], event: Event, why: str) -> LifecycleError:
        return kind(
            f"{event.value} refused in state {self._state.name} for Lifecycle "
            f"rid={self.rid!r} id=0x{id(self):x}: {why}",
            event=event.value,
            state=self._state,
            rid=self.rid,
            ident=id(self),
        )
