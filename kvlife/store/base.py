"""The storage tier's protocol, its typed errors, the page format, and the one-writer-thread
base every store shares; the rules are in ``docs/store.md``.

Theory of operation: ``put(token, keys, pages)`` validates, draws any injected
fault and queues; one writer thread per store calls ``_store_pages`` (all or
nothing, rolled back on failure) and queues a :class:`StoreResult` carrying the
caller's ``token``, which the caller collects with ``poll``/``drain`` on its own
thread. The writer has finished reading the host pages before their result is
visible. Every page is stored as :func:`frame_page` frames it and served only if
:func:`unframe_page` finds it whole; a page failing the check is a counted miss
(``pages_corrupt``) that the next put of its key replaces. A key stored with
other bytes fails the put with :class:`~kvlife.errors.PageMismatch`.
"""

from __future__ import annotations

import abc
import queue
import random
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar, runtime_checkable

import torch
import xxhash

from kvlife.errors import (
    ConfigError,
    DrainTimeout,
    InvalidPut,
    PageMismatch,
    StoreClosed,
    StoreError,
)

__all__ = [
    "QueuedStore",
    "Store",
    "StoreResult",
    "StoreStats",
    "Written",
    "check_key",
    "frame_into",
    "frame_page",
    "frame_size",
    "unframe_page",
]


# ----------------------------------------------------------------------------- protocol


@dataclass(frozen=True, slots=True)
class StoreResult:
    """The outcome of one put: the caller's token, the put's keys, and the error if it failed."""

    #: Opaque object given at put (the manager: its Lifecycle and the host pages).
    token: object
    #: The put's keys, in page order.
    keys: tuple[str, ...]
    #: Why the put failed; ``None`` when every page is stored.
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        """True when every page of the put is stored."""
        return self.error is None


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters of one store since it was opened, for metrics."""

    puts_ok: int = 0
    puts_failed: int = 0
    pages_written: int = 0
    pages_deduplicated: int = 0
    page_mismatches: int = 0
    #: Payload bytes of the pages written (headers not counted).
    bytes_written: int = 0
    #: Reads (get, contains, or a put checking the key) that found a stored page
    #: failing verification; each was a miss, and a put replaced it.
    pages_corrupt: int = 0


@runtime_checkable
class Store(Protocol):
    """The storage tier: pages under content-hash keys, written asynchronously."""

    def put(self, token: object, keys: Sequence[str], pages: torch.Tensor) -> None:
        """Queue ``pages[i]`` under ``keys[i]``; the outcome arrives later as a StoreResult."""

    def poll(self) -> list[StoreResult]:
        """Results completed since the last poll or drain, in completion order; never blocks."""

    def drain(self, timeout: float | None = None) -> list[StoreResult]:
        """Wait until every put completed and return the results not yet reported."""

    def get(self, key: str) -> bytes | None:
        """The stored payload bytes of a page, or None when no whole page is stored under it."""

    def contains(self, key: str) -> bool:
        """Whether a whole, verified page is stored under ``key``."""

    def keys(self) -> Iterator[str]:
        """Every stored key (for verification; order unspecified)."""

    def close(self) -> None:
        """Finish queued puts and stop the writer; results stay available to poll."""

    @property
    def pending(self) -> int:
        """Puts accepted whose result was not yet returned by poll or drain."""


# ----------------------------------------------------------------------------- validation

_KEY = re.compile(r"[0-9a-f]{2,128}")


def check_key(key: object) -> str:
    """Return ``key`` if it is 2 to 128 lowercase hex digits, else raise InvalidPut."""
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise InvalidPut(
            f"store key {key!r} is not 2 to 128 lowercase hex digits (a content hash; never a path)"
        )
    return key


# ----------------------------------------------------------------------------- page format

#: First bytes of every stored page.
PAGE_MAGIC = b"KVLP"
#: Version of the page format; a page of another version is a miss.
PAGE_VERSION = 1
# magic, version, key length, payload length, XXH3-64 of the payload (little-endian, no
# padding); the key's ASCII digits follow, then the payload. Why XXH3 and not CRC32:
# docs/store-tier.md, "Throughput".
_HEADER = struct.Struct("<4sBBQQ")
_checksum = xxhash.xxh3_64_intdigest
_B = TypeVar("_B", bytes, memoryview)


def frame_page(key: str, payload: bytes | memoryview) -> bytes:
    """The header that precedes ``payload`` when it is stored under ``key``: a stored page
    is ``frame_page(key, payload) + payload`` (the fields: ``docs/store.md``)."""
    digits = key.encode("ascii")
    check = _checksum(payload)
    return _HEADER.pack(PAGE_MAGIC, PAGE_VERSION, len(digits), len(payload), check) + digits


def frame_size(key: str, payload_nbytes: int) -> int:
    """Bytes of the stored page of ``key`` with a payload of ``payload_nbytes`` bytes."""
    return _HEADER.size + len(key) + payload_nbytes


def frame_into(out: memoryview, key: str, payload: bytes | memoryview) -> int:
    """Write the stored page of ``key`` (``frame_page(key, payload) + payload``) at ``out[0:]``.

    One copy of the payload, none of it in intermediate bytes; returns the bytes written.
    """
    header = frame_page(key, payload)
    end = len(header) + len(payload)
    out[: len(header)] = header
    out[len(header) : end] = payload
    return end


def unframe_page(key: str, stored: _B) -> _B | None:
    """The payload of ``stored`` if it is a whole page of ``key`` (magic, version, key,
    length and checksum match), else None. A memoryview is checked in place and its
    payload is a view of it."""
    if len(stored) < _HEADER.size:
        return None
    magic, version, key_len, length, check = _HEADER.unpack_from(stored)
    start = _HEADER.size + key_len
    if (
        magic != PAGE_MAGIC
        or version != PAGE_VERSION
        or len(stored) != start + length
        or stored[_HEADER.size : start] != key.encode("ascii")
    ):
        return None
    payload = stored[start:]
    if _checksum(payload) != check:
        return None
    return payload


def fault_steps(fault_at: int | None, n_pages: int) -> Callable[[int, str], None]:
    """The ``step(i, what)`` a store's ``_store_pages`` calls before each internal step
    of a put: at step ``fault_at`` it raises the injected :class:`StoreError`."""

    def step(i: int, what: str) -> None:
        if fault_at == i:
            raise StoreError(f"injected failure {what} ({n_pages} pages)")

    return step


def check_held(key: str, held: bytes | memoryview | None, page: bytes | memoryview) -> bool:
    """Whether ``key`` already holds ``page`` (``held``: its verified stored payload, None if
    none); PageMismatch if it holds other bytes (the stored page is kept)."""
    if held is not None and held != page:
        raise PageMismatch(
            f"key {key} is stored with different bytes; the stored page is kept", key=key
        )
    return held is not None


def _check_put(keys: Sequence[str], pages: torch.Tensor) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise InvalidPut("keys must be a sequence of keys, not one string")
    checked = tuple(check_key(k) for k in keys)
    if not isinstance(pages, torch.Tensor):
        raise InvalidPut(f"pages must be a torch.Tensor, got {type(pages).__name__}")
    if pages.dim() != 2:
        raise InvalidPut(f"pages must be 2-D [n_pages, page_numel], got shape {tuple(pages.shape)}")
    if pages.device.type != "cpu" or pages.layout != torch.strided:
        raise InvalidPut(f"pages must be a dense host tensor, got {pages.device} {pages.layout}")
    if not checked:
        raise InvalidPut("a put needs at least one page")
    if pages.shape[0] != len(checked):
        raise InvalidPut(f"{len(checked)} keys for {pages.shape[0]} pages: one key per page")
    if pages.shape[1] == 0:
        raise InvalidPut("pages must not be empty (page_numel is 0)")
    if len(set(checked)) != len(checked):
        raise InvalidPut("a key appears twice in one put (a hash chain never repeats a key)")
    return checked


def _check_rate(rate: object) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise ConfigError(f"fail_rate must be in [0, 1], got {rate!r}")
    return float(rate)


def page_views(pages: torch.Tensor) -> list[memoryview]:
    """Zero-copy byte views of the rows of a host page tensor, one per page, read on the
    writer thread (each keeps the tensor's memory alive)."""
    block = pages.detach().contiguous()
    flat = block.view(torch.uint8).numpy().data.cast("B")
    row = block.shape[1] * block.element_size()
    return [flat[i * row : (i + 1) * row] for i in range(block.shape[0])]


# ----------------------------------------------------------------------------- the shared writer


@dataclass(frozen=True, slots=True)
class _Put:
    token: object
    keys: tuple[str, ...]
    pages: torch.Tensor
    fault_at: int | None


@dataclass(frozen=True, slots=True)
class Written:
    """What one successful put did, reported by a store's ``_store_pages``."""

    pages_written: int
    pages_deduplicated: int
    bytes_written: int

    @classmethod
    def of(cls, n_written: int, pages: Sequence[memoryview]) -> Written:
        """``n_written`` of the put's ``pages`` written; the rest were stored with their bytes."""
        return cls(n_written, len(pages) - n_written, n_written * len(pages[0]))


class QueuedStore(abc.ABC):
    """A store with one writer thread: validation, queue, results, fault injection, counters.

    Subclasses say how one put's pages are stored all-or-nothing
    (``_store_pages``) and how pages are read back.
    """

    def __init__(self, *, fail_rate: float = 0.0, seed: int = 0, name: str = "store") -> None:
        self._fail_rate = _check_rate(fail_rate)
        self._rng = random.Random(seed)
        self._fail_next = 0
        self._lock = threading.Lock()
        self._done_cv = threading.Condition(self._lock)
        self._done: list[StoreResult] = []
        self._unfinished = 0  # accepted puts the writer has not completed
        self._pending = 0  # accepted puts not yet returned by poll/drain
        self._stats = StoreStats()
        self._closed = False
        self._queue: queue.SimpleQueue[_Put | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._run, name=f"kvlife-{name}-writer", daemon=True)
        self._writer.start()

    # -- what a subclass provides

    @abc.abstractmethod
    def _fault_steps(self, n_pages: int) -> int:
        """How many internal steps one put of ``n_pages`` has (where a fault can strike)."""

    @abc.abstractmethod
    def _store_pages(
        self, keys: tuple[str, ...], pages: Sequence[memoryview], fault_at: int | None
    ) -> Written:
        """Store every page (``pages[i]``: the raw bytes of ``keys[i]``) or none; raise
        (after rolling back) on failure, and at step ``fault_at`` (if not None) raise a
        StoreError whose message says "injected" (:func:`fault_steps`)."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The stored payload bytes of a page, or None when no whole page is stored under it."""

    @abc.abstractmethod
    def keys(self) -> Iterator[str]:
        """Every stored key (for verification; order unspecified)."""

    # -- the protocol

    def contains(self, key: str) -> bool:
        """Whether a whole, verified page is stored under ``key`` (reads it)."""
        return self.get(key) is not None

    def put(self, token: object, keys: Sequence[str], pages: torch.Tensor) -> None:
        """Queue ``pages[i]`` under ``keys[i]``; keep the pages until this token's result."""
        checked = _check_put(keys, pages)
        with self._lock:
            if self._closed:
                raise StoreClosed("put on a closed store")
            fail = self._fail_next > 0
            if fail:
                self._fail_next -= 1
            elif self._fail_rate > 0.0:
                fail = self._rng.random() < self._fail_rate
            fault_at = self._rng.randrange(self._fault_steps(len(checked))) if fail else None
            self._unfinished += 1
            self._pending += 1
            self._queue.put(_Put(token, checked, pages, fault_at))

    def poll(self) -> list[StoreResult]:
        """Results completed since the last poll or drain, in completion order; never blocks."""
        with self._lock:
            return self._take()

    def drain(self, timeout: float | None = None) -> list[StoreResult]:
        """Wait until every accepted put completed; return the results not yet reported.

        Raises DrainTimeout (consuming nothing) if ``timeout`` seconds pass first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._unfinished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise DrainTimeout(
                        f"{self._unfinished} puts still being written after {timeout} s"
                    )
                self._done_cv.wait(left)
            return self._take()

    @property
    def fail_rate(self) -> float:
        """Probability that an accepted put fails (fault injection)."""
        return self._fail_rate

    @fail_rate.setter
    def fail_rate(self, rate: float) -> None:
        with self._lock:
            self._fail_rate = _check_rate(rate)

    def fail_next(self, n: int = 1) -> None:
        """Make the next ``n`` accepted puts fail (fault injection)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"fail_next needs a count >= 0, got {n!r}")
        with self._lock:
            self._fail_next += n

    def close(self) -> None:
        """Finish queued puts and stop the writer; results stay available to poll. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._writer.join()

    @property
    def pending(self) -> int:
        """Puts accepted whose result was not yet returned by poll or drain."""
        with self._lock:
            return self._pending

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._closed

    def stats(self) -> StoreStats:
        """A snapshot of this store's counters."""
        with self._lock:
            return self._stats

    def __enter__(self) -> QueuedStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals

    def _verify(self, key: str, stored: _B | None, *, count: bool = True) -> _B | None:
        """The payload of ``stored`` if it is a whole page of ``key``, else None; a stored
        page failing verification is counted in ``pages_corrupt`` (when ``count``)."""
        if stored is None:
            return None
        payload = unframe_page(key, stored)
        if payload is None and count:
            with self._lock:
                self._stats = replace(self._stats, pages_corrupt=self._stats.pages_corrupt + 1)
        return payload

    def _take(self) -> list[StoreResult]:
        taken, self._done = self._done, []
        self._pending -= len(taken)
        return taken

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            written: Written | None = None
            error: BaseException | None = None
            try:
                written = self._store_pages(job.keys, page_views(job.pages), job.fault_at)
            except BaseException as exc:  # reported on the result, never lost
                error = exc
            with self._lock:
                s = self._stats
                if written is not None:
                    self._stats = replace(
                        s,
                        puts_ok=s.puts_ok + 1,
                        pages_written=s.pages_written + written.pages_written,
                        pages_deduplicated=s.pages_deduplicated + written.pages_deduplicated,
                        bytes_written=s.bytes_written + written.bytes_written,
                    )
                else:
                    self._stats = replace(
                        s,
                        puts_failed=s.puts_failed + 1,
                        page_mismatches=s.page_mismatches + isinstance(error, PageMismatch),
                    )
                self._done.append(StoreResult(job.token, job.keys, error))
                self._unfinished -= 1
                self._done_cv.notify_all()
