"""What every copy engine shares: the ack, the engine protocol, and chunk validation.

A copy engine copies a *chunk* (whole device pages) into host pages of a
:class:`~kvlife.pool.HostPagePool` (a store, :data:`~kvlife.Ticket`) or back (a load,
:class:`~kvlife.LoadTicket`), asynchronously, and later reports its :class:`Ack`, which
carries the ticket and so its owner; the engine reads a ticket's shape, never its owner
(docs/design.md, "One copy pipeline"). The engine calls, the refusals
(:class:`~kvlife.errors.EngineError`) and what copies in flight may share:
``docs/engines.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from kvlife._lifecycle import LoadTicket, Ticket, is_ticket
from kvlife.errors import ConfigError, EngineClosed, EngineError, PageBusy, UnallocatedHostPage

try:  # a chunk's page checks and claims in one C pass each; where not built, in Python
    from kvlife._rowcopy import claim as _c_claim
    from kvlife._rowcopy import pages as _c_pages
    from kvlife._rowcopy import runs as _c_runs
except ImportError:
    _c_claim = _c_pages = _c_runs = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from kvlife.layout import KVLayout
    from kvlife.pool import HostPagePool

#: A chunk's pages as a 1-D int64 array, and pages either way.
Index = np.ndarray[Any, np.dtype[np.int64]]
Pages = Sequence[int] | Index

__all__ = ["Ack", "CopyEngine", "PageCopyEngine", "host_runs"]


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
    """Copies chunks between device and host pages and reports one :class:`Ack` per chunk. A
    :data:`~kvlife.Ticket` copies device -> host (store), a :class:`~kvlife.LoadTicket` host ->
    device (load)."""

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
        # Per page, the copies in flight on it: -1 one writes it (a store its host pages, a
        # load its device pages), n > 0 n copies read it, 0 none. Arrays: a chunk's check,
        # claim and release are a few vectorised steps over its pages, not set operations.
        self._host_use = np.zeros(host.capacity, dtype=np.int32)
        self._device_use = np.zeros(layout.num_pages, dtype=np.int32)
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def host_pages_busy(self, *, reads: bool = True) -> set[int]:
        """Host pages a store in flight writes and, with ``reads``, a load in flight reads."""
        use = self._host_use
        return set(np.flatnonzero(use != 0 if reads else use < 0).tolist())

    def device_pages_busy(self, pages: Sequence[int]) -> bool:
        """Whether a copy in flight reads or writes any of these (checked) device pages."""
        return bool(self._device_use[_index(pages)].any())

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
    ) -> tuple[bool, tuple[int, ...], tuple[int, ...], Index, Index]:
        """Every check a chunk must pass before any copy: the one validation of every engine.
        With a ``ticket`` (``submit``), its type gives the direction (a
        :class:`~kvlife.LoadTicket` loads) and its page count must match; with ``None``
        (``check``), ``load`` says. Returns the direction, the pages, and the pages as int64
        arrays (device, host)."""
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
        d = _check_pages("device", dev, self.layout.num_pages)
        h = _check_pages("host", hst, self.host.capacity)
        owners = self.host.owners_of(hst)
        # A store needs its host pages untouched and its device pages not being written; a
        # load its host pages not being written and its device pages untouched. A chunk that
        # breaks a rule walks its pages to name the first page of the first rule it breaks.
        if None in owners or not self._use(load, d, h, 0):
            host_use, device_use = self._host_use[h], self._device_use[d]
            for p, owner, use in zip(hst, owners, host_use.tolist(), strict=True):
                if owner is None:
                    raise UnallocatedHostPage(f"host page {p} is free; allocate it before copying")
                if use < 0:
                    raise PageBusy(f"host page {p} is still being written by a chunk in flight")
            if not load and host_use.any():
                p = hst[int(np.flatnonzero(host_use)[0])]
                raise PageBusy(f"host page {p} is still being read by a load in flight")
            if device_use.min() < 0:
                p = dev[int(np.flatnonzero(device_use < 0)[0])]
                raise PageBusy(f"device page {p} is still being written by a load in flight")
            p = dev[int(np.flatnonzero(device_use)[0])]
            raise PageBusy(f"device page {p} is still being read by a store in flight")
        return load, dev, hst, d, h

    def _claim(self, load: bool, device_pages: Pages, host_pages: Pages) -> None:
        """Mark a checked chunk's pages as in use by a copy in flight: the pages it writes (a
        store's host pages, a load's device pages) -1, the pages it reads one reader more."""
        self._use(load, _index(device_pages), _index(host_pages), 1)

    def _use(self, load: bool, device: Index, host: Index, n: int) -> bool:
        """The page-use marks of a chunk's copy: ``n=1`` marks them if its pages are free to
        (what it writes untouched, nothing it reads being written), ``n=0`` only checks,
        ``n=-1`` unmarks; whether they were free."""
        pairs = [(self._device_use, device), (self._host_use, host)]
        (writes, written), (reads, read) = pairs if load else pairs[::-1]
        if _c_claim is not None:
            return _c_claim(writes, written, reads, read, n)
        free = n < 0 or not (writes[written].any() or reads[read].min() < 0)
        if free and n:
            writes[written] = -1 if n > 0 else 0
            reads[read] += n
        return free

    def _unclaim(self, load: bool, device_pages: Pages, host_pages: Pages) -> None:
        """Release what :meth:`_claim` marked, when the chunk is acked."""
        self._use(load, _index(device_pages), _index(host_pages), -1)


def _c_index(pages: Sequence[int], limit: int = 1 << 62) -> Index | None:
    """``pages`` as int64 from one C pass when each is an int (not a bool) in ``[0, limit)``
    and none repeats (a tenth of ``np.array``'s time for a list of ints); else, or where
    the extension is not built, None."""
    index = None if _c_pages is None else _c_pages(pages, limit)
    return np.frombuffer(index, dtype=np.int64) if type(index) is bytearray else None


def _index(pages: Pages) -> Index:
    """Checked pages as an int64 array (an array as it is)."""
    if isinstance(pages, np.ndarray):
        return pages
    index = _c_index(pages)
    return np.array(pages, dtype=np.int64) if index is None else index


def _check_pages(side: str, pages: Sequence[int], limit: int) -> Index:
    """``pages`` as an int64 array; EngineError unless every page is an int (not a bool)
    in ``[0, limit)``, none twice: a chunk that fails the C pass (or every chunk, without
    the extension) walks its pages here to name the first offending page."""
    index = _c_index(pages, limit)
    if index is not None:
        return index
    if set(map(type, pages)) != {int} or min(pages) < 0 or max(pages) >= limit:
        p = next(p for p in pages if type(p) is not int or not 0 <= p < limit)
        raise EngineError(f"{side} page {p!r} out of range [0, {limit})")
    if len(set(pages)) != len(pages):
        seen: set[int] = set()
        for p in pages:
            if p in seen:
                raise EngineError(f"{side} page {p} appears twice in one chunk")
            seen.add(p)
    return np.array(pages, dtype=np.int64)


def distinct(pages: Sequence[int]) -> bool:
    """Whether no page repeats."""
    return _c_index(pages) is not None or len(set(pages)) == len(pages)


def page_index(pages: Sequence[int]) -> torch.Tensor:
    """Checked page numbers as an int64 CPU tensor."""
    return torch.from_numpy(_index(pages))


def host_runs(host_pages: Pages) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive host pages: ``(chunk offset, first host page, length)``."""
    found = None if _c_runs is None else _c_runs(host_pages)  # one C pass, where all are ints
    if found is not None:
        return found
    n = len(host_pages)
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or host_pages[i] != host_pages[i - 1] + 1:
            runs.append((start, host_pages[start], i - start))
            start = i
    return runs
