"""The storage tier's protocol, its page format, and :class:`QueuedStore`, the
one-writer-thread base every store shares.

``put(token, keys, pages)`` validates and queues; the store's writer thread stores the
put all or nothing (``_store_pages``, rolled back on failure) and, once it has finished
reading the pages, queues a :class:`StoreResult` that the caller collects with
``poll``/``drain`` on its own thread. The page format, verification, first value wins
and what ``put`` refuses are in ``docs/store.md``.
"""

from __future__ import annotations

import abc
import itertools
import queue
import re
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar, runtime_checkable

import torch
import xxhash

from kvlife._checks import positive_int
from kvlife.errors import ConfigError, DrainTimeout, InvalidPut, PageMismatch, StoreClosed

__all__ = [
    "DEFAULT_MAX_PAGE_BYTES",
    "Payload",
    "QueuedStore",
    "Store",
    "StoreResult",
    "StoreStats",
    "Written",
    "check_frame_namespace",
    "check_key",
    "frame_into",
    "frame_page",
    "frame_size",
    "parse_header",
    "tensor_segments",
    "unframe_page",
]


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
    #: Reads that found a stored page failing verification, or something that is not a
    #: page (a FIFO, a symlink, an object larger than a page can be): each a miss.
    pages_corrupt: int = 0
    #: Reads the medium failed (an ``OSError``, a Mooncake code other than "not found").
    read_errors: int = 0
    #: Namespace pages removed by ``clear()``.
    pages_cleared: int = 0


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

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """:meth:`get` of each key, in order (one round trip where the tier has batches)."""

    def contains(self, key: str) -> bool:
        """Whether a whole, verified page is stored under ``key``."""

    def keys(self) -> Iterator[str]:
        """Every stored key (for verification; order unspecified)."""

    def close(self) -> None:
        """Finish queued puts and stop the writer; results stay available to poll."""

    @property
    def pending(self) -> int:
        """Puts accepted whose result was not yet returned by poll or drain."""


_KEY = re.compile(r"[0-9a-f]{2,128}")


def check_key(key: object) -> str:
    """Return ``key`` if it is 2 to 128 lowercase hex digits, else raise InvalidPut."""
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise InvalidPut(
            f"store key {key!r} is not 2 to 128 lowercase hex digits (a content hash; never a path)"
        )
    return key


def _check_keys(keys: Sequence[str], call: str) -> list[str]:
    """Every key of ``keys`` checked (:func:`check_key`); one string is refused."""
    if isinstance(keys, str):
        raise InvalidPut(f"{call} takes a sequence of keys, not one string")
    return [check_key(k) for k in keys]


# The fields, and why a page of another version (1 did not bind the namespace) is a miss:
# docs/store.md, "Page format and verification"; why XXH3: docs/store-tier.md, "Throughput".
PAGE_MAGIC = b"KVLP"
PAGE_VERSION = 2
_HEADER = struct.Struct("<4sBBHQQ")
#: The longest namespace a page header holds (its length field is 16 bits).
MAX_NAMESPACE_BYTES = 0xFFFF
_B = TypeVar("_B", bytes, memoryview)

#: The largest page payload a store takes, and believes when it reads, by default (a page
#: of 64 tokens of a 70B model's KV on one rank is about 21 MiB).
DEFAULT_MAX_PAGE_BYTES = 64 << 20

#: One page's payload as a store's writer sees it: the bytes in order, in one or more
#: contiguous pieces of the caller's memory (a row of a 2-D tensor is one piece; a page
#: of SGLang's host pool in a layer-first layout is one piece per layer and K/V).
Payload = tuple[memoryview, ...]


def _parts(payload: bytes | memoryview | Payload) -> tuple[bytes | memoryview, ...]:
    return payload if isinstance(payload, tuple) else (payload,)


def _checksum(payload: bytes | memoryview | Payload) -> int:
    parts = _parts(payload)
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


def payload_nbytes(payload: bytes | memoryview | Payload) -> int:
    """The number of bytes of a payload."""
    return sum(map(len, _parts(payload)))


def check_frame_namespace(namespace: object) -> str:
    """Return ``namespace`` if a page header can hold it (ASCII, at most
    :data:`MAX_NAMESPACE_BYTES`), else raise ConfigError."""
    if not isinstance(namespace, str) or not namespace.isascii():
        raise ConfigError(f"a page namespace must be an ASCII str, got {namespace!r:.60}")
    if len(namespace) > MAX_NAMESPACE_BYTES:
        raise ConfigError(
            f"a page namespace of {len(namespace)} characters is longer than a page header "
            f"holds ({MAX_NAMESPACE_BYTES})"
        )
    return namespace


def frame_page(key: str, payload: bytes | memoryview | Payload, namespace: str = "") -> bytes:
    """The header that precedes ``payload`` when it is stored under ``key`` in
    ``namespace``: a stored page is ``frame_page(key, payload, namespace) + payload`` (the
    fields: ``docs/store.md``). It binds the key and the namespace: a page is served only
    under both."""
    digits = key.encode("ascii")
    name = namespace.encode("ascii")
    check = _checksum(payload)
    size = payload_nbytes(payload)
    head = _HEADER.pack(PAGE_MAGIC, PAGE_VERSION, len(digits), len(name), size, check)
    return head + digits + name


def header_size(key: str, namespace: str = "") -> int:
    """Bytes of the header (with the key and the namespace) before the payload of ``key``."""
    return _HEADER.size + len(key) + len(namespace)


def parse_header(key: str, head: bytes | memoryview, namespace: str = "") -> tuple[int, int] | None:
    """(payload length, checksum) if ``head`` begins with a header of a page of ``key`` in
    ``namespace`` (magic, version, key and namespace match), else None. Nothing after the
    header is looked at; a page of another format version is None, never misread."""
    if len(head) < _HEADER.size:
        return None
    magic, version, key_len, name_len, length, check = _HEADER.unpack_from(head)
    if magic != PAGE_MAGIC or version != PAGE_VERSION:
        return None
    end = _HEADER.size + key_len + name_len
    if (
        key_len != len(key)
        or name_len != len(namespace)
        or len(head) < end
        or bytes(head[_HEADER.size : end]) != (key + namespace).encode("ascii")
    ):
        return None
    return int(length), int(check)


def frame_size(key: str, payload_nbytes: int, namespace: str = "") -> int:
    """Bytes of the stored page of ``key`` in ``namespace`` with ``payload_nbytes`` of payload."""
    return header_size(key, namespace) + payload_nbytes


def frame_into(
    out: memoryview, key: str, payload: bytes | memoryview | Payload, namespace: str = ""
) -> int:
    """Write the stored page of ``key`` in ``namespace`` (``frame_page(key, payload,
    namespace) + payload``) at ``out[0:]``.

    One copy of the payload, none of it in intermediate bytes; returns the bytes written.
    """
    header = frame_page(key, payload, namespace)
    at = len(header)
    out[:at] = header
    for part in _parts(payload):
        out[at : at + len(part)] = part
        at += len(part)
    return at


def unframe_page(key: str, stored: _B, namespace: str = "") -> _B | None:
    """The payload of ``stored`` if it is a whole page of ``key`` in ``namespace`` (magic,
    version, key, namespace, length and checksum match), else None. A memoryview is
    checked in place and its payload is a view of it."""
    fields = parse_header(key, stored, namespace)
    start = header_size(key, namespace)
    if fields is None or len(stored) != start + fields[0]:
        return None
    payload = stored[start:]
    if _checksum(payload) != fields[1]:
        return None
    return payload


def check_held(
    key: str, held: bytes | memoryview | None, page: Payload, kept: list[str] | None
) -> bool:
    """Whether ``key`` already holds a whole page, so ``page`` need not be written
    (``held``: its verified stored payload, None if none). If it holds other bytes, the
    stored page is kept: PageMismatch, or, when ``kept`` is given (a put that keeps first
    values), ``key`` is appended to ``kept`` for the mismatch counter and True returned."""
    # Compared as bytes: memcmp (comparing memoryviews goes item by item).
    if held is not None and (len(held) != payload_nbytes(page) or bytes(held) != b"".join(page)):
        if kept is None:
            raise PageMismatch(
                f"key {key} is stored with different bytes; the stored page is kept", key=key
            )
        kept.append(key)
    return held is not None


def _check_put(
    keys: Sequence[str], pages: torch.Tensor | Sequence[torch.Tensor], max_page_bytes: int
) -> tuple[str, ...]:
    checked = tuple(_check_keys(keys, "put"))
    if isinstance(pages, torch.Tensor):
        if pages.dim() != 2:
            raise InvalidPut(
                f"pages must be 2-D [n_pages, page_numel], got shape {tuple(pages.shape)}"
            )
        _check_host(pages)
        n_pages, sizes = pages.shape[0], [pages.shape[1] * pages.element_size()]
    elif isinstance(pages, (list, tuple)):
        for one in pages:
            if not isinstance(one, torch.Tensor):
                raise InvalidPut(f"each page must be a torch.Tensor, got {type(one).__name__}")
            _check_host(one)
        n_pages, sizes = len(pages), [p.numel() * p.element_size() for p in pages]
    else:
        raise InvalidPut(
            f"pages must be a torch.Tensor or a list of them, got {type(pages).__name__}"
        )
    if not checked:
        raise InvalidPut("a put needs at least one page")
    if n_pages != len(checked):
        raise InvalidPut(f"{len(checked)} keys for {n_pages} pages: one key per page")
    if min(sizes) == 0:
        raise InvalidPut("pages must not be empty (page_numel is 0)")
    if max(sizes) > max_page_bytes:
        raise InvalidPut(
            f"a page of {max(sizes)} bytes is larger than this store's pages can be "
            f"(max_page_bytes={max_page_bytes})"
        )
    if len(set(checked)) != len(checked):
        raise InvalidPut("a key appears twice in one put (a hash chain never repeats a key)")
    return checked


def _check_host(pages: torch.Tensor) -> None:
    if pages.device.type != "cpu" or pages.layout != torch.strided:
        raise InvalidPut(f"pages must be a dense host tensor, got {pages.device} {pages.layout}")
    if pages.is_conj() or pages.is_neg() or pages.is_quantized:  # bytes not what it shows
        raise InvalidPut("pages must hold their own bytes (resolve_conj()/resolve_neg() first)")


def tensor_segments(tensor: torch.Tensor, *, writable: bool = False) -> Payload:
    """Zero-copy byte views of a host tensor's memory, in the tensor's element order: one
    view if it is contiguous, else one per contiguous run (a strided page view of a host
    pool: one per layer and K/V, say). The views are writable where the tensor is, and
    keep its memory alive. A tensor whose last dimension is not dense is copied first,
    unless the views are to be ``writable`` (a read's destination): then InvalidPut."""
    t = tensor.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    try:
        array = t.view(torch.uint8).numpy() if t.element_size() != 1 else t.numpy()
    except (RuntimeError, TypeError) as exc:  # a last dimension with a stride
        if writable:
            raise InvalidPut(
                f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} cannot be "
                "read into in place"
            ) from exc
        array = t.contiguous().view(torch.uint8).numpy()
    if array.flags.c_contiguous:
        return (array.data.cast("B"),)
    # The innermost dimensions that are dense together form one run.
    split, run = array.ndim, 1
    while split > 0 and (array.shape[split - 1] == 1 or array.strides[split - 1] == run):
        run *= array.shape[split - 1]
        split -= 1
    outer = array.reshape((*array.shape[:split], -1)) if split < array.ndim else array
    return tuple(
        outer[idx].data.cast("B")
        for idx in itertools.product(*(range(n) for n in array.shape[:split]))
    )


def page_views(pages: torch.Tensor | Sequence[torch.Tensor]) -> list[Payload]:
    """Zero-copy byte views of each page of a put, read on the writer thread: the rows of
    a 2-D host tensor, or each tensor of a list (:func:`tensor_segments`)."""
    if not isinstance(pages, torch.Tensor):
        return [tensor_segments(p) for p in pages]
    block = pages.detach().contiguous()
    flat = block.view(torch.uint8).numpy().data.cast("B")
    row = block.shape[1] * block.element_size()
    return [(flat[i * row : (i + 1) * row],) for i in range(block.shape[0])]


def _pieces(out: memoryview | Sequence[memoryview]) -> Payload:
    return (out,) if isinstance(out, memoryview) else tuple(out)


def _copy_into(data: bytes | memoryview, out: Payload) -> bool:
    """Copy ``data`` into the pieces of ``out`` if it has exactly their size."""
    if len(data) != payload_nbytes(out):
        return False
    view, at = memoryview(data), 0
    for part in out:
        part[:] = view[at : at + len(part)]
        at += len(part)
    return True


@dataclass(frozen=True, slots=True)
class _Put:
    token: object
    keys: tuple[str, ...]
    pages: torch.Tensor | Sequence[torch.Tensor]
    keep_first: bool


@dataclass(slots=True)
class _Clear:
    """A clear() for the writer thread, done between two puts."""

    done: threading.Event = field(default_factory=threading.Event)
    removed: int = 0
    error: BaseException | None = None


#: What ``_store_pages`` returns: the payloads of the put it wrote (the others were stored
#: already with these bytes, or, in ``kept``, with other bytes that stay).
Written = list[Payload]


class QueuedStore(abc.ABC):
    """A store with one writer thread: validation, queue, results, counters.

    Subclasses say how one put's pages are stored all-or-nothing
    (``_store_pages``) and how pages are read back. A subclass whose ``_inline`` is
    True has no thread: each put is written at once, on the caller's thread.
    """

    _inline = False

    def __init__(
        self,
        *,
        name: str = "store",
        max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
        namespace: str = "",
    ) -> None:
        self._namespace = check_frame_namespace(namespace)
        self._max_page = positive_int("max_page_bytes", max_page_bytes)
        self._lock = threading.Lock()
        self._done_cv = threading.Condition(self._lock)
        self._done: list[StoreResult] = []
        self._unfinished = 0  # accepted puts the writer has not completed
        self._pending = 0  # accepted puts not yet returned by poll/drain
        self._stats = StoreStats()
        self._closed = False
        self._queue: queue.SimpleQueue[_Put | _Clear | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        if not self._inline:
            self._writer = threading.Thread(
                target=self._run, name=f"kvlife-{name}-writer", daemon=True
            )
            self._writer.start()

    # -- what a subclass provides

    @abc.abstractmethod
    def _store_pages(
        self, keys: tuple[str, ...], pages: Sequence[Payload], kept: list[str] | None = None
    ) -> Written:
        """Store every page (``pages[i]``: the raw bytes of ``keys[i]``) or none and return
        those written; raise (after rolling back) on failure, and call :meth:`_step`
        before each internal step. A key holding other bytes fails the put, or, when
        ``kept`` is a list, is appended to it and kept as stored (:func:`check_held`)."""

    def _step(self, i: int, what: str) -> None:  # noqa: B027 (a hook, a no-op here)
        """Called by ``_store_pages`` before internal step ``i`` of a put (``what``: "before
        writing page 0", say); a no-op. The point where :mod:`kvlife.testing.faults`
        fails a put part way, so that every rollback path is tested."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The stored payload bytes of a page, or None when no whole page is stored under it."""

    @abc.abstractmethod
    def keys(self) -> Iterator[str]:
        """Every stored key (for verification; order unspecified)."""

    @abc.abstractmethod
    def _clear(self) -> int:
        """Remove every page of this store's namespace; the number removed."""

    @property
    def namespace(self) -> str:
        """The namespace this store's pages are in (every page header binds it)."""
        return self._namespace

    @property
    def max_page_bytes(self) -> int:
        """The largest page payload this store takes, and believes when it reads."""
        return self._max_page

    def contains(self, key: str) -> bool:
        """Whether a whole, verified page is stored under ``key`` (reads it)."""
        return self.get(key) is not None

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """``get`` of every key, in order."""
        return [self.get(k) for k in _check_keys(keys, "get_batch")]

    def get_into(self, key: str, out: memoryview | Sequence[memoryview]) -> bool:
        """Fill ``out`` (one buffer, or pieces filled in order) with the payload of ``key``
        if a whole, verified page of exactly that many bytes is stored; False if not (a
        miss; the contents of ``out`` are then unspecified)."""
        return self.get_batch_into([key], [out])[0]

    def get_batch_into(
        self, keys: Sequence[str], outs: Sequence[memoryview | Sequence[memoryview]]
    ) -> list[bool]:
        """``get_into`` of every key into its own ``outs[i]``."""
        found = self.get_batch(keys)
        return [
            data is not None and _copy_into(data, _pieces(out))
            for data, out in zip(found, outs, strict=True)
        ]

    def clear(self) -> int:
        """Remove every page of this store's namespace (not other namespaces'), after the
        puts accepted before the call: the number removed (``stats().pages_cleared``).
        Raises what the medium raised (``OSError``, ``StoreError``) if it could not."""
        job = _Clear()
        self._accept(job, "clear")
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.removed

    def put(
        self,
        token: object,
        keys: Sequence[str],
        pages: torch.Tensor | Sequence[torch.Tensor],
        *,
        keep_first: bool = False,
    ) -> None:
        """Queue ``pages[i]`` under ``keys[i]``; keep the pages until this token's result.

        ``pages``: a 2-D host tensor (one row a page) or a list of host tensors (one a
        page, any shape and strides, sizes may differ; written from their own memory).
        ``keep_first``: a key already holding a whole page of other bytes keeps it and
        the put goes on (counted in ``page_mismatches``) instead of failing.
        """
        checked = _check_put(keys, pages, self._max_page)
        self._accept(_Put(token, checked, pages, bool(keep_first)), "put")

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

    def close(self) -> None:
        """Finish queued puts and stop the writer; results stay available to poll. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        if self._writer is not None:
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

    def _verify(self, key: str, stored: _B | None) -> _B | None:
        """The payload of ``stored`` if it is a whole page of ``key`` in this store's
        namespace, else None; a stored page failing verification (another namespace's
        page among them) is counted in ``pages_corrupt``."""
        if stored is None:
            return None
        payload = unframe_page(key, stored, self._namespace)
        if payload is None:
            self._count(pages_corrupt=1)
        return payload

    def _count(self, **added: int) -> None:
        """Add to counters of :class:`StoreStats` (``self._count(read_errors=1)``)."""
        with self._lock:
            self._add(added)

    def _add(self, added: dict[str, int]) -> None:  # the lock held
        s = self._stats
        self._stats = replace(s, **{name: getattr(s, name) + n for name, n in added.items()})

    def _take(self) -> list[StoreResult]:
        taken, self._done = self._done, []
        self._pending -= len(taken)
        return taken

    def _accept(self, job: _Put | _Clear, call: str) -> None:
        """Queue ``job`` for the writer thread (inline: do it now), unless closed."""
        with self._lock:
            if self._closed:
                raise StoreClosed(f"{call} on a closed store")
            if isinstance(job, _Put):
                self._unfinished += 1
                self._pending += 1
            if self._writer is not None:
                self._queue.put(job)
                return
        self._do(job)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            self._do(job)

    def _do(self, job: _Put | _Clear) -> None:
        if isinstance(job, _Clear):
            try:
                job.removed = self._clear()
                self._count(pages_cleared=job.removed)
            except BaseException as exc:  # raised by clear() on the caller's thread
                job.error = exc
            job.done.set()
            return
        error: BaseException | None = None
        kept: list[str] = []
        try:
            views = page_views(job.pages)
            written = self._store_pages(job.keys, views, kept if job.keep_first else None)
            added = {
                "puts_ok": 1,
                "pages_written": len(written),
                "pages_deduplicated": len(views) - len(written) - len(kept),
                "bytes_written": sum(map(payload_nbytes, written)),
                "page_mismatches": len(kept),
            }
        except BaseException as exc:  # reported on the result, never lost
            error = exc
            added = {"puts_failed": 1, "page_mismatches": isinstance(exc, PageMismatch)}
        with self._lock:
            self._add(added)
            self._done.append(StoreResult(job.token, job.keys, error))
            self._unfinished -= 1
            self._done_cv.notify_all()
        if self._writer is None and error is not None and not isinstance(error, Exception):
            raise error  # inline: a KeyboardInterrupt is the caller's, after its result
