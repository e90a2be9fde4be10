"""The storage tier: host pages under content-hash keys, written asynchronously.

:class:`Store` is the protocol the manager uses; :class:`LocalDirectoryStore`
is the embedded default, :class:`MemoryStore` the in-process one and
:class:`InlineStore` the one that writes on the caller's thread (tests). See
``docs/store.md`` for atomicity, failure semantics and file naming.
"""

from kvlife.errors import (
    InvalidPut,
    PageMismatch,
    StoreClosed,
    StoreError,
    StoreUnavailable,
)
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
