"""A torch CUDA copy engine: a side stream, pinned host pages, one event per chunk.

The side stream waits on the compute stream at submit, so a copy sees every write
enqueued before it; a store is gathered on the device, a load scattered there, through a
staging buffer; ``poll`` asks each chunk's ``torch.cuda.Event``, and a load's ack makes
the compute stream wait on its event. The whole contract, and why a load's device pages
must not be read before its ack: ``docs/engines.md``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlife._lifecycle import LoadTicket, Ticket
from kvlife.engine.base import Ack, PageCopyEngine, host_runs
from kvlife.errors import ConfigError, DrainTimeout
from kvlife.layout import KVLayout
from kvlife.pool import HostPagePool

__all__ = ["CudaCopyEngine"]


def _index(device: torch.device | str) -> int:
    """A CUDA device's index; ``cuda`` with no index means the current device."""
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


@dataclass(slots=True)
class _Chunk:
    ticket: Ticket | LoadTicket
    load: bool
    device_pages: tuple[int, ...]
    host_pages: tuple[int, ...]
    event: torch.cuda.Event
    index: torch.Tensor
    submitted_at: float
    #: Set when the chunk failed part-way at submit; acked with it once its event completes.
    error: BaseException | None = None


class CudaCopyEngine(PageCopyEngine):
    """Copies chunks from a CUDA KV layout into pinned host pages on a side stream."""

    def __init__(
        self,
        layout: KVLayout,
        host: HostPagePool,
        *,
        stream: torch.cuda.Stream | None = None,
        max_staging_bytes: int = 256 << 20,
        poll_interval: float = 1e-4,
    ) -> None:
        super().__init__(layout, host)
        if not torch.cuda.is_available() or layout.device.type != "cuda":
            raise ConfigError(f"CudaCopyEngine needs a CUDA layout, not {layout.device}")
        if not host.pinned:
            raise ConfigError("the host pool must be pinned for asynchronous copies")
        if max_staging_bytes < layout.page_nbytes:
            raise ConfigError("max_staging_bytes must hold at least one page")
        self.device = layout.device
        if stream is not None and _index(stream.device) != _index(self.device):
            raise ConfigError(
                f"the stream is on {stream.device}, the layout on {self.device}: "
                "a copy must run on the layout's device"
            )
        self.stream = stream if stream is not None else torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        self.max_staging_bytes = int(max_staging_bytes)
        self.poll_interval = float(poll_interval)
        self._pending: deque[_Chunk] = deque()
        # Acks settled by a drain that then timed out; returned by the next poll or drain.
        self._ready: list[Ack] = []

    @property
    def inflight(self) -> int:
        """Chunks submitted whose acks were not yet returned by poll or drain."""
        return len(self._pending) + len(self._ready)

    def submit(
        self,
        ticket: Ticket | LoadTicket,
        device_pages: Sequence[int],
        host_pages: Sequence[int],
    ) -> torch.cuda.Event:
        """Validate the chunk, enqueue its copy on the side stream, return its event.

        A :data:`~kvlife.Ticket` copies device -> host, a
        :class:`~kvlife.LoadTicket` host -> device; the runtime must not read a
        load's device pages before its ack.
        """
        load, dev, hst, _, _ = self._checked(ticket, device_pages, host_pages)
        submitted_at = time.perf_counter()
        side = self.stream
        index = torch.empty(0, dtype=torch.int64)
        error: BaseException | None = None
        try:
            current = torch.cuda.current_stream(self.device)
            index = torch.tensor(dev, dtype=torch.int64, pin_memory=True).to(
                self.device, non_blocking=True
            )
            side.wait_stream(current)
            copy = self.layout.scatter_runs if load else self.layout.gather_runs
            with torch.cuda.stream(side):
                copy(
                    index,
                    self.host.tensor,
                    host_runs(hst),
                    max_staging_bytes=self.max_staging_bytes,
                )
            index.record_stream(side)
        except Exception as exc:
            # Failed part-way (a staging buffer that cannot be allocated, say): some
            # writes into the host pages (device pages, for a load) may still be
            # queued. The chunk stays in flight behind an event recorded after them,
            # and is acked as failed only when they are done, so its pages are never
            # freed or reused under them.
            error = exc
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(side)
        self._pending.append(_Chunk(ticket, load, dev, hst, event, index, submitted_at, error))
        self._claim(load, dev, hst)
        return event

    def poll(self) -> list[Ack]:
        """Acks of chunks whose events completed, in completion (= submission) order."""
        acks, self._ready = self._ready, []
        pending = self._pending
        while pending:
            error: BaseException | None = None
            try:
                if not pending[0].event.query():  # type: ignore[no-untyped-call]
                    break
            except RuntimeError as exc:  # an asynchronous CUDA error surfaces here
                error = exc
            acks.append(self._settle(pending.popleft(), error))
        return acks

    def drain(self, timeout: float | None = None) -> list[Ack]:
        """Block until every submitted chunk is acked; return the acks not yet returned.

        On :class:`DrainTimeout` the acks collected so far stay for the next poll or drain.
        """
        ready = self._ready
        pending = self._pending
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            event = pending[0].event
            error: BaseException | None = None
            try:
                if deadline is None:
                    event.synchronize()
                else:
                    while not event.query():  # type: ignore[no-untyped-call]
                        if time.monotonic() >= deadline:
                            raise DrainTimeout(
                                f"{len(pending)} chunks still in flight after {timeout} s"
                            )
                        time.sleep(self.poll_interval)
            except RuntimeError as exc:  # an asynchronous CUDA error surfaces here
                error = exc
            ready.append(self._settle(pending.popleft(), error))
        self._ready = []
        return ready

    def close(self) -> None:
        """Take no more chunks; chunks already submitted still complete and are acked."""
        self._closed = True

    def _settle(self, chunk: _Chunk, error: BaseException | None) -> Ack:
        self._unclaim(chunk.load, chunk.device_pages, chunk.host_pages)
        if chunk.load and error is None:
            # The event has completed; this orders the compute stream after the load
            # on the device too (free once complete), before the runtime reads the pages.
            torch.cuda.current_stream(self.device).wait_event(chunk.event)
        return Ack(
            chunk.ticket,
            chunk.device_pages,
            chunk.host_pages,
            chunk.error or error,
            chunk.submitted_at,
            time.perf_counter(),
        )
