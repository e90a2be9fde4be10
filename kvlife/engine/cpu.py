"""A torch CPU copy engine: real worker threads, so races in tests are real.

Worker threads copy a chunk when they *run* (a runtime that touches its device pages
before the ack sees what it would on a GPU); ``poll`` and ``drain`` collect finished
chunks in completion order on the owning thread, which alone changes the engine's
counters. The delays and fault injection that make interleavings reproducible:
``docs/engines.md``.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvlife._checks import finite_seconds, positive_int
from kvlife._lifecycle import LoadTicket, Ticket
from kvlife.engine.base import Ack, Index, PageCopyEngine, host_runs
from kvlife.errors import ConfigError, CopyFault, DrainTimeout
from kvlife.layout import KVLayout
from kvlife.pool import HostPagePool

__all__ = ["MAX_PENDING_FAULTS", "CpuCopyEngine", "CpuCopyEvent", "Gate"]

#: Injected faults (``fail_next``) and delays (``slow_next``) that may wait for chunks at
#: once: far more than any test submits, few enough that the queue is never a memory risk.
MAX_PENDING_FAULTS = 1 << 20


class CpuCopyEvent:
    """One chunk's completion, queried like ``torch.cuda.Event``."""

    __slots__ = ("_done", "_pending", "_started")

    def __init__(self) -> None:
        # Held until the worker is done: one C object, where a threading.Event is several.
        self._pending = threading.Lock()
        self._pending.acquire()
        self._done = False
        self._started = False

    def query(self) -> bool:
        """Whether the chunk's copy has completed (successfully or not)."""
        return self._done

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the copy completed; :class:`DrainTimeout` after ``timeout`` seconds."""
        if self._done:
            return
        if not self._pending.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise DrainTimeout(f"chunk copy not complete after {timeout} s")
        self._pending.release()  # for the next waiter

    def _set(self) -> None:
        """The worker's: the copy is over."""
        self._done = True
        self._pending.release()

    @property
    def started(self) -> bool:
        """Whether a worker has begun reading the device pages (its delay is over)."""
        return self._started


class Gate(threading.Event):
    """Holds one chunk's copy (the worker waits on it) until :meth:`open`."""

    def open(self) -> None:
        """Let the held copy run."""
        self.set()

    @property
    def is_open(self) -> bool:
        """Whether the gate was opened."""
        return self.is_set()


@dataclass(slots=True)
class _Job:
    ticket: Ticket | LoadTicket
    load: bool
    device_pages: tuple[int, ...]
    host_pages: tuple[int, ...]
    index: Index
    host_index: Index
    runs: list[tuple[int, int, int]]
    delay: float
    gate: Gate | None
    fault: BaseException | None
    submitted_at: float
    event: CpuCopyEvent = field(default_factory=CpuCopyEvent)
    error: BaseException | None = None
    completed_at: float = 0.0


class CpuCopyEngine(PageCopyEngine):
    """Copies chunks from a CPU KV layout into a host page pool on worker threads."""

    def __init__(
        self,
        layout: KVLayout,
        host: HostPagePool,
        *,
        copy_delay: float = 0.0,
        delay_jitter: float = 0.0,
        fail_rate: float = 0.0,
        seed: int = 0,
        workers: int = 1,
    ) -> None:
        super().__init__(layout, host)
        if layout.device.type != "cpu":
            raise ConfigError(f"CpuCopyEngine copies from a CPU layout, not {layout.device}")
        self.copy_delay = finite_seconds("copy_delay", copy_delay)
        self.delay_jitter = finite_seconds("delay_jitter", delay_jitter)
        if not 0.0 <= fail_rate <= 1.0:
            raise ConfigError(f"fail_rate must be in [0, 1], got {fail_rate!r}")
        if not positive_int("workers", workers, least=0) and (self.copy_delay or self.delay_jitter):
            raise ConfigError("copy_delay and delay_jitter need a worker thread (workers >= 1)")
        self.fail_rate = float(fail_rate)
        self._rng = random.Random(seed)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        # Owner-thread state: collected but not yet returned acks, counters, queued faults.
        self._ready: list[Ack] = []
        self._inflight = 0
        self._fail_next: deque[BaseException | None] = deque()
        self._slow_next: deque[float] = deque()
        self._hold_next: deque[Gate] = deque()
        self._held: list[Gate] = []
        #: Copies that failed with an error of their own, not an injected fault.
        self.copy_errors = 0
        #: The newest of those errors.
        self.last_copy_error: BaseException | None = None
        self._closing = threading.Event()  # set by close: delayed copies run at once
        self._threads = [
            threading.Thread(target=self._work, name=f"kvlife-cpu-copy-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def fail_next(self, n: int = 1, error: BaseException | None = None) -> None:
        """Make the next ``n`` submitted chunks fail with ``error`` (default
        :class:`CopyFault`). ``n`` is a positive int (not a bool), and at most
        :data:`MAX_PENDING_FAULTS` faults wait at once; ``error`` is an exception instance.
        Refused with ConfigError, nothing queued."""
        positive_int("n", n)
        if n > MAX_PENDING_FAULTS - len(self._fail_next):
            raise ConfigError(
                f"fail_next({n}): at most {MAX_PENDING_FAULTS} injected faults may wait at "
                f"once, {len(self._fail_next)} already do"
            )
        if error is not None and not isinstance(error, BaseException):
            raise ConfigError(f"error must be an exception instance or None, got {error!r}")
        self._fail_next.extend([error] * n)

    def slow_next(self, seconds: float) -> None:
        """Delay the next submitted chunk's copy by ``seconds`` more (finite, >= 0)."""
        more = finite_seconds("seconds", seconds)
        self._need_worker("slow_next")
        if len(self._slow_next) >= MAX_PENDING_FAULTS:
            raise ConfigError(f"at most {MAX_PENDING_FAULTS} delays may wait at once")
        self._slow_next.append(more)

    def hold_next(self) -> Gate:
        """Hold the next submitted chunk's copy until the returned gate is opened."""
        self._need_worker("hold_next")
        gate = Gate()
        self._hold_next.append(gate)
        return gate

    def _need_worker(self, what: str) -> None:
        if not self._threads:  # a copy made in submit cannot wait: submit would never return
            raise ConfigError(f"{what} needs a worker thread: this engine copies in submit")

    @property
    def inflight(self) -> int:
        """Chunks submitted whose acks were not yet returned by poll or drain."""
        return self._inflight

    def submit(
        self,
        ticket: Ticket | LoadTicket,
        device_pages: Sequence[int],
        host_pages: Sequence[int],
    ) -> CpuCopyEvent:
        """Validate the chunk, then queue its copy; returns the chunk's completion event. A
        :data:`~kvlife.Ticket` copies device -> host, a :class:`~kvlife.LoadTicket` host ->
        device. Refusals raise and change nothing."""
        load, dev, hst, d, h = self._checked(ticket, device_pages, host_pages)
        fault: BaseException | None = None
        origin = ""  # why a fault is made here: fail_next without an error of its own, or chance
        if self._fail_next:
            fault = self._fail_next.popleft()
            origin = "injected"
        elif self.fail_rate and self._rng.random() < self.fail_rate:
            origin = "random"
        if origin and fault is None:
            what = "load" if load else "chunk"
            fault = CopyFault(f"{origin} copy fault in {what} {ticket[1]} of {ticket[0]!r}")
        delay = self.copy_delay
        if self.delay_jitter:
            delay += self._rng.uniform(0.0, self.delay_jitter)
        if self._slow_next:
            delay += self._slow_next.popleft()
        gate = self._hold_next.popleft() if self._hold_next else None
        if gate is not None:
            self._held.append(gate)
        job = _Job(
            ticket, load, dev, hst, d, h, host_runs(h), delay, gate, fault, time.perf_counter()
        )
        self._claim(load, d, h)
        self._inflight += 1
        if self._threads:
            self._jobs.put(job)
        else:  # workers=0: copied here, acked by the next poll or drain
            self._copy(job)
        return job.event

    def poll(self) -> list[Ack]:
        """Acks completed since the last poll or drain, in completion order; never blocks."""
        acks, self._ready = self._ready, []
        done = self._done
        while not done.empty():  # this thread alone takes from it
            acks.append(self._settle(done.get_nowait()))
        self._inflight -= len(acks)
        return acks

    def drain(self, timeout: float | None = None) -> list[Ack]:
        """Block until every submitted chunk is acked; return the acks not yet returned. On
        :class:`DrainTimeout` the acks collected so far stay for the next poll or drain."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ready = self._ready
        while len(ready) < self._inflight:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                job = self._done.get(timeout=remaining)
            except queue.Empty:
                raise DrainTimeout(
                    f"{self._inflight - len(ready)} chunks still in flight after {timeout} s"
                ) from None
            ready.append(self._settle(job))
        self._ready = []
        self._inflight -= len(ready)
        return ready

    def close(self, timeout: float = 10.0) -> None:
        """Take no more chunks, open held gates, and let the workers finish queued copies.
        Copies still waiting out their delay run at once. The workers are waited for ``timeout``
        seconds at most (they are daemon threads)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        for gate in self._held:
            gate.open()
        self._held.clear()
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> CpuCopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _settle(self, job: _Job) -> Ack:
        self._unclaim(job.load, job.index, job.host_index)
        if job.error is not None and job.fault is None:
            self.copy_errors += 1
            self.last_copy_error = job.error
        if job.gate in self._held:
            self._held.remove(job.gate)
        return Ack(
            job.ticket,
            job.device_pages,
            job.host_pages,
            job.error,
            job.submitted_at,
            job.completed_at,
        )

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._copy(job)

    def _copy(self, job: _Job) -> None:
        """One chunk's copy (a worker's, or submit's with ``workers=0``), then its event."""
        try:
            if job.gate is not None:
                job.gate.wait()
            # The delay is latency from submit (as a stream's copies queue behind
            # earlier work), not time added per copy: copies do not serialise on it.
            wait = job.submitted_at + job.delay - time.perf_counter()
            if wait > 0:
                self._closing.wait(wait)
            job.event._started = True
            if job.fault is not None:
                job.error = job.fault
            else:
                copy = self.layout.scatter_runs if job.load else self.layout.gather_runs
                copy(torch.from_numpy(job.index), self.host.tensor, job.runs)  # a view
        except Exception as exc:  # a copy error is reported in the ack, never lost
            job.error = exc
        job.completed_at = time.perf_counter()
        self._done.put(job)  # before the event: a poll after synchronize() must see it
        job.event._set()
