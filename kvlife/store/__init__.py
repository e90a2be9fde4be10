"""The storage tier (``docs/store.md``): :class:`Store`, the protocol the manager uses;
:class:`LocalDirectoryStore`, the embedded default; :class:`MemoryStore` in process, and
:class:`InlineStore`, which writes on the caller's thread (tests).
"""

from kvlife.errors import InvalidPut, PageMismatch, StoreClosed, StoreError, StoreUnavailable
from kvlife.store.base import Store, StoreResult, StoreStats
from kvlife.store.directory import LocalDirectoryStore
from kvlife.store.memory import InlineStore, MemoryStore

__all__ = [
    "InlineStore",
    "InvalidPut",
    "LocalDirectoryStore",
    "MemoryStore",
    "PageMismatch",
    "Store",
    "StoreClosed",
    "StoreError",
    "StoreResult",
    "StoreStats",
    "StoreUnavailable",
]
