"""What both sides of the vLLM backend share: vLLM's keys as the persistent tier names them,
the host side of a job, a registry of live roles and reports (the host pool a worker shares
with its scheduler is ``shared_pool.py``). It imports neither side."""

from __future__ import annotations

import hashlib
import json
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

# vLLM is an optional dependency: mypy runs without it, hence the ignores.
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    LoadStoreSpec,
    OffloadKey,
)

from kvlife.store.base import Store

logger = logging.getLogger("kvlife.integrations.vllm")

_R = TypeVar("_R")


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


def page_namer(namespace: str) -> Callable[[OffloadKey], str]:
    """The persistent tier's name of a vLLM key (its bytes) in ``namespace``: a hash
    of both. A page's header binds its name, so the header binds the namespace: a page
    file copied or linked in from another namespace is never looked up under its old name
    and fails its header check under a new one (a miss)."""
    salt = namespace.encode() + b"\0"

    def name(key: OffloadKey) -> str:
        return hashlib.blake2b(salt + bytes(key), digest_size=32).hexdigest()

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
