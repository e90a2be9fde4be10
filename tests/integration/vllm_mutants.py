"""Seeded bugs in vLLM's own ``CPUOffloadingManager``, each a subclass with one rule broken,
and the factories (``factory(chunks) -> manager``) ``kvlife.testing.vllm`` and
``kvlife check --vllm-manager vllm_mutants:NAME`` drive. Imports vLLM."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, ClassVar

import torch
from vllm.v1.kv_offload.base import LookupResult, OffloadingEvent
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvlife.integrations.vllm import KVLifeOffloadingManager
from kvlife.pool import HostPagePool


def lru(chunks: int) -> CPUOffloadingManager:
    """vLLM's CPU manager, LRU, with its events on."""
    return CPUOffloadingManager(num_chunks=chunks, cache_policy="lru", enable_events=True)


def arc(chunks: int) -> CPUOffloadingManager:
    """vLLM's CPU manager, ARC, with its events on."""
    return CPUOffloadingManager(num_chunks=chunks, cache_policy="arc", enable_events=True)


def kvlife_strict(chunks: int) -> KVLifeOffloadingManager:
    """kvlife's vLLM manager with ``strict``: a refusal raises."""
    return KVLifeOffloadingManager(HostPagePool(chunks, 8, torch.int8), strict=True)


def not_a_manager(chunks: int) -> object:
    """A factory that returns something else (``kvlife check`` refuses it)."""
    return object()


class _Mutant(CPUOffloadingManager):
    def __init__(self, chunks: int) -> None:
        super().__init__(num_chunks=chunks, enable_events=True)


class PendingIsAHit(_Mutant):
    """A key is a hit as soon as its store is prepared (served before it is written)."""

    def lookup(self, key: Any, req_context: Any) -> LookupResult:
        found = super().lookup(key, req_context)
        return LookupResult.HIT if found is LookupResult.HIT_PENDING else found


class UnpinnedLoads(_Mutant):
    """A load does not pin what it reads: eviction may take a block under the load."""

    def prepare_load(self, keys: Collection[Any], req_context: Any) -> Any:
        return self._get_load_store_spec(keys, [self._policy.get(k) for k in keys])

    def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
        return None


class LeakedPin(_Mutant):
    """``complete_load`` forgets one key of a job with several: it stays pinned for good."""

    def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
        keys = sorted(keys)
        super().complete_load(keys[:-1] if len(keys) > 1 else keys, req_context)


class EvictsOffered(_Mutant):
    """Eviction ignores the keys the same ``prepare_store`` offers."""

    def __init__(self, chunks: int) -> None:
        super().__init__(chunks)
        evict = self._policy.evict
        self._policy.evict = lambda n, protected: evict(n, set())  # type: ignore[method-assign]


class FailedStoreServed(_Mutant):
    """A failed store is settled as a success: a block never written is served."""

    def complete_store(self, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
        super().complete_store(keys, req_context, True)


class SilentEviction(_Mutant):
    """Evictions publish no removed event: subscribers think the blocks are still there."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        return [e for e in super().take_events() if not e.removed]


class StoredBeforeRemoved(_Mutant):
    """Events are published stores first: a chunk's new key before its old key's removal."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = list(super().take_events())
        return [e for e in events if not e.removed] + [e for e in events if e.removed]


def off_by_one(chunks: int) -> CPUOffloadingManager:
    """A tier sized one chunk larger than it was given."""
    return CPUOffloadingManager(num_chunks=chunks + 1, enable_events=True)


#: Seeded bug -> the rules the kit may report for it.
MUTANTS: dict[str, tuple[Any, frozenset[str]]] = {
    "pending-is-a-hit": (PendingIsAHit, frozenset({"pending-hit"})),
    "unpinned-loads": (UnpinnedLoads, frozenset({"pinned-evicted"})),
    "leaked-pin": (LeakedPin, frozenset({"stuck"})),
    "evicts-offered": (EvictsOffered, frozenset({"offered-evicted"})),
    "failed-store-served": (FailedStoreServed, frozenset({"phantom-hit"})),
    "silent-eviction": (SilentEviction, frozenset({"events"})),
    "stored-before-removed": (StoredBeforeRemoved, frozenset({"events"})),
    "off-by-one-tier": (off_by_one, frozenset({"capacity"})),
}


def kvlife_lenient(chunks: int) -> KVLifeOffloadingManager:
    """kvlife's vLLM manager as vLLM builds it (refusals counted and logged, not raised)."""
    return KVLifeOffloadingManager(HostPagePool(chunks, 8, torch.int8))


class KeyOrderLog(_Mutant):
    """vLLM's LRU manager that logs, in a class-wide list, the order in which each
    completion's keys arrive (no rule broken)."""

    log: ClassVar[list[str]] = []

    def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
        KeyOrderLog.log.append("load " + ",".join(k.hex() for k in keys))
        super().complete_load(keys, req_context)

    def complete_store(self, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
        KeyOrderLog.log.append("store " + ",".join(k.hex() for k in keys))
        super().complete_store(keys, req_context, success)


# For kvlife check --vllm-manager's deadlines (issue 35): a factory that never returns, and
# a manager whose lookup never returns.


def blocking_factory(chunks: int) -> Any:
    """Never returns (it waits on a lock nobody releases)."""
    import threading

    lock = threading.Lock()
    lock.acquire()
    lock.acquire()
    return None  # never reached


def blocking_lookup(chunks: int) -> Any:
    """A manager whose lookup blocks for ever."""
    manager = arc(chunks)

    def lookup(*args: Any, **kwargs: Any) -> Any:
        import time

        while True:
            time.sleep(0.01)

    manager.lookup = lookup
    return manager
