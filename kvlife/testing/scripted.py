"""ScriptedEngine: a copy engine whose copies complete only when the test says so.

It reads a chunk's device pages at completion, never at submit, so pages handed back
before the ack are caught (docs/testing-kit.md, "Why the scripted engine reads late").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvlife._lifecycle import Lifecycle, LoadTicket, Ticket
from kvlife.engine.base import Ack, PageCopyEngine, host_runs
from kvlife.errors import CopyFault, EngineError
from kvlife.layout import KVLayout
from kvlife.pool import HostPagePool

__all__ = ["ScriptedCopy", "ScriptedEngine"]


@dataclass(eq=False, slots=True)
class ScriptedCopy:
    """One submitted chunk waiting for the test to complete it; compared by identity."""

    #: The chunk's ticket (``ticket[0]`` is the life that submitted it); a
    #: ``LoadTicket`` for a load.
    ticket: Ticket | LoadTicket
    #: Device pages the copy will read (a load: write) when completed, in page order.
    device_pages: tuple[int, ...]
    #: Host pages it will write (a load: read).
    host_pages: tuple[int, ...]
    #: Submission number in this engine: 0, 1, 2, ...
    number: int
    submitted_at: float = 0.0

    @property
    def lifecycle(self) -> Lifecycle:
        """The Lifecycle that submitted the chunk."""
        owner: Lifecycle = self.ticket[0]
        return owner

    def __repr__(self) -> str:
        return (
            f"<copy #{self.number} rid={self.ticket[0].rid!r} seq={self.ticket[1]} "
            f"device={list(self.device_pages)} host={list(self.host_pages)}>"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Print as :meth:`__repr__` in hypothesis' reports, not field by field."""
        printer.text(repr(self))


class ScriptedEngine(PageCopyEngine):
    """A :class:`~kvlife.engine.base.CopyEngine` that copies a chunk only when told to."""

    def __init__(self, layout: KVLayout, host: HostPagePool) -> None:
        super().__init__(layout, host)
        self._in_flight: list[ScriptedCopy] = []
        self._ready: list[Ack] = []
        self._submitted = 0

    def in_flight(self) -> list[ScriptedCopy]:
        """Copies submitted and not completed, in submit order."""
        return list(self._in_flight)

    def complete(self, copy: ScriptedCopy, ok: bool = True) -> None:
        """Complete ``copy`` now (a store reads its device pages, a load writes them), or
        fail it; its ack comes at the next :meth:`poll`. :class:`~kvlife.errors.EngineError`
        (nothing changes) if ``copy`` is not in flight."""
        if not any(c is copy for c in self._in_flight):
            raise EngineError(f"{copy!r} is not in flight in this engine")
        load = type(copy.ticket) is LoadTicket
        error = None if ok else CopyFault(f"scripted copy fault in {copy!r}")
        if ok:
            index = torch.tensor(copy.device_pages, dtype=torch.int64)
            copy_runs = self.layout.scatter_runs if load else self.layout.gather_runs
            copy_runs(index, self.host.tensor, host_runs(copy.host_pages))  # load: host -> device
        self._in_flight = [c for c in self._in_flight if c is not copy]
        self._unclaim(load, copy.device_pages, copy.host_pages)
        now = time.perf_counter()
        self._ready.append(
            Ack(copy.ticket, copy.device_pages, copy.host_pages, error, copy.submitted_at, now)
        )

    @property
    def inflight(self) -> int:
        """Chunks submitted whose acks were not yet returned by poll or drain."""
        return len(self._in_flight) + len(self._ready)

    def submit(
        self, ticket: Ticket | LoadTicket, device_pages: Sequence[int], host_pages: Sequence[int]
    ) -> ScriptedCopy:
        """Validate the chunk and hold it until :meth:`complete` (returns the copy to
        complete); refusals change nothing."""
        load, dev, hst, _, _ = self._checked(ticket, device_pages, host_pages)
        copy = ScriptedCopy(ticket, dev, hst, self._submitted, time.perf_counter())
        self._submitted += 1
        self._claim(load, dev, hst)
        self._in_flight.append(copy)
        return copy

    def poll(self) -> list[Ack]:
        """Acks of the copies completed since the last poll or drain, in completion order."""
        acks, self._ready = self._ready, []
        return acks

    def drain(self, timeout: float | None = None) -> list[Ack]:
        """Complete every copy still in flight (successfully, in submit order); return every ack."""
        for copy in list(self._in_flight):
            self.complete(copy)
        return self.poll()

    def close(self) -> None:
        """Take no more chunks; copies in flight can still be completed."""
        self._closed = True
