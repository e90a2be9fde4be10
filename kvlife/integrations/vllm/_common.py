"""What both sides of the vLLM backend share: vLLM's keys as a Lifecycle records them and
as the persistent tier names them, the host side of a job, a registry of live roles,
reports, and the host pool a worker shares with its scheduler (in one process, or in
shared memory). It imports neither side."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast

import torch

# vLLM is an optional dependency: mypy runs without it, hence the ignores.
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    LoadStoreSpec,
    OffloadKey,
)

from kvlife import Lifecycle, Ticket
from kvlife.pool import HostPagePool, page_lock, page_unlock
from kvlife.store.base import Store

logger = logging.getLogger("kvlife.integrations.vllm")

_R = TypeVar("_R")


def _hex_keys(tokens: Sequence[object], page_size: int, prior: str | None) -> list[str]:
    """The backend Lifecycles' hasher: vLLM names each block by its own ``OffloadKey``
    (bytes); a Lifecycle records keys as hex ``str`` (one key type per ticket)."""
    return [key.hex() for key in tokens]  # type: ignore[attr-defined]


#: ``Lifecycle.submit`` typed for a chunk named by vLLM's keys (the hasher above).
_start_store = cast("Callable[[Lifecycle, Sequence[object]], Ticket]", Lifecycle.submit)


class HostBlocksSpec(LoadStoreSpec):  # type: ignore[misc]
    """A job's host side: ``block_ids[i]`` is block ``i``'s host page (or ``FROM_STORE``),
    ``keys[i]`` its vLLM key. Only the worker reads it: plain lists, no array."""

    __slots__ = ("block_ids", "keys")

    def __init__(self, block_ids: list[int], keys: list[OffloadKey]) -> None:
        self.block_ids = block_ids
        self.keys = keys

    def __repr__(self) -> str:
        return f"HostBlocksSpec({self.block_ids!r})"


#: Host page of a block that a load reads from the persistent tier.
FROM_STORE = -1


class _Live(Generic[_R]):
    """The roles alive in this process, listed from any thread: the references are copied
    in one C call (iterating a ``WeakSet`` raises if another thread adds a role meanwhile)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[_R]] = {}

    def add(self, member: _R) -> None:
        key = id(member)
        self._refs[key] = weakref.ref(member, lambda _: self._refs.pop(key, None))

    def members(self) -> list[_R]:
        refs = list(self._refs.values())
        return [m for m in (ref() for ref in refs) if m is not None]


class PersistentTier(Store, Protocol):
    """The persistent tier behind the host tier: a ``LocalDirectoryStore`` (``store_dir``)
    or a ``MooncakeStore`` (``store="mooncake"``), named by its namespace."""

    @property
    def namespace(self) -> str: ...


def page_namer(namespace: str) -> Callable[[OffloadKey | str], str]:
    """The persistent tier's name of a vLLM key (bytes, or its hex) in ``namespace``: a hash
    of both. A page's header binds its name, so the header binds the namespace: a page
    file copied or linked in from another namespace is never looked up under its old name
    and fails its header check under a new one (a miss)."""
    salt = namespace.encode() + b"\0"

    def name(key: OffloadKey | str) -> str:
        raw = bytes.fromhex(key) if isinstance(key, str) else bytes(key)
        return hashlib.blake2b(salt + raw, digest_size=32).hexdigest()

    return name


def shut_down(role: str, steps: Sequence[tuple[str, Callable[[], object]]]) -> list[Exception]:
    """Run every shutdown step, each guarded: a step that raises is logged and the next
    still runs. Returns the errors, in order (the caller counts them, and raises the first
    only when ``strict``: vLLM never sees one otherwise)."""
    errors: list[Exception] = []
    for name, step in steps:
        try:
            step()
        except Exception as exc:  # one step's failure must not skip the others
            errors.append(exc)
            logger.error("kvlife %s: shutdown step %r failed (%r); counted", role, name, exc)
    return errors


def _write_report(directory: str, name: str, report: Mapping[str, Any]) -> None:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(json.dumps(dict(report), sort_keys=True))


#: Host pools built by a worker, for the manager of the same engine in the same process,
#: each with its shared-memory name (None: a private pool), removed by the manager that
#: takes it.
_SHARED_POOLS: dict[str, tuple[HostPagePool, str | None]] = {}


# ------------------------------------------------------------------ the host tier in shared memory


def shared_pool_path(engine: str, scheduler_pid: int, rank: int) -> str:
    """Where rank ``rank``'s worker shares its host pool with the scheduler process of
    ``scheduler_pid`` (the worker's parent in vLLM's multiprocess executor): a tmpfs file
    (``KVLIFE_SHM_DIR``, default ``/dev/shm``) named by the engine, that process and the
    rank, so two engines on one machine never meet."""
    directory = os.environ.get("KVLIFE_SHM_DIR") or "/dev/shm"
    tag = hashlib.blake2b(engine.encode(), digest_size=10).hexdigest()
    return os.path.join(directory, f"kvlife-{tag}-{scheduler_pid}-rank{rank}")


def _map(path: str, pages: int, row: int) -> HostPagePool:
    tensor = torch.from_file(path, shared=True, size=pages * row, dtype=torch.int8)
    return HostPagePool.over(tensor.view(pages, row))


def create_shared_pool(path: str, pages: int, row: int) -> HostPagePool | None:
    """The worker's host pool in a new shared file at ``path`` (a stale one of a crashed
    run goes first), its memory reserved now (``posix_fallocate``: a tmpfs too small fails
    here with ENOSPC, never later with SIGBUS); None, logged, when it cannot be made (the
    worker then keeps a private pool and reads the persistent tier itself)."""
    try:
        if os.path.exists(path):
            os.unlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        logger.warning("kvlife: no shared host tier at %s (%s): worker reads the store", path, exc)
        return None
    try:
        os.posix_fallocate(fd, 0, pages * row)
        return _map(path, pages, row)
    except (OSError, RuntimeError) as exc:
        logger.warning(
            "kvlife: no shared host tier of %d B at %s (%s): the worker reads the store",
            pages * row,
            path,
            exc,
        )
        unlink_quietly(path)
        return None
    finally:
        os.close(fd)


def attach_shared_pool(path: str, pages: int, row: int) -> HostPagePool | None:
    """The scheduler side's view of a worker's shared host pool (the same bytes; an
    allocator of its own), or None when no worker shared one of that size at ``path``."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return None
    if size != pages * row:
        logger.warning(
            "kvlife: %s holds %d B, not %d pages of %d B: unused", path, size, pages, row
        )
        return None
    try:
        return _map(path, pages, row)
    except (OSError, RuntimeError) as exc:
        logger.warning("kvlife: cannot map %s (%s): not used", path, exc)
        return None


def _host_register() -> tuple[Callable[[int, int], bool], Callable[[int], None]] | str:
    """vLLM's own helpers for its shared offload region (cudaHostRegister, and a failure
    drained by cudaGetLastError, so no later CUDA call reports it), or why there are none:
    the caller logs it, once."""
    try:
        from vllm.v1.kv_offload.cpu.host_register import (  # type: ignore[import-not-found]
            host_register,
            host_unregister,
        )
    except ImportError as exc:
        return f"vLLM has no host_register: {exc}"
    return host_register, host_unregister


def pin_shared_pool(pool: HostPagePool) -> list[int] | None:
    """Page-lock a worker's shared pool for a KV cache on CUDA (:func:`kvlife.pool.page_lock`
    through vLLM's ``host_register``). The registered addresses, or None, logged, with
    nothing left registered (the worker then keeps a private pinned pool)."""
    helpers = _host_register()
    why = helpers if isinstance(helpers, str) else "refused"
    try:
        pinned = None if isinstance(helpers, str) else page_lock(pool, *helpers)
    except Exception as exc:  # never into vLLM: the private pool serves
        pinned, why = None, f"{type(exc).__name__}: {exc}"
    if pinned is None:
        logger.warning(
            "kvlife: the shared host tier (%d B) could not be page-locked (%s): the worker "
            "keeps a private pinned pool and reads the persistent tier itself",
            pool.tensor.numel(),
            why,
        )
    return pinned


def unpin_shared_pool(addresses: Sequence[int]) -> None:
    """Undo :func:`pin_shared_pool` (once no copy reads or writes the pool)."""
    helpers = _host_register() if addresses else None
    if isinstance(helpers, tuple):  # addresses were registered, so vLLM had the helpers
        page_unlock(addresses, helpers[1])


def unlink_quietly(path: str) -> None:
    """Remove a shared pool's name (its mappings stay valid); gone already is fine."""
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
