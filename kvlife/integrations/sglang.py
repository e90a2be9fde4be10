"""An SGLang HiCache storage backend on any kvlife store (directory, Mooncake, memory).

SGLang loads third-party storage backends by name::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvlife",
            "module_path": "kvlife.integrations.sglang", "class_name": "KVLifeHiCacheStorage",
            "kvlife_store": "mooncake"}'

and constructs the class as ``KVLifeHiCacheStorage(storage_config, kwargs)``.
The extra config picks the store:

- ``"kvlife_store": "directory"`` (default) with ``"kvlife_root"`` (default
  ``$KVLIFE_STORE_DIR``, else ``kvlife-hicache`` in the working directory);
- ``"kvlife_store": "mooncake"`` with ``"mooncake_master"`` and
  ``"mooncake_metadata"`` (default ``$MOONCAKE_MASTER`` and
  ``$MOONCAKE_TE_META_DATA_SERVER``);
- ``"kvlife_namespace"`` overrides the namespace, which is otherwise the model
  and the shard, as SGLang's file backend names them (MLA pages are shared by
  every TP rank; other models' pages are per rank).

The contract kept (``HiCacheStorage``):

- ``get(key, target_location)`` fills ``target_location`` and returns it, or
  returns None when no whole page of that size is stored (a miss, a page
  failing verification, or a store that cannot answer: logged);
- ``set(key, value)`` stores ``value`` and returns True once it is stored
  (the same bytes already stored are a success; other bytes under the key, or a
  store failure, return False); ``batch_set`` stores all pages or none and
  returns True only if all are stored;
- ``exists(key)``; ``batch_exists(keys)`` is the count of consecutive existing
  keys from the first.

Keys: SGLang's page keys are SHA-256 hex digests, which kvlife's hasher makes
bit for bit, so the same page has the same key on both sides. A key that is
not lowercase hex (a suffixed pool key) is stored under the SHA-256 of its text.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from itertools import count
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvlife.errors import ConfigError, StoreError
from kvlife.store.base import QueuedStore, StoreResult, check_key

__all__ = ["KVLifeHiCacheStorage", "store_key"]

logger = logging.getLogger(__name__)

_HEX = re.compile(r"[0-9a-f]{2,128}")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
#: Keys checked per round trip in batch_exists (it stops at the first miss).
EXISTS_CHUNK = 64


def store_key(key: str) -> str:
    """The kvlife key of SGLang key ``key``: itself if lowercase hex, else its SHA-256."""
    if _HEX.fullmatch(key):
        return key
    return hashlib.sha256(key.encode()).hexdigest()


def _namespace(config: HiCacheStorageConfig | None) -> str:
    if config is None:
        return "sglang"
    model = _UNSAFE.sub("-", (config.model_name or "model").replace("/", "-")).lstrip(".-")
    shard = "mla" if config.is_mla_model else f"tp{config.tp_rank}of{config.tp_size}"
    if config.pp_size > 1:
        shard += f"-pp{config.pp_rank}of{config.pp_size}"
    if getattr(config, "attn_cp_size", 1) > 1:
        shard += f"-cp{config.attn_cp_rank}of{config.attn_cp_size}"
    return f"sglang/{model or 'model'}/{shard}"


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
    ) -> None:
        extra = dict((storage_config.extra_config or {}) if storage_config else {})
        namespace = extra.get("kvlife_namespace") or _namespace(storage_config)
        self._owns_store = store is None
        self.store: QueuedStore = store if store is not None else _make_store(extra, namespace)
        self.timeout = timeout
        self._tokens = count()
        self._results: dict[int, StoreResult] = {}
        self._results_lock = threading.Lock()

    # -- writes

    def _put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> bool:
        """Store ``values[i]`` under ``keys[i]`` (all or none); True once all are stored."""
        unique: dict[str, torch.Tensor] = {}
        for key, value in zip(keys, values, strict=True):
            unique.setdefault(store_key(key), value)
        try:
            rows = [v.detach().contiguous().view(torch.uint8).reshape(-1) for v in unique.values()]
            if any(r.numel() != rows[0].numel() for r in rows):  # one put holds equal pages
                return all(self._put([k], [v]) for k, v in unique.items())
            token = next(self._tokens)
            self.store.put(token, list(unique), torch.stack(rows).cpu())
            result = self._wait(token)
        except (StoreError, ValueError, TypeError, RuntimeError) as exc:
            logger.warning("kvlife store refused a put of %d pages: %s", len(unique), exc)
            return False
        if not result.ok:
            logger.warning("kvlife store put of %d pages failed: %r", len(unique), result.error)
        return result.ok

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
        """Store one page; True once it is stored (or was, with the same bytes)."""
        if not isinstance(value, torch.Tensor):
            return False
        return self._put([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store every page or none; True only if all are stored."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            return False
        if not all(isinstance(v, torch.Tensor) for v in values):
            return False
        return self._put(keys, list(values))

    # -- reads

    def _read(self, keys: Sequence[str]) -> list[bytes | None]:
        names = [store_key(k) for k in keys]
        try:
            get_batch = getattr(self.store, "get_batch", None)
            if get_batch is not None:
                found: list[bytes | None] = get_batch(names)
                return found
            return [self.store.get(check_key(n)) for n in names]
        except StoreError as exc:
            logger.warning("kvlife store read of %d pages failed: %s", len(names), exc)
            return [None] * len(names)

    @staticmethod
    def _deliver(data: bytes | None, target: Any) -> torch.Tensor | None:
        if data is None:
            return None
        if target is None:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if not isinstance(target, torch.Tensor):
            return None
        if target.numel() * target.element_size() != len(data):
            return None  # a page of another size is not this page
        source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        target.copy_(source.view(target.dtype).view(target.shape))
        return target

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        """The page under ``key`` in ``target_location`` (or a new uint8 tensor); None on a miss."""
        return self._deliver(self._read([key])[0], target_location)

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """``get`` of every key, in one batched read where the store has one."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        return [self._deliver(d, t) for d, t in zip(self._read(keys), targets, strict=True)]

    def exists(self, key: str) -> bool:
        """Whether a whole, verified page is stored under ``key``."""
        return self._read([key])[0] is not None

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """The number of consecutive existing keys from the first."""
        done = 0
        for start in range(0, len(keys), EXISTS_CHUNK):
            found = self._read(keys[start : start + EXISTS_CHUNK])
            for data in found:
                if data is None:
                    return done
                done += 1
        return done

    def get_stats(self) -> Any:
        """The store's counters (``StoreStats``)."""
        return self.store.stats() if hasattr(self.store, "stats") else None

    def close(self) -> None:
        """Close the store if this backend made it."""
        if self._owns_store:
            self.store.close()
