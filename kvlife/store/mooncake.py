"""MooncakeStore: pages in a Mooncake Store cluster, behind the same writer thread as files.

Page ``k`` of namespace ``ns`` is the object ``kvlife/<ns>/<k>`` in the shared page format,
verified on every read. It lives in the cluster's pool processes, moved through two
buffers this client registers (puts staged in one, reads landing in the other). How a
miss, a key stored before, a full pool and an unreachable cluster (a breaker of
``retry_after`` seconds) are handled, and how the guarantees differ from the directory
store's: ``docs/store-tier.md``, "MooncakeStore". Install: ``pip install 'kvlife[mooncake]'``.
"""

from __future__ import annotations

import enum
import importlib
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvlife._checks import finite_seconds, positive_int
from kvlife.errors import ConfigError, InvalidPut, MissingDependency, StoreError, StoreUnavailable
from kvlife.store.base import (
    DEFAULT_MAX_PAGE_BYTES,
    Payload,
    QueuedStore,
    Written,
    _check_keys,
    _copy_into,
    _pieces,
    check_held,
    check_key,
    frame_into,
    frame_size,
    payload_nbytes,
)
from kvlife.store.directory import check_namespace

__all__ = ["MooncakeStore", "load_client_class"]


class Code(enum.IntEnum):
    """Mooncake's error codes this store names (``mooncake-store`` ``types.h``)."""

    INTERNAL_ERROR = -1
    NO_AVAILABLE_HANDLE = -200  # no pool memory (or no pool)
    INVALID_PARAMS = -600  # e.g. a read buffer smaller than the object
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704  # missing or evicted: a miss
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800  # the pool holding the bytes cannot be reached
    RPC_FAIL = -900  # the master cannot be reached
    RPC_TIMEOUT = -901


#: Codes that mean "the cluster cannot serve now" (they open the breaker): INTERNAL_ERROR,
#: NO_AVAILABLE_HANDLE, TRANSFER_FAIL, RPC_FAIL and RPC_TIMEOUT.
UNAVAILABLE_CODES = frozenset({-1, -200, -800, -900, -901})

#: Environment variables read by :meth:`MooncakeStore.from_env` (SGLang's names).
ENV_MASTER = "MOONCAKE_MASTER"
ENV_METADATA = "MOONCAKE_TE_META_DATA_SERVER"
ENV_PROTOCOL = "MOONCAKE_PROTOCOL"
ENV_LOCAL_HOSTNAME = "MOONCAKE_LOCAL_HOSTNAME"


def _error(call: str, code: int, what: str, *, unavailable: bool = False) -> StoreError:
    code = int(code)
    kind = StoreUnavailable if unavailable or code in UNAVAILABLE_CODES else StoreError
    name = Code(code).name if code in Code._value2member_map_ else code
    return kind(f"mooncake {call} failed for {what}: {name} ({code})", code=code, call=call)


def load_client_class() -> Any:
    """``mooncake.store.MooncakeDistributedStore``; MissingDependency says what to install."""
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise MissingDependency(
            "MooncakeStore needs mooncake-transfer-engine-non-cuda: pip install 'kvlife[mooncake]' "
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
            what = f"the {self._what} buffer ({size} bytes)"
            raise _error("register_buffer", code, what, unavailable=True)
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
        max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
    ) -> None:
        check_namespace(namespace)
        if not isinstance(master, str) or not master or not isinstance(metadata, str):
            raise ConfigError(
                f"master must be HOST:PORT and metadata a URL, got {master!r}, {metadata!r}"
            )
        self._retry_after = finite_seconds("retry_after", retry_after)
        self._full_wait = finite_seconds("full_wait", full_wait)
        self._max_batch = positive_int("max_batch_bytes", max_batch_bytes)
        positive_int("local_buffer_size", local_buffer_size)
        positive_int("max_page_bytes", max_page_bytes)  # before a client is set up
        client_class = load_client_class()
        # A missing master then fails the constructor in seconds, not Mooncake's 90.
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
        self._prefix = f"kvlife/{namespace}/"
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
        # The largest page this store put or verified, in bytes (a batched read's slot):
        # what an object claims (get_size) never sizes it.
        self._slot = 0
        self._known: set[str] = set()  # keys this store put or found stored by its puts
        self._known_lock = threading.Lock()
        self._client_closed = False
        super().__init__(name="mooncake-store", max_page_bytes=max_page_bytes, namespace=namespace)

    @classmethod
    def from_env(cls, namespace: str = "default", **kwargs: Any) -> MooncakeStore:
        """A store on the cluster named by ``MOONCAKE_MASTER`` and ``MOONCAKE_TE_META_DATA_SERVER``
        (``MOONCAKE_PROTOCOL``, default tcp, and ``MOONCAKE_LOCAL_HOSTNAME`` are read too)."""
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
        """The stored payload of ``key``, or None on a miss (absent, evicted, failing checks);
        StoreError (StoreUnavailable) when the cluster fails to answer."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """``get`` of every key in one batched read; raises on the first key that fails."""
        keys = _check_keys(keys, "get_batch")
        out: list[bytes | None] = [None] * len(keys)

        def use(i: int, data: memoryview | None) -> None:
            # Verified in the read buffer: one copy, of the payload only.
            if (payload := self._verify(keys[i], data)) is not None:
                self._seen(keys[i], len(payload))
                out[i] = payload.tobytes()

        with self._read_lock:
            self._read_each(keys, None, self._read_buffer, "get", use)
        return out

    def get_batch_into(
        self, keys: Sequence[str], outs: Sequence[memoryview | Sequence[memoryview]]
    ) -> list[bool]:
        """``get_into`` of every key in one batched read: each object lands in the read
        buffer, is verified there and its payload copied into ``outs[i]`` (one copy); an
        object of another size than ``outs[i]`` is a miss and is not transferred."""
        keys = _check_keys(keys, "get_batch_into")
        pieces = [_pieces(o) for o in outs]
        if len(pieces) != len(keys):
            raise InvalidPut(f"{len(keys)} keys for {len(pieces)} destinations")
        sizes, done = [payload_nbytes(p) for p in pieces], [False] * len(keys)

        def use(i: int, data: memoryview | None) -> None:
            if (payload := self._verify(keys[i], data)) is not None:
                done[i] = _copy_into(payload, pieces[i])

        with self._read_lock:
            self._read_each(keys, sizes, self._read_buffer, "get", use)
        return done

    def keys(self) -> Iterator[str]:
        """The keys this store put or found stored with its bytes (a cluster is not listed)."""
        with self._known_lock:
            return iter(sorted(self._known))

    def _seen(self, key: str, payload_nbytes: int) -> None:
        """A verified page of ``key`` has ``payload_nbytes``: batched reads make room for it."""
        self._slot = max(self._slot, frame_size(key, payload_nbytes, self._namespace))

    def _read_each(
        self,
        keys: Sequence[str],
        expect: list[int] | None,
        buffer: _Buffer,
        call: str,
        use: Callable[[int, memoryview | None], None],
    ) -> None:
        """``use(i, object)`` for each of ``keys`` in order (None where absent); raises on failure.

        One ``batch_get_into``; an object is a view of ``buffer``, valid until its next use.
        Each slot is the page's size asked for (``expect``: payload bytes per key) or the
        largest page seen (docs/store-tier.md, "Reads are bounded").
        """
        if not keys:
            return
        names = [self._prefix + k for k in keys]
        if expect is not None:
            slots = [frame_size(k, n, self._namespace) for k, n in zip(keys, expect, strict=True)]
        else:
            slots = [max(self._slot, 4096)] * len(names)
        offsets = [0]
        for size in slots:
            offsets.append(offsets[-1] + size)
        buffer.ensure(offsets[-1])
        base, view = buffer.ptr, buffer.array.data
        codes = self._client.batch_get_into(names, [base + o for o in offsets[:-1]], slots)
        for i, code in enumerate(codes):
            if code >= 0:
                use(i, view[offsets[i] : offsets[i] + code])
            elif code == Code.OBJECT_NOT_FOUND:
                use(i, None)
            elif code == Code.INVALID_PARAMS and expect is not None:
                use(i, None)  # larger than the page asked for: not that page
            elif code == Code.INVALID_PARAMS:  # bigger than the slot: ask its size, read it alone
                data = self._read_one(names[i], keys[i], call)
                use(i, None if data is None else memoryview(data))
            else:
                raise _error(f"batch_get_into ({call})", code, names[i])

    def _read_one(self, name: str, key: str, call: str) -> bytes | None:
        size = self._client.get_size(name)
        if size == Code.OBJECT_NOT_FOUND:
            return None
        if size < 0:
            raise _error(f"get_size ({call})", size, name)
        if size > frame_size(key, self.max_page_bytes, self._namespace):  # no page is that large
            self._count(pages_corrupt=1)
            return None
        one = _Buffer(self._client, "large read")
        try:
            one.ensure(size)
            code = self._client.get_into(name, one.ptr, size)
            if code == Code.OBJECT_NOT_FOUND:
                return None
            if code < 0:
                raise _error(f"get_into ({call})", code, name)
            return one.array[:code].tobytes()
        finally:
            one.release()

    def _clear(self) -> int:
        """Remove every page object of this namespace (not those of a namespace below it)."""
        pattern = "^" + re.escape(self._prefix) + "[0-9a-f]{2,128}$"
        removed = self._client.remove_by_regex(pattern, True)
        if removed < 0:
            raise _error("remove_by_regex (clear)", removed, self._prefix)
        with self._known_lock:
            self._known.clear()
        return int(removed)

    # -- writes (writer thread)

    def _store_pages(
        self, keys: tuple[str, ...], pages: Sequence[Payload], kept: list[str] | None = None
    ) -> Written:
        # Steps 0, 1, 2: before looking for stored pages, before writing, after writing
        # (rolled back).
        now = time.monotonic()
        if now < self._down_until and self._down_error is not None:
            raise StoreUnavailable(
                f"{self._down_error} (not retried for {self._down_until - now:.1f} s more)",
                code=self._down_error.code,
                call=self._down_error.call,
            )
        try:
            return self._write(keys, pages, kept)
        except StoreUnavailable as exc:
            self._down_error = exc
            self._down_until = time.monotonic() + self._retry_after
            raise

    def _write(
        self, keys: tuple[str, ...], pages: Sequence[Payload], kept: list[str] | None
    ) -> Written:
        names = [self._prefix + k for k in keys]
        self._step(0, "before looking for stored pages")
        found = self._client.batch_is_exist(names)
        for name, code in zip(names, found, strict=True):
            if code < 0:
                raise _error("batch_is_exist", code, name)
        to_write = [i for i, code in enumerate(found) if code == 0]
        existing = [i for i, code in enumerate(found) if code == 1]
        bad: list[int] = []
        if existing:

            def check(j: int, data: memoryview | None) -> None:
                i = existing[j]
                payload = self._verify(keys[i], data)
                if payload is None:
                    if data is not None:  # a stored object failing verification
                        bad.append(i)
                    to_write.append(i)  # (or evicted since it was found)
                else:
                    self._seen(keys[i], len(payload))
                    check_held(keys[i], payload, pages[i], kept)

            self._read_each([keys[i] for i in existing], None, self._put_buffer, "put", check)
        if bad:
            codes = self._client.batch_remove([names[i] for i in bad], True)
            for i, code in zip(bad, codes, strict=True):
                if code not in (0, Code.OBJECT_NOT_FOUND):
                    raise _error("batch_remove (a page failing verification)", code, names[i])
        to_write.sort()
        self._step(1, "before writing")
        created: list[str] = []
        try:
            self._put(names, keys, pages, to_write, created)
            self._step(2, "after writing")
        except BaseException:
            if created:
                self._client.batch_remove(created, True)  # best effort: the cluster may be gone
            raise
        for i in to_write:
            self._seen(keys[i], payload_nbytes(pages[i]))
        with self._known_lock:
            self._known.update(keys)
        return [pages[i] for i in to_write]

    def _put(
        self,
        names: list[str],
        keys: tuple[str, ...],
        pages: Sequence[Payload],
        indices: list[int],
        created: list[str],
    ) -> None:
        """Frame pages ``indices`` into the staging buffer (one copy of each page, its
        checksum taken from the caller's memory) and put them, batch by batch."""
        if not indices:
            return
        frame = max(frame_size(keys[i], payload_nbytes(pages[i]), self._namespace) for i in indices)
        per_batch = max(1, self._max_batch // frame)
        buffer = self._put_buffer
        buffer.ensure(frame * min(per_batch, len(indices)))
        base, view = buffer.ptr, buffer.array.data
        for start in range(0, len(indices), per_batch):
            batch = indices[start : start + per_batch]
            ptrs, sizes = [], []
            offset = 0
            for i in batch:
                end = offset + frame_into(view[offset:], keys[i], pages[i], self._namespace)
                ptrs.append(base + offset)
                sizes.append(end - offset)
                offset = end
            self._put_batch([names[i] for i in batch], ptrs, sizes, created)

    def _put_batch(
        self, names: list[str], ptrs: list[int], sizes: list[int], created: list[str]
    ) -> None:
        """Put one staged batch; keys refused for want of pool memory are retried for
        ``full_wait`` seconds, then told apart by a one-byte probe object (a page that can
        never fit: InvalidPut; docs/store-tier.md, "A page that can never fit")."""
        deadline = time.monotonic() + self._full_wait
        pause = 0.01
        while True:
            codes = self._client.batch_put_from(names, ptrs, sizes)
            retry = []
            for j, (name, code) in enumerate(zip(names, codes, strict=True)):
                if code == 0:
                    created.append(name)
                elif code == Code.NO_AVAILABLE_HANDLE and time.monotonic() < deadline:
                    retry.append(j)
                elif code == Code.NO_AVAILABLE_HANDLE and self._pool_takes_a_byte(ptrs[j]):
                    raise InvalidPut(
                        f"a page of {sizes[j]} bytes ({name}) does not fit in the Mooncake "
                        f"pool, which takes smaller objects: no put of it can succeed"
                    )
                else:
                    raise _error("batch_put_from", code, name)
            if not retry:
                return
            time.sleep(pause)
            pause = min(2 * pause, 0.2)
            names = [names[j] for j in retry]
            ptrs = [ptrs[j] for j in retry]
            sizes = [sizes[j] for j in retry]

    def _pool_takes_a_byte(self, ptr: int) -> bool:
        """Whether the pool stores a one-byte probe object (removed again at once)."""
        probe = f"{self._prefix}probe-{secrets.token_hex(8)}"  # never a page name
        if self._client.put_from(probe, ptr, 1) != 0:
            return False
        self._client.remove(probe, True)
        return True

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
