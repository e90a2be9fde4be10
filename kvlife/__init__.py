"""kvlife: an explicit, checked lifecycle for each request's KV-cache offload.

``import kvlife`` loads the lifecycle core only (no torch). The parts that hold
tensors (the manager, the host pool, the layouts, the engines, the stores) are
public names here too, imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvlife import errors
from kvlife._lifecycle import (
    DECODING,
    TABLE,
    Event,
    FinishReason,
    Lifecycle,
    LifecycleSnapshot,
    LoadTicket,
    State,
    Ticket,
    Transition,
)
from kvlife.errors import *  # noqa: F403 (every error, documented in kvlife.errors)
from kvlife.refusals import Refusals

if TYPE_CHECKING:
    from kvlife.engine.base import Ack
    from kvlife.engine.cpu import CpuCopyEngine
    from kvlife.engine.cuda import CudaCopyEngine
    from kvlife.host_tier import HostTier, Lookup
    from kvlife.layout import KVLayout, LayerFirstLayout, MLALayout, PageFirstLayout
    from kvlife.manager import ManagerMetrics, OffloadManager, OffloadRequest
    from kvlife.pool import HostPagePool
    from kvlife.store.directory import LocalDirectoryStore
    from kvlife.store.memory import MemoryStore
    from kvlife.transfers import TransferCounts, Transfers

__version__ = "0.1.0"

#: Public names whose modules need torch: name -> module, imported on first use.
_LAZY = {
    "Ack": "kvlife.engine.base",
    "CpuCopyEngine": "kvlife.engine.cpu",
    "CudaCopyEngine": "kvlife.engine.cuda",
    "HostTier": "kvlife.host_tier",
    "Lookup": "kvlife.host_tier",
    "KVLayout": "kvlife.layout",
    "LayerFirstLayout": "kvlife.layout",
    "MLALayout": "kvlife.layout",
    "PageFirstLayout": "kvlife.layout",
    "ManagerMetrics": "kvlife.manager",
    "OffloadManager": "kvlife.manager",
    "OffloadRequest": "kvlife.manager",
    "HostPagePool": "kvlife.pool",
    "LocalDirectoryStore": "kvlife.store.directory",
    "MemoryStore": "kvlife.store.memory",
    "TransferCounts": "kvlife.transfers",
    "Transfers": "kvlife.transfers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlife' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "DECODING",
    "TABLE",
    "Ack",
    "CpuCopyEngine",
    "CudaCopyEngine",
    "Event",
    "FinishReason",
    "HostPagePool",
    "HostTier",
    "KVLayout",
    "LayerFirstLayout",
    "Lifecycle",
    "LifecycleSnapshot",
    "LoadTicket",
    "LocalDirectoryStore",
    "Lookup",
    "MLALayout",
    "ManagerMetrics",
    "MemoryStore",
    "OffloadManager",
    "OffloadRequest",
    "PageFirstLayout",
    "Refusals",
    "State",
    "Ticket",
    "TransferCounts",
    "Transfers",
    "Transition",
    "__version__",
]
__all__ += errors.__all__
