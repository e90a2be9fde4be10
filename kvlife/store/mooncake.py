"""MooncakeStore: pages in a Mooncake Store cluster, behind the same writer thread as files.

Mooncake Store (``MooncakeDistributedStore``) is a distributed key-value store:
a master keeps the key -> replica map, memory-pool processes
(``mooncake_client``) hold the bytes, and any process with a client can put and
get. kvlife uses it as a store tier that several processes (ranks, instances,
an SGLang fleet) share. Install the extra: ``pip install 'kvlife[mooncake]'``.

Topology
========

The store's own client contributes **no** memory (``global_segment_size`` 0):
pages live in the pool processes, so they outlive the writer. (A writer that
holds pages itself loses them when it exits.) Per-call transfers use two
buffers this store registers with the client: one the writer thread stages puts
in, one reads land in.

Keys and page format
====================

A page of kvlife key ``k`` in namespace ``ns`` is the Mooncake object
``kvlife/<ns>/<k>``; namespaces follow the directory store's rules
(``check_namespace``). The object is the page in the shared format of
:func:`~kvlife.store.base.frame_page` (key, length, checksum), checked on every
read: a truncated, corrupted or misfiled object is a miss, counted in
``stats().pages_corrupt``, and the next put of the key replaces it.

Mooncake's semantics, and what this store makes of them
=======================================================

- ``get`` answers ``b''`` both for a missing key and for any failure. This
  store reads with ``get_into``/``batch_get_into``, which answer a negative
  error code: -704 (not found, including an evicted page) is a miss (``None``);
  any other code raises :class:`~kvlife.errors.StoreError` with ``code`` and
  ``call`` (:class:`~kvlife.errors.StoreUnavailable` for the codes that mean the
  master or pool cannot be reached).
- Putting an existing key answers 0 and keeps the first value. So a put first
  asks which keys exist (``batch_is_exist``), reads those and compares: the
  same bytes are deduplicated, other bytes fail the put whole with
  :class:`~kvlife.errors.PageMismatch` (nothing written), a page failing
  verification is removed (``force``) and written again. Two writers putting
  *different* bytes under one key in the same instant both succeed, and the
  first value stays; readers still only ever get whole, verified pages.
- Reads take a lease (a plain ``remove`` answers -706 for a while after a
  read); the rollback removes with ``force=True``.
- A full pool evicts old objects: an evicted page is a miss, never an error.
- ``keys()`` cannot list a cluster; it yields the keys this store object put
  or found stored by its own puts (what the simulator verifies).

Failures
========

A put is all-or-nothing as far as the cluster lets it: when the batch put
fails for any key, the writer removes every page this put created before it
reports the error. (If the master is gone the removal fails too; such pages are
whole and correct, as keys are content hashes.) Calls that fail with a code
meaning the master or the pool is unreachable raise
:class:`~kvlife.errors.StoreUnavailable` and open a *breaker*: for ``retry_after``
seconds every put fails at once with :class:`~kvlife.errors.StoreUnavailable`
(the same ``code`` and ``call``) without calling the cluster, then the next put
tries again. So with the master killed each put's result arrives within one
failing call (about 4.5 s, Mooncake's own RPC timeout) and then at once; with
the pool killed, within about a second. After a restart the next try succeeds
and the store is used again (a restarted master starts empty).

``setup`` retries for about 90 s when no master answers; this module sets
``MC_STORE_CLIENT_SETUP_RETRIES`` (unless the environment already does) so the
constructor fails with :class:`~kvlife.errors.StoreUnavailable` in a few seconds.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvlife.errors import (
    ConfigError,
    MissingDependency,
    PageMismatch,
    StoreError,
    StoreUnavailable,
)
from kvlife.store.base import (
    QueuedStore,
    Written,
    check_key,
    fault_steps,
    frame_into,
    frame_size,
    unframe_page,
)
from kvlife.store.directory import check_namespace

__all__ = [
    "MooncakeStore",
    "load_client_class",
]

#: Mooncake's error codes this store tells apart (``mooncake-store`` ``types.h``).
NO_AVAILABLE_HANDLE = -200  # no pool memory (or no pool)
INVALID_PARAMS = -600  # e.g. a read buffer smaller than the object
OBJECT_NOT_FOUND = -704  # missing or evicted: a miss
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800  # the pool holding the bytes cannot be reached
RPC_FAIL = -900  # the master cannot be reached
RPC_TIMEOUT = -901

#: Codes that mean "the cluster cannot serve now" (they open the breaker).
UNAVAILABLE_CODES = frozenset({-1, NO_AVAILABLE_HANDLE, TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT})

_CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}

#: The package that ships ``mooncake.store`` (kvlife's ``mooncake`` extra).
PACKAGE = "mooncake-transfer-engine-non-cuda"

#: Environment variables read by :meth:`MooncakeStore.from_env` (SGLang's names).
ENV_MASTER = "MOONCAKE_MASTER"
ENV_METADATA = "MOONCAKE_TE_META_DATA_SERVER"
ENV_PROTOCOL = "MOONCAKE_PROTOCOL"
ENV_LOCAL_HOSTNAME = "MOONCAKE_LOCAL_HOSTNAME"


def code_name(code: int) -> str:
    """Mooncake's name of an error code (``"OBJECT_NOT_FOUND"``), or the number."""
    return _CODE_NAMES.get(code, str(code))


def _error(call: str, code: int, what: str) -> StoreError:
    kind = StoreUnavailable if code in UNAVAILABLE_CODES else StoreError
    return kind(
        f"mooncake {call} failed for {what}: {code_name(code)} ({code})", code=code, call=call
    )


def load_client_class() -> Any:
    """``mooncake.store.MooncakeDistributedStore``; MissingDependency says what to install."""
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise MissingDependency(
            f"MooncakeStore needs {PACKAGE}: pip install 'kvlife[mooncake]' "
            f"(and apt-get install libibverbs1, needed even over TCP): {exc}"
        ) from exc
    return module.MooncakeDistributedStore


class _Buffer:
    """A registered, growable byte buffer (numpy memory the client may transfer to or from)."""

    def __init__(self, client: Any, what: str) -> None:
        self._client = client
        self._what = what
        self.array = np.empty(0, dtype=np.uint8)
        self.ptr = 0

    def ensure(self, nbytes: int) -> None:
        if nbytes <= self.array.nbytes:
            return
        size = max(nbytes, 2 * self.array.nbytes, 1 << 20)
        array = np.empty(size, dtype=np.uint8)
        ptr = int(array.ctypes.data)
        code = self._client.register_buffer(ptr, size)
        if code != 0:  # the metadata server (the master's) cannot take the registration
            raise StoreUnavailable(
                f"mooncake register_buffer failed for the {self._what} buffer ({size} bytes): "
                f"{code_name(code)} ({code})",
                code=int(code),
                call="register_buffer",
            )
        self.release()
        self.array, self.ptr = array, ptr

    def release(self) -> None:
        if self.ptr:
            self._client.unregister_buffer(self.ptr)
            self.ptr = 0
            self.array = np.empty(0, dtype=np.uint8)


class MooncakeStore(QueuedStore):
    """Pages in a Mooncake Store cluster, written by a writer thread, verified on every read."""

    def __init__(
        self,
        master: str,
        metadata: str,
        namespace: str = "default",
        *,
        local_hostname: str | None = None,
        protocol: str = "tcp",
        rdma_devices: str = "",
        local_buffer_size: int = 64 << 20,
        max_batch_bytes: int = 64 << 20,
        retry_after: float = 1.0,
        full_wait: float = 2.0,
        setup_retries: int = 1,
        fail_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        check_namespace(namespace)
        if not isinstance(master, str) or not master or not isinstance(metadata, str):
            raise ConfigError(
                f"master must be HOST:PORT and metadata a URL, got {master!r}, {metadata!r}"
            )
        if (
            not retry_after >= 0
            or not full_wait >= 0
            or max_batch_bytes <= 0
            or local_buffer_size <= 0
        ):
            raise ConfigError(
                "retry_after must be >= 0 and the buffer sizes positive, got "
                f"{retry_after!r}, {max_batch_bytes!r}, {local_buffer_size!r}"
            )
        client_class = load_client_class()
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(setup_retries))
        hostname = local_hostname or os.environ.get("MC_TCP_BIND_ADDRESS") or "127.0.0.1"
        client = client_class()
        code = client.setup(
            hostname, metadata, 0, local_buffer_size, protocol, rdma_devices, master
        )
        if code != 0:
            raise StoreUnavailable(
                f"cannot set up a Mooncake client for master {master} and metadata {metadata} "
                f"(setup answered {code}): is the master running?",
                code=int(code),
                call="setup",
            )
        self._client = client
        self._master = master
        self._metadata = metadata
        self._namespace = namespace
        self._prefix = f"kvlife/{namespace}/"
        self._retry_after = float(retry_after)
        self._max_batch = int(max_batch_bytes)
        self._full_wait = float(full_wait)
        self._down_until = 0.0  # breaker: puts fail at once until then (monotonic seconds)
        self._down_error: StoreUnavailable | None = None
        self._put_buffer = _Buffer(client, "put staging")
        self._read_buffer = _Buffer(client, "read")
        self._read_lock = threading.Lock()
        try:  # registered now, so that reads and puts of ordinary pages never register
            self._put_buffer.ensure(4 << 20)
            self._read_buffer.ensure(4 << 20)
        except BaseException:
            self._put_buffer.release()
            client.close()
            raise
        self._slot = 0  # the largest stored page seen, in bytes (a read's first guess)
        self._known: set[str] = set()  # keys this store put or found stored by its puts
        self._known_lock = threading.Lock()
        self._client_closed = False
        super().__init__(fail_rate=fail_rate, seed=seed, name="mooncake-store")

    @classmethod
    def from_env(cls, namespace: str = "default", **kwargs: Any) -> MooncakeStore:
        """A store on the cluster named by ``MOONCAKE_MASTER`` and ``MOONCAKE_TE_META_DATA_SERVER``.

        ``MOONCAKE_PROTOCOL`` (default tcp) and ``MOONCAKE_LOCAL_HOSTNAME`` are read too.
        """
        master = os.environ.get(ENV_MASTER)
        metadata = os.environ.get(ENV_METADATA)
        if not master or not metadata:
            raise ConfigError(
                f"set {ENV_MASTER} (HOST:PORT) and {ENV_METADATA} (a metadata URL) "
                "to name the Mooncake cluster"
            )
        kwargs.setdefault("protocol", os.environ.get(ENV_PROTOCOL, "tcp"))
        kwargs.setdefault("local_hostname", os.environ.get(ENV_LOCAL_HOSTNAME))
        return cls(master, metadata, namespace, **kwargs)

    # -- identity

    @property
    def namespace(self) -> str:
        """This store's namespace (the object key prefix ``kvlife/<namespace>/``)."""
        return self._namespace

    @property
    def master(self) -> str:
        """The master's HOST:PORT."""
        return self._master

    @property
    def client(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (for measurements; do not close it)."""
        return self._client

    def object_key(self, key: str) -> str:
        """The Mooncake object key of kvlife key ``key``."""
        return self._prefix + check_key(key)

    # -- reads (any thread; they block for the call)

    def get(self, key: str) -> bytes | None:
        """The stored payload of ``key``, or None on a miss (absent, evicted, failing checks).

        Raises StoreError (StoreUnavailable) when the cluster fails to answer.
        """
        return self.get_batch([key])[0]

    def contains(self, key: str) -> bool:
        """Whether a whole, verified page is stored under ``key`` (reads it)."""
        return self.get(key) is not None

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """``get`` of every key in one batched read; raises on the first key that fails."""
        if isinstance(keys, str):
            raise TypeError("get_batch takes a sequence of keys, not one string")
        names = [self.object_key(k) for k in keys]
        out: list[bytes | None] = [None] * len(names)

        def use(i: int, data: memoryview | None) -> None:
            # Verified in the read buffer: one copy, of the payload only.
            if data is not None:
                payload = unframe_page(keys[i], data)
                if payload is None:
                    self._count_corrupt()
                else:
                    out[i] = payload.tobytes()

        if names:
            with self._read_lock:
                self._read_each(names, self._read_buffer, "get", use)
        return out

    def keys(self) -> Iterator[str]:
        """The keys this store put or found stored with its bytes (a cluster is not listed)."""
        with self._known_lock:
            return iter(sorted(self._known))

    def _read_each(
        self,
        names: list[str],
        buffer: _Buffer,
        call: str,
        use: Callable[[int, memoryview | None], None],
    ) -> None:
        """``use(i, object)`` for each of ``names`` in order (None where absent); raises on failure.

        One ``batch_get_into`` into ``buffer``; an object is a view of
        ``buffer``, valid until its next use (nothing is copied here).
        """
        slot = max(self._slot, 4096)
        n = len(names)
        buffer.ensure(slot * n)
        base, view = buffer.ptr, buffer.array.data
        codes = self._client.batch_get_into(names, [base + i * slot for i in range(n)], [slot] * n)
        for i, code in enumerate(codes):
            if code >= 0:
                use(i, view[i * slot : i * slot + code])
            elif code == OBJECT_NOT_FOUND:
                use(i, None)
            elif code == INVALID_PARAMS:  # bigger than the slot: ask its size, read it alone
                data = self._read_one(names[i], call)
                use(i, None if data is None else memoryview(data))
            else:
                raise _error(f"batch_get_into ({call})", int(code), names[i])

    def _read_one(self, name: str, call: str) -> bytes | None:
        size = self._client.get_size(name)
        if size == OBJECT_NOT_FOUND:
            return None
        if size < 0:
            raise _error(f"get_size ({call})", int(size), name)
        self._slot = max(self._slot, size)
        one = _Buffer(self._client, "large read")
        try:
            one.ensure(size)
            code = self._client.get_into(name, one.ptr, size)
            if code == OBJECT_NOT_FOUND:
                return None
            if code < 0:
                raise _error(f"get_into ({call})", int(code), name)
            return one.array[:code].tobytes()
        finally:
            one.release()

    # -- writes (writer thread)

    def _fault_steps(self, n_pages: int) -> int:
        # Before looking for stored pages, before writing, after writing (rolled back).
        return 3

    def _store_pages(
        self, keys: tuple[str, ...], pages: Sequence[memoryview], fault_at: int | None
    ) -> Written:
        n = len(keys)

        step = fault_steps(fault_at, n)

        now = time.monotonic()
        if now < self._down_until and self._down_error is not None:
            raise StoreUnavailable(
                f"{self._down_error} (not retried for {self._down_until - now:.1f} s more)",
                code=self._down_error.code,
                call=self._down_error.call,
            )
        try:
            return self._write(keys, pages, step)
        except StoreUnavailable as exc:
            self._down_error = exc
            self._down_until = time.monotonic() + self._retry_after
            raise

    def _write(self, keys: tuple[str, ...], pages: Sequence[memoryview], step: Any) -> Written:
        names = [self._prefix + k for k in keys]
        step(0, "before looking for stored pages")
        found = self._client.batch_is_exist(names)
        for name, code in zip(names, found, strict=True):
            if code < 0:
                raise _error("batch_is_exist", int(code), name)
        to_write = [i for i, code in enumerate(found) if code == 0]
        existing = [i for i, code in enumerate(found) if code == 1]
        if existing:
            bad: list[int] = []

            def check(j: int, data: memoryview | None) -> None:
                i = existing[j]
                payload = None if data is None else unframe_page(keys[i], data)
                if payload is None:
                    if data is not None:  # a stored object failing verification
                        self._count_corrupt()
                        bad.append(i)
                    to_write.append(i)  # (or evicted since it was found)
                elif payload.tobytes() != pages[i].tobytes():  # memcmp, not per item
                    raise PageMismatch(
                        f"key {keys[i]} is stored with different bytes; the stored page is kept",
                        key=keys[i],
                    )

            held = [names[i] for i in existing]
            self._read_each(held, self._put_buffer, "put", check)
            if bad:
                codes = self._client.batch_remove([names[i] for i in bad], True)
                for i, code in zip(bad, codes, strict=True):
                    if code not in (0, OBJECT_NOT_FOUND):
                        raise _error("batch_remove (a page failing verification)", code, names[i])
        to_write.sort()
        step(1, "before writing")
        created: list[str] = []
        try:
            self._put(names, keys, pages, to_write, created)
            step(2, "after writing")
        except BaseException:
            if created:
                self._client.batch_remove(created, True)  # best effort: the cluster may be gone
            raise
        longest = max(frame_size(k, len(pages[0])) for k in keys)
        self._slot = max(self._slot, longest)
        with self._known_lock:
            self._known.update(keys)
        written = len(to_write)
        return Written(written, len(keys) - written, written * len(pages[0]))

    def _put(
        self,
        names: list[str],
        keys: tuple[str, ...],
        pages: Sequence[memoryview],
        indices: list[int],
        created: list[str],
    ) -> None:
        """Frame pages ``indices`` into the staging buffer and put them, batch by batch.

        Each page is framed in place (header, then one copy of the page, its
        checksum taken from the caller's memory): no intermediate bytes.
        """
        if not indices:
            return
        frame = max(frame_size(keys[i], len(pages[0])) for i in indices)
        per_batch = max(1, self._max_batch // frame)
        buffer = self._put_buffer
        buffer.ensure(frame * min(per_batch, len(indices)))
        base, view = buffer.ptr, buffer.array.data
        for start in range(0, len(indices), per_batch):
            batch = indices[start : start + per_batch]
            ptrs, sizes = [], []
            offset = 0
            for i in batch:
                end = offset + frame_into(view[offset:], keys[i], pages[i])
                ptrs.append(base + offset)
                sizes.append(end - offset)
                offset = end
            self._put_batch([names[i] for i in batch], ptrs, sizes, created)

    def _put_batch(
        self, names: list[str], ptrs: list[int], sizes: list[int], created: list[str]
    ) -> None:
        """Put one staged batch; keys refused for want of pool memory are retried a while.

        A full pool evicts in the background, so a burst of puts can find no
        memory (NO_AVAILABLE_HANDLE) for a moment; so can a cluster whose pool
        is gone, for good. ``full_wait`` seconds tell the two apart.
        """
        deadline = time.monotonic() + self._full_wait
        pause = 0.01
        while True:
            codes = self._client.batch_put_from(names, ptrs, sizes)
            retry = []
            for j, (name, code) in enumerate(zip(names, codes, strict=True)):
                if code == 0:
                    created.append(name)
                elif code == NO_AVAILABLE_HANDLE and time.monotonic() < deadline:
                    retry.append(j)
                else:
                    raise _error("batch_put_from", int(code), name)
            if not retry:
                return
            time.sleep(pause)
            pause = min(2 * pause, 0.2)
            names = [names[j] for j in retry]
            ptrs = [ptrs[j] for j in retry]
            sizes = [sizes[j] for j in retry]

    # -- lifecycle

    def close(self) -> None:
        """Finish queued puts, stop the writer, then release the buffers and the client."""
        super().close()
        with self._read_lock:
            if self._client_closed:
                return
            self._client_closed = True
            self._put_buffer.release()
            self._read_buffer.release()
            self._client.close()
