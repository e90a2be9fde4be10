"""What every copy engine shares: the ack, the engine protocol, and chunk validation.

A copy engine copies a *chunk* (whole device pages) into host pages of a
:class:`~kvlife.pool.HostPagePool` (a store, :data:`~kvlife.Ticket`) or back (a
load, :class:`~kvlife.LoadTicket`), asynchronously, and later reports its
:class:`Ack`. The ack carries the ticket, and the ticket its owner (a request's
Lifecycle, or a host's own record of one operation): a late ack can only reach
the owner that submitted it. The engine reads a ticket's shape, never its owner. One thread (the
scheduler's) drives an engine; the runtime leaves a chunk's device pages alone
until its ack. The engine calls, the refusals (:class:`~kvlife.errors.EngineError`
and its subclasses) and what copies in flight may share: ``docs/engines.md``.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from kvlife._lifecycle import LoadTicket, Ticket, is_ticket
from kvlife.errors import ConfigError, EngineClosed, EngineError, PageBusy, UnallocatedHostPage

if TYPE_CHECKING:
    from kvlife.layout import KVLayout
    from kvlife.pool import HostPagePool

__all__ = [
    "Ack",
    "CopyEngine",
    "PageCopyEngine",
    "host_runs",
]


@dataclass(frozen=True, slots=True)
class Ack:
    """One chunk's completion: its ticket (hence its owner), its pages, success or error."""

    #: The chunk's ticket; its owner (``ticket[0]``) is the only one this ack may move.
    #: A :class:`~kvlife.LoadTicket` for a load (host -> device).
    ticket: Ticket | LoadTicket
    #: Device pages of the chunk in page order: read by a store, written by a load.
    device_pages: tuple[int, ...]
    #: Host pages of the chunk: written by a store, read by a load (listed on failure too,
    #: so the caller can free them).
    host_pages: tuple[int, ...]
    #: ``None`` on success; the copy's error otherwise (the contents of the pages the chunk
    #: writes are then undefined: host pages for a store, device pages for a load).
    error: BaseException | None = None
    #: ``time.perf_counter()`` at submit.
    submitted_at: float = 0.0
    #: ``time.perf_counter()`` when the engine saw the copy complete.
    completed_at: float = 0.0

    @property
    def owner(self) -> Any:
        """Who submitted the chunk: a request's Lifecycle, or a host's record of one operation."""
        return self.ticket[0]

    @property
    def seq(self) -> int:
        """The chunk's sequence number inside its owner."""
        return self.ticket[1]

    @property
    def keys(self) -> tuple[Any, ...]:
        """The storage key of each page of the chunk, in page order."""
        return self.ticket[2]

    @property
    def ok(self) -> bool:
        """Whether the copy succeeded."""
        return self.error is None

    @property
    def is_load(self) -> bool:
        """Whether the chunk was a load (host -> device)."""
        return type(self.ticket) is LoadTicket


@runtime_checkable
class CopyEngine(Protocol):
    """Copies chunks between device and host pages and reports one :class:`Ack` per chunk.

    A :data:`~kvlife.Ticket` copies device -> host (store), a
    :class:`~kvlife.LoadTicket` host -> device (load).
    """

    def check(
        self, device_pages: Sequence[int], host_pages: Sequence[int], *, load: bool = False
    ) -> None:
        """Raise the :class:`~kvlife.errors.EngineError` that ``submit`` would raise for these
        pages, if any."""
        ...

    def submit(
        self,
        ticket: Ticket | LoadTicket,
        device_pages: Sequence[int],
        host_pages: Sequence[int],
    ) -> object:
        """Validate the chunk, start copying it and return its completion handle; refusals
        raise :class:`~kvlife.errors.EngineError`."""
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


class PageCopyEngine:
    """What every engine shares: its device layout and host pool, the pages copies in
    flight write and read, whether it is closed, and the checks a chunk must pass."""

    def __init__(self, layout: KVLayout, host: HostPagePool) -> None:
        if layout.dtype != host.dtype or layout.page_numel != host.page_numel:
            raise ConfigError(
                f"device layout pages are {layout.dtype} x {layout.page_numel}, host pool "
                f"pages are {host.dtype} x {host.page_numel}"
            )
        self.layout = layout
        self.host = host
        self._busy: set[int] = set()  # host pages a store in flight is writing
        # Pages read by copies in flight, with how many copies read each (a plain dict: the
        # chunk-wide updates below run in C when no page is read twice, the common case).
        self._host_reading: dict[int, int] = {}  # host pages loads in flight read
        self._device_writing: set[int] = set()  # device pages a load in flight is writing
        self._device_reading: dict[int, int] = {}  # device pages stores in flight read
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def check(
        self, device_pages: Sequence[int], host_pages: Sequence[int], *, load: bool = False
    ) -> None:
        """Raise the :class:`~kvlife.errors.EngineError` that ``submit`` would raise for these
        pages, if any (``load``: for a load, host -> device)."""
        self._checked(None, device_pages, host_pages, load)

    def _checked(
        self,
        ticket: Ticket | LoadTicket | None,
        device_pages: Sequence[int],
        host_pages: Sequence[int],
        load: bool = False,
    ) -> tuple[bool, tuple[int, ...], tuple[int, ...]]:
        """Every check a chunk must pass before any copy: the one validation of every engine.

        With a ``ticket`` (``submit``), its type gives the direction (a
        :class:`~kvlife.LoadTicket` loads) and its page count must match; with
        ``None`` (``check``), ``load`` says. Returns the direction and the pages.
        """
        if self._closed:
            raise EngineClosed("the engine is closed; it takes no more chunks")
        if ticket is not None:
            kind = type(ticket)
            load = kind is LoadTicket
            if not load and not is_ticket(ticket):
                raise EngineError(
                    f"expected a Ticket or a LoadTicket, got {ticket!r:.80}; a Ticket is the "
                    f"tuple (owner, seq, keys, first_page)"
                )
            n = len(ticket[2])
            if len(device_pages) != n or len(host_pages) != n:
                raise EngineError(
                    f"{'load' if load else 'chunk'} {ticket[1]} has {n} pages but "
                    f"{len(device_pages)} device and {len(host_pages)} host pages"
                )
        dev, hst = tuple(device_pages), tuple(host_pages)
        if not dev or len(dev) != len(hst):
            raise EngineError(f"chunk has {len(dev)} device and {len(hst)} host pages")
        # Each check runs in C over the whole chunk (sets, min/max, one itemgetter); only a
        # chunk that fails one walks its pages to name the first offending page.
        for side, pages, limit in (
            ("device", dev, self.layout.num_pages),
            ("host", hst, self.host.capacity),
        ):
            if set(map(type, pages)) != {int} or min(pages) < 0 or max(pages) >= limit:
                p = next(p for p in pages if type(p) is not int or not 0 <= p < limit)
                raise EngineError(f"{side} page {p!r} out of range [0, {limit})")
            if len(set(pages)) != len(pages):
                seen: set[int] = set()
                for p in pages:
                    if p in seen:
                        raise EngineError(f"{side} page {p} appears twice in one chunk")
                    seen.add(p)
        owners = self.host.owners_of(hst)
        if None in owners or not self._busy.isdisjoint(hst):
            for p, owner in zip(hst, owners, strict=True):
                if owner is None:
                    raise UnallocatedHostPage(f"host page {p} is free; allocate it before copying")
                if p in self._busy:
                    raise PageBusy(f"host page {p} is still being written by a chunk in flight")
        if not load and not self._host_reading.keys().isdisjoint(hst):
            p = next(p for p in hst if p in self._host_reading)
            raise PageBusy(f"host page {p} is still being read by a load in flight")
        if not self._device_writing.isdisjoint(dev):
            p = next(p for p in dev if p in self._device_writing)
            raise PageBusy(f"device page {p} is still being written by a load in flight")
        if load and not self._device_reading.keys().isdisjoint(dev):
            p = next(p for p in dev if p in self._device_reading)
            raise PageBusy(f"device page {p} is still being read by a store in flight")
        return load, dev, hst

    def _claim(self, load: bool, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Mark a checked chunk's pages as in use by a copy in flight."""
        if load:
            self._device_writing.update(device_pages)
            _add(self._host_reading, host_pages)
        else:
            self._busy.update(host_pages)
            _add(self._device_reading, device_pages)

    def _unclaim(self, load: bool, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Release what :meth:`_claim` marked, when the chunk is acked."""
        if load:
            self._device_writing.difference_update(device_pages)
            _drop(self._host_reading, host_pages)
        else:
            self._busy.difference_update(host_pages)
            _drop(self._device_reading, device_pages)


def _add(readers: dict[int, int], pages: Sequence[int]) -> None:
    """One more copy reads each of ``pages`` (distinct: a chunk names a page once)."""
    if readers.keys().isdisjoint(pages):  # none read yet: one C update
        readers.update(dict.fromkeys(pages, 1))
        return
    for p in pages:
        readers[p] = readers.get(p, 0) + 1


def _drop(readers: dict[int, int], pages: Sequence[int]) -> None:
    """What :func:`_add` counted, undone: a page no copy reads any more is gone."""
    if len(readers) == len(pages) and sum(readers.values()) == len(pages):  # the only reader
        readers.clear()
        return
    for p in pages:
        left = readers.pop(p) - 1
        if left:
            readers[p] = left


def page_index(pages: Sequence[int]) -> torch.Tensor:
    """Checked page numbers as an int64 CPU tensor, through a C array (a third of
    ``torch.tensor``'s time for a list of ints; the tensor keeps the array alive)."""
    if not pages:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", pages), dtype=torch.int64)


def host_runs(host_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive host pages: ``(chunk offset, first host page, length)``."""
    n = len(host_pages)
    if n and tuple(host_pages) == tuple(range(host_pages[0], host_pages[0] + n)):
        return [(0, host_pages[0], n)]  # one run, found in C (a job's pages often are)
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or host_pages[i] != host_pages[i - 1] + 1:
            runs.append((start, host_pages[start], i - start))
            start = i
    return runs
