"""What every copy engine shares: the ack, the engine protocol, and chunk validation.

A copy engine copies one *chunk* (some whole device pages of one Lifecycle)
into host pages of a :class:`~kvlife.pool.HostPagePool`, asynchronously, and
later reports its :class:`Ack`. The ack carries the chunk's
:class:`~kvlife.Ticket`, and the ticket its Lifecycle: an engine never looks
anything up by rid, so a late ack can only reach the life that submitted it.

Engines are driven by one thread (the scheduler's): it submits, polls and
drains. Engine primitives, one line each:

- ``check(device_pages, host_pages)``: the page checks of ``submit``, nothing else;
- ``submit(ticket, device_pages, host_pages)``: validate, then start the copy;
- ``poll()``: acks completed since the last poll or drain, without blocking;
- ``drain(timeout)``: block until every submitted chunk is acked;
- ``inflight``: chunks submitted whose acks were not yet returned;
- ``close()``: stop taking chunks; acks of submitted chunks still arrive.

A chunk is refused with a typed :class:`EngineError`, before anything is
copied or counted, when its lengths disagree with the ticket, a page index is
out of range or repeated, or a host page is unallocated or already being
written by another chunk in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvlife import errors
from kvlife._lifecycle import Lifecycle, Ticket
from kvlife.errors import KVLifeError

if TYPE_CHECKING:
    from kvlife.layout import KVLayout
    from kvlife.pool import HostPagePool

__all__ = [
    "Ack",
    "Completion",
    "CopyEngine",
    "CopyFault",
    "DrainTimeout",
    "DuplicatePage",
    "EngineClosed",
    "EngineConfigError",
    "EngineError",
    "HostPageBusy",
    "InvalidTicket",
    "LayoutMismatch",
    "LengthMismatch",
    "PageCopyEngine",
    "PageOutOfRange",
    "UnallocatedHostPage",
    "check_chunk",
    "check_compatible",
    "check_pages",
    "host_runs",
]


class EngineError(KVLifeError):
    """A copy engine refused a call; nothing was submitted and nothing changed."""


class EngineConfigError(EngineError, ValueError):
    """An engine constructed with impossible settings (a negative delay, a CUDA layout on CPU)."""


class InvalidTicket(EngineError, TypeError):
    """The ticket is not a :class:`~kvlife.Ticket`."""


class LengthMismatch(EngineError, ValueError):
    """Device pages, host pages and the ticket's page count disagree (or the chunk is empty)."""


class PageOutOfRange(EngineError, IndexError):
    """A device or host page index is out of range or not an int; ``side`` says which."""

    def __init__(self, message: str, *, side: str, page: object) -> None:
        super().__init__(message)
        self.side = side
        self.page = page


class DuplicatePage(EngineError, ValueError):
    """A page appears twice in one chunk."""


class UnallocatedHostPage(EngineError, ValueError):
    """A host page is free in the pool: a chunk must copy into pages it was given."""


class HostPageBusy(EngineError, ValueError):
    """A host page is still being written by another chunk in flight."""


class LayoutMismatch(EngineError, ValueError):
    """Device layout and host pool disagree on dtype or page width."""


class EngineClosed(EngineError, RuntimeError):
    """The engine was closed; it takes no more chunks."""


class DrainTimeout(EngineError, errors.DrainTimeout):
    """``drain`` ran out of time; acks collected so far come with the next poll or drain."""


class CopyFault(EngineError):
    """A copy that failed (the default error of fault injection)."""


@dataclass(frozen=True, slots=True)
class Ack:
    """One chunk's completion: its ticket (hence its Lifecycle), its pages, success or error."""

    #: The chunk's ticket; ``ticket.lifecycle`` is the only Lifecycle this ack may move.
    ticket: Ticket
    #: Device pages the chunk read, in page order.
    device_pages: tuple[int, ...]
    #: Host pages the chunk wrote (listed on failure too, so the caller can free them).
    host_pages: tuple[int, ...]
    #: ``None`` on success; the copy's error otherwise (host contents then undefined).
    error: BaseException | None = None
    #: ``time.perf_counter()`` at submit.
    submitted_at: float = 0.0
    #: ``time.perf_counter()`` when the engine saw the copy complete.
    completed_at: float = 0.0

    @property
    def lifecycle(self) -> Lifecycle:
        """The Lifecycle that submitted the chunk."""
        return self.ticket.lifecycle

    @property
    def seq(self) -> int:
        """The chunk's sequence number inside its Lifecycle."""
        return self.ticket.seq

    @property
    def ok(self) -> bool:
        """Whether the copy succeeded."""
        return self.error is None


@runtime_checkable
class Completion(Protocol):
    """One chunk's completion marker, queried like ``torch.cuda.Event``."""

    def query(self) -> bool:
        """Whether the chunk's copy has completed (successfully or not)."""
        ...

    def synchronize(self) -> None:
        """Block until the chunk's copy has completed."""
        ...


@runtime_checkable
class CopyEngine(Protocol):
    """Copies chunks of device pages into host pages and reports one :class:`Ack` per chunk."""

    def check(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Raise the :class:`EngineError` that ``submit`` would raise for these pages, if any."""
        ...

    def submit(
        self, ticket: Ticket, device_pages: Sequence[int], host_pages: Sequence[int]
    ) -> None:
        """Validate the chunk, then start copying it; refusals raise :class:`EngineError`."""
        ...

    def poll(self) -> list[Ack]:
        """Acks completed since the last poll or drain, in completion order; never blocks."""
        ...

    def drain(self, timeout: float | None = None) -> list[Ack]:
        """Block until every submitted chunk is acked; return the acks not yet returned."""
        ...

    @property
    def inflight(self) -> int:
        """Chunks submitted whose acks were not yet returned by poll or drain."""
        ...

    def close(self) -> None:
        """Take no more chunks; chunks already submitted still complete and are acked."""
        ...


def check_compatible(layout: KVLayout, host: HostPagePool) -> None:
    """Refuse a device layout and host pool that disagree on dtype or page width."""
    if layout.dtype != host.dtype or layout.page_numel != host.page_numel:
        raise LayoutMismatch(
            f"device layout pages are {layout.dtype} x {layout.page_numel}, host pool pages "
            f"are {host.dtype} x {host.page_numel}"
        )


def _check_pages(side: str, pages: tuple[int, ...], limit: int) -> None:
    seen: set[int] = set()
    for p in pages:
        if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < limit:
            raise PageOutOfRange(f"{side} page {p!r} out of range [0, {limit})", side=side, page=p)
        if p in seen:
            raise DuplicatePage(f"{side} page {p} appears twice in one chunk")
        seen.add(p)


def check_pages(
    device_pages: Sequence[int],
    host_pages: Sequence[int],
    layout: KVLayout,
    host: HostPagePool,
    busy: set[int] | frozenset[int] = frozenset(),
    *,
    closed: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Every page check a chunk must pass before any copy; returns the pages as tuples."""
    if closed:
        raise EngineClosed("the engine is closed; it takes no more chunks")
    dev, hst = tuple(device_pages), tuple(host_pages)
    if not dev or len(dev) != len(hst):
        raise LengthMismatch(f"chunk has {len(dev)} device and {len(hst)} host pages")
    _check_pages("device", dev, layout.num_pages)
    _check_pages("host", hst, host.capacity)
    for p in hst:
        if host.owner_of(p) is None:
            raise UnallocatedHostPage(f"host page {p} is free; allocate it before copying")
        if p in busy:
            raise HostPageBusy(f"host page {p} is still being written by a chunk in flight")
    return dev, hst


def check_chunk(
    ticket: object,
    device_pages: Sequence[int],
    host_pages: Sequence[int],
    layout: KVLayout,
    host: HostPagePool,
    busy: set[int] | frozenset[int] = frozenset(),
    *,
    closed: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`check_pages`, and the ticket's page count must match; returns the pages."""
    if closed:
        raise EngineClosed("the engine is closed; it takes no more chunks")
    if not isinstance(ticket, Ticket):
        raise InvalidTicket(f"expected a Ticket, got {type(ticket).__name__}")
    n = ticket.n_pages
    if len(device_pages) != n or len(host_pages) != n:
        raise LengthMismatch(
            f"chunk {ticket.seq} has {n} pages but {len(device_pages)} device and "
            f"{len(host_pages)} host pages"
        )
    return check_pages(device_pages, host_pages, layout, host, busy)  # open: checked above


class PageCopyEngine:
    """What every engine shares: its device layout and host pool, the host pages
    being written, whether it is closed, and the checks a chunk must pass."""

    def __init__(self, layout: KVLayout, host: HostPagePool) -> None:
        check_compatible(layout, host)
        self.layout = layout
        self.host = host
        self._busy: set[int] = set()  # host pages a chunk in flight is writing
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def check(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Raise the :class:`EngineError` that ``submit`` would raise for these pages, if any."""
        check_pages(
            device_pages, host_pages, self.layout, self.host, self._busy, closed=self._closed
        )

    def _check_chunk(
        self, ticket: object, device_pages: Sequence[int], host_pages: Sequence[int]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return check_chunk(
            ticket,
            device_pages,
            host_pages,
            self.layout,
            self.host,
            self._busy,
            closed=self._closed,
        )


def host_runs(host_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive host pages: ``(chunk offset, first host page, length)``."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    n = len(host_pages)
    for i in range(1, n + 1):
        if i == n or host_pages[i] != host_pages[i - 1] + 1:
            runs.append((start, host_pages[start], i - start))
            start = i
    return runs
