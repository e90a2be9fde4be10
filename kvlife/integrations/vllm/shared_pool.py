"""The host pool a vLLM worker shares with its scheduler, as one object for its whole life:
made in a tmpfs file the scheduler process maps (or private), page-locked on CUDA, offered
to the manager in one process, unlinked and unlocked by :meth:`~SharedHostPool.close`. This
module imports neither side of the backend.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable

import torch

from kvlife.pool import HostPagePool, page_lock, page_unlock

logger = logging.getLogger("kvlife.integrations.vllm")

__all__ = ["SharedHostPool"]


class SharedHostPool:
    """A worker's host pool (``pool``), shared at ``path`` or private (``path`` None),
    page-locked where ``pinned`` lists the registered ranges."""

    def __init__(self, pool: HostPagePool, path: str | None = None) -> None:
        self.pool = pool
        self.path = path
        self._pinned: list[int] = []  # the page-locked ranges, unlocked by close()

    @staticmethod
    def path_for(engine: str, scheduler_pid: int, rank: int) -> str:
        """Where rank ``rank``'s worker shares its pool with the scheduler process of
        ``scheduler_pid`` (the worker's parent in vLLM's multiprocess executor): a tmpfs
        file (``KVLIFE_SHM_DIR``, default ``/dev/shm``) named by the engine, that process
        and the rank, so two engines on one machine never meet."""
        directory = os.environ.get("KVLIFE_SHM_DIR") or "/dev/shm"
        tag = hashlib.blake2b(engine.encode(), digest_size=10).hexdigest()
        return os.path.join(directory, f"kvlife-{tag}-{scheduler_pid}-rank{rank}")

    @classmethod
    def create(
        cls, path: str, pages: int, row: int, *, lock: bool = False
    ) -> SharedHostPool | None:
        """A new pool in a shared file at ``path`` (a stale one of a crashed run goes
        first), its memory reserved now (``posix_fallocate``: a tmpfs too small fails here
        with ENOSPC, never later with SIGBUS), page-locked with ``lock``. None, logged and
        with nothing left behind, when it cannot be made (the worker then keeps a private
        pool and reads the persistent tier itself)."""
        fd = None
        try:
            SharedHostPool.discard(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.posix_fallocate(fd, 0, pages * row)
            shared = cls(_map(path, pages, row), path)
        except (OSError, RuntimeError) as exc:
            logger.warning(
                "kvlife: no shared host tier of %d B at %s (%s): the worker reads the store",
                pages * row,
                path,
                exc,
            )
            if fd is not None:  # ours: its name goes
                SharedHostPool.discard(path)
            return None
        finally:
            if fd is not None:
                os.close(fd)
        if lock and not shared._lock():
            shared.close()
            return None
        return shared

    @staticmethod
    def attach(path: str, pages: int, row: int) -> HostPagePool | None:
        """The scheduler side's view of a worker's shared pool (the same bytes; an
        allocator of its own), or None when no worker shared one of that size at ``path``.
        The name goes either way: the mapping stays, nothing is left in shared memory."""
        try:
            size = os.stat(path).st_size
        except OSError:
            return None
        try:
            if size != pages * row:
                logger.warning(
                    "kvlife: %s holds %d B, not %d pages of %d B: unused", path, size, pages, row
                )
                return None
            return _map(path, pages, row)
        except (OSError, RuntimeError) as exc:
            logger.warning("kvlife: cannot map %s (%s): not used", path, exc)
            return None
        finally:
            SharedHostPool.discard(path)

    def unlink(self) -> None:
        """Remove the pool's name (its mappings stay valid); gone already is fine."""
        if self.path:
            self.discard(self.path)

    @staticmethod
    def discard(path: str) -> None:
        """Remove a shared pool's name (mappings of it stay valid); gone already is fine."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def close(self) -> None:
        """Undo the page lock (once no copy reads or writes the pool) and remove the name.
        Idempotent."""
        pinned, self._pinned = self._pinned, []
        try:
            helpers = _host_register() if pinned else None
            if isinstance(helpers, tuple):  # ranges were registered, so vLLM had the helpers
                page_unlock(pinned, helpers[1])
        finally:  # the name goes even if unlocking failed
            self.unlink()

    @property
    def pinned(self) -> bool:
        """Whether the pool is page-locked now."""
        return bool(self._pinned)

    def _lock(self) -> bool:
        """Page-lock the pool for a KV cache on CUDA (:func:`kvlife.pool.page_lock` through
        vLLM's ``host_register``); False, logged, with nothing left registered."""
        helpers = _host_register()
        why = helpers if isinstance(helpers, str) else "refused"
        try:
            pinned = None if isinstance(helpers, str) else page_lock(self.pool, *helpers)
        except Exception as exc:  # never into vLLM: a private pool serves
            pinned, why = None, f"{type(exc).__name__}: {exc}"
        if pinned is None:
            logger.warning(
                "kvlife: the shared host tier (%d B) could not be page-locked (%s): the worker "
                "keeps a private pinned pool and reads the persistent tier itself",
                self.pool.tensor.numel(),
                why,
            )
            return False
        self._pinned = pinned
        return True

    def offer(self, key: str) -> None:
        """Offer this pool to the manager of the same engine in this process (vLLM builds
        the worker first)."""
        _OFFERED[key] = self

    def withdraw(self, key: str) -> bool:
        """Offer this pool no more (a manager took it, or its worker's start failed); whether
        it was still offered."""
        if _OFFERED.get(key) is not self:
            return False
        del _OFFERED[key]
        return True

    @classmethod
    def offered(cls, key: str) -> SharedHostPool | None:
        """The pool offered under ``key`` now, if any (not taken)."""
        return _OFFERED.get(key)


#: Pools a worker offered to the manager of its engine in this process, by pool key.
_OFFERED: dict[str, SharedHostPool] = {}


def _map(path: str, pages: int, row: int) -> HostPagePool:
    tensor = torch.from_file(path, shared=True, size=pages * row, dtype=torch.int8)
    return HostPagePool.over(tensor.view(pages, row))


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
