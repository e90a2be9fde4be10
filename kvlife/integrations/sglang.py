"""An SGLang HiCache storage backend on any kvlife store (directory, Mooncake, memory).

SGLang's dynamic backend loads it by name (``--hicache-storage-backend dynamic``, extra config
``{"backend_name": "kvlife", "module_path": "kvlife.integrations.sglang", "class_name":
"KVLifeHiCacheStorage", ...}``) as ``KVLifeHiCacheStorage(storage_config, kwargs)``. The extra
config picks the store: ``"kvlife_store": "directory"`` (default) under ``"kvlife_root"``
(default ``$KVLIFE_STORE_DIR``, else ``kvlife-hicache`` in the working directory), or
``"mooncake"`` with ``"mooncake_master"`` and ``"mooncake_metadata"`` (default
``$MOONCAKE_MASTER`` and ``$MOONCAKE_TE_META_DATA_SERVER``); ``"kvlife_namespace"`` overrides
the namespace, otherwise the model and the shard as SGLang's file backend names them.

The contract kept (pages only whole and verified, first values kept, nothing raised into
SGLang unless ``"kvlife_strict": true``) is in docs/store-tier.md, "The SGLang backend"; a
key that is not lowercase hex (a suffixed pool key) is stored under the SHA-256 of its text.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from itertools import count
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvlife.errors import ConfigError, InvalidPut, KVLifeError, StoreError
from kvlife.refusals import Refusals
from kvlife.store.base import QueuedStore, StoreResult, tensor_segments

__all__ = ["KVLifeHiCacheStorage", "store_key"]

_T = TypeVar("_T")

logger = logging.getLogger(__name__)

_HEX = re.compile(r"[0-9a-f]{2,128}")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
#: The longest model name kept whole in the namespace; a longer one keeps this many
#: characters and the SHA-256 of the whole name (a namespace component takes 100).
MODEL_NAME_KEPT = 60
#: Keys checked per round trip in batch_exists (it stops at the first miss).
EXISTS_CHUNK = 64


def store_key(key: str) -> str:
    """The kvlife key of SGLang key ``key``: itself if lowercase hex, else its SHA-256."""
    if _HEX.fullmatch(key):
        return key
    return hashlib.sha256(key.encode()).hexdigest()


def _model_component(name: str | None) -> str:
    """A namespace component for a model name or path: unsafe characters become ``-``; a
    longer name than MODEL_NAME_KEPT is shortened as that constant says."""
    model = _UNSAFE.sub("-", (name or "model").replace("/", "-")).lstrip(".-") or "model"
    if len(model) <= MODEL_NAME_KEPT:
        return model
    digest = hashlib.sha256((name or "").encode()).hexdigest()[:16]
    return f"{model[:MODEL_NAME_KEPT].rstrip('.-')}-{digest}"


def _shard(shard: str, config: Any, parts: Sequence[str] = ("pp", "attn_cp", "dcp")) -> str:
    """``shard`` and ``-<part><rank>of<n>`` for each of ``config``'s parallel ``parts`` over 1
    (``dcp``: MLA pages sharded by decode context parallel)."""
    for part in parts:
        n = int(getattr(config, f"{part}_size", 1) or 1)
        if n > 1:
            shard += f"-{part.removeprefix('attn_')}{int(getattr(config, f'{part}_rank', 0))}of{n}"
    return shard


def _namespace(config: HiCacheStorageConfig | None) -> str:
    if config is None:
        return "sglang"
    shard = "mla" if config.is_mla_model else f"tp{config.tp_rank}of{config.tp_size}"
    return f"sglang/{_model_component(config.model_name)}/{_shard(shard, config)}"


def _make_store(extra: dict[str, Any], namespace: str) -> QueuedStore:
    kind = extra.get("kvlife_store", "directory")
    if kind == "mooncake":
        from kvlife.store.mooncake import MooncakeStore

        master = extra.get("mooncake_master") or os.environ.get("MOONCAKE_MASTER")
        metadata = extra.get("mooncake_metadata") or os.environ.get("MOONCAKE_TE_META_DATA_SERVER")
        return MooncakeStore(str(master or ""), str(metadata or ""), namespace)
    if kind == "directory":
        from kvlife.store.directory import LocalDirectoryStore

        root = extra.get("kvlife_root") or os.environ.get("KVLIFE_STORE_DIR") or "kvlife-hicache"
        return LocalDirectoryStore(root, namespace)
    raise ConfigError(f"kvlife_store must be 'directory' or 'mooncake', got {kind!r}")


class KVLifeHiCacheStorage(HiCacheStorage):  # type: ignore[misc,unused-ignore]
    """SGLang's ``HiCacheStorage`` on a kvlife store: verified pages, first value kept."""

    def __init__(
        self,
        storage_config: HiCacheStorageConfig | None = None,
        kwargs: dict[str, Any] | None = None,
        *,
        store: QueuedStore | None = None,
        timeout: float = 60.0,
        strict: bool | None = None,
    ) -> None:
        extra = dict((storage_config.extra_config or {}) if storage_config else {})
        namespace = extra.get("kvlife_namespace") or _namespace(storage_config)
        self._owns_store = store is None
        self.store: QueuedStore = store if store is not None else _make_store(extra, namespace)
        self.timeout = timeout
        strict = bool(extra.get("kvlife_strict", False)) if strict is None else strict
        #: Refused or failed calls by kind (counted, logged once per kind; raised if strict).
        self.refusals = Refusals(strict=strict, logger=logger)
        self._refusals_lock = threading.Lock()
        self._tokens = count()
        self._results: dict[int, StoreResult] = {}
        self._results_lock = threading.Lock()

    def _guard(self, kind: str, what: str, call: Callable[[], _T], failed: _T) -> _T:
        """``call()``, or ``failed`` with the error counted under ``kind``: nothing a
        store, a tensor or the memory can raise reaches SGLang (unless strict)."""
        try:
            return call()
        except Exception as exc:
            error = exc if isinstance(exc, KVLifeError) else StoreError(f"{what}: {exc!r}")
            if error is not exc:
                error.__cause__ = exc
            with self._refusals_lock:
                self.refusals.refuse(kind, error)  # raises when strict
            return failed

    def _put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> bool:
        """One put of ``values[i]`` under ``keys[i]`` (``keep_first``: docs/store-tier.md);
        True once every key holds a page; a store failure stores none of them (raised)."""
        unique: dict[str, torch.Tensor] = {}
        for key, value in zip(keys, values, strict=True):
            unique.setdefault(store_key(key), value)
        token = next(self._tokens)
        self.store.put(token, list(unique), list(unique.values()), keep_first=True)
        result = self._wait(token)
        if result.error is not None:
            raise result.error
        return True

    def _set_pages(self, kind: str, keys: Sequence[str], values: Sequence[Any]) -> bool:
        def put() -> bool:
            _one_tensor_per_key(keys, values)
            return self._put(keys, values)

        return not keys or self._guard(kind, f"put of {len(keys)} pages", put, False)

    def _wait(self, token: int) -> StoreResult:
        """This token's result; other callers' results are kept for them."""
        deadline = time.monotonic() + self.timeout
        pause = 0.0002
        while True:
            with self._results_lock:
                for result in self.store.poll():
                    self._results[result.token] = result  # type: ignore[index]
                found = self._results.pop(token, None)
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise StoreError(f"no result for a put after {self.timeout} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store one page; True once the key holds a page (this one, or its first value)."""
        return self._set_pages("set", [key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """One put: the new pages stored, True once every key holds a page."""
        return self._set_pages("batch_set", keys, list(values) if values is not None else [])

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Zero-copy ``batch_set``: each page written from SGLang's host pool in place."""

        def put() -> list[bool]:
            views = [self._pool_page(host_indices, i)[1] for i in range(len(keys))]
            return [self._put(keys, views)] * len(keys)

        return self._guard("batch_set_v1", "zero-copy put", put, [False] * len(keys))

    def clear(self) -> bool:
        """Remove this namespace's pages from the store; True if it did (logged)."""

        def clear() -> bool:
            removed = self.store.clear()
            logger.info("kvlife store: cleared %d pages", removed)
            return True

        return self._guard("clear", "clear", clear, False)

    def _pool_page(self, host_indices: torch.Tensor, i: int) -> tuple[int, torch.Tensor]:
        """(first token index, page view) of page ``i`` of ``host_indices`` in the host pool."""
        pool = getattr(self, "mem_pool_host", None)
        if pool is None:
            raise ConfigError("the zero-copy calls need SGLang's host pool (none registered)")
        index = int(host_indices[i * pool.page_size])
        return index, pool.get_data_page(index, flat=False)

    def _read_into(self, keys: Sequence[str], targets: Sequence[torch.Tensor]) -> list[bool]:
        outs = [tensor_segments(t, writable=True) for t in targets]
        return self.store.get_batch_into([store_key(k) for k in keys], outs)

    def _read(self, keys: Sequence[str]) -> list[bytes | None]:
        return self.store.get_batch([store_key(k) for k in keys])

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        """The page under ``key`` in ``target_location`` (or a new uint8 tensor); None on a miss."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        """``get`` of every key, each read straight into its target."""
        if target_locations is None:
            misses: list[bytes | None] = [None] * len(keys)
            found = self._guard("get", "read", lambda: self._read(keys), misses)
            return [
                None if d is None else torch.frombuffer(bytearray(d), dtype=torch.uint8)
                for d in found
            ]
        targets = list(target_locations)

        def read() -> list[bool]:
            _one_tensor_per_key(keys, targets)
            return self._read_into(keys, targets)

        done = self._guard("get", "read", read, [False] * len(keys))
        return [targets[i] if ok else None for i, ok in enumerate(done)]

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Zero-copy ``batch_get``: each page read into SGLang's host pool in place."""

        def read() -> list[bool]:
            pool = self.mem_pool_host
            pages = [self._pool_page(host_indices, i) for i in range(len(keys))]
            # A page view shares the pool's memory; a pool that hands out copies is
            # filled through its own setter instead.
            targets = [v if v._is_view() else torch.empty_like(v) for _, v in pages]
            done = self._read_into(keys, targets)
            for (index, view), target, ok in zip(pages, targets, done, strict=True):
                if ok and target is not view:
                    pool.set_from_flat_data_page(index, target.flatten())
            return done

        return self._guard("batch_get_v1", "zero-copy read", read, [False] * len(keys))

    def exists(self, key: str) -> bool:
        """Whether a whole, verified page is stored under ``key``."""
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """The number of consecutive existing keys from the first."""

        def count_existing() -> int:
            done = 0
            for start in range(0, len(keys), EXISTS_CHUNK):
                for data in self._read(keys[start : start + EXISTS_CHUNK]):
                    if data is None:
                        return done
                    done += 1
            return done

        return self._guard("exists", "read", count_existing, 0)

    def get_stats(self) -> Any:
        """The store's counters (``StoreStats``: ``page_mismatches``, ``pages_corrupt``, ...)."""
        return self.store.stats() if hasattr(self.store, "stats") else None

    def close(self) -> None:
        """Close the store if this backend made it."""
        if self._owns_store:
            self.store.close()


def _one_tensor_per_key(keys: Sequence[str], values: Sequence[Any]) -> None:
    if len(values) != len(keys) or not all(isinstance(v, torch.Tensor) for v in values):
        raise InvalidPut("refused: one tensor per key")
