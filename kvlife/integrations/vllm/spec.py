"""The spec vLLM loads by name (``KVLifeOffloadingSpec``), its config checks and the
persistent tier's namespace."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import torch

# vLLM is an optional dependency: mypy runs without it, hence the ignores.
from vllm.config import KVTransferConfig  # type: ignore[import-not-found]
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)

from kvlife.errors import ConfigError
from kvlife.integrations.vllm._common import _SHARED_POOLS
from kvlife.integrations.vllm.metrics import METRICS
from kvlife.integrations.vllm.scheduler import KVLifeOffloadingManager
from kvlife.integrations.vllm.worker import KVLifeWorker, _block_views
from kvlife.pool import HostPagePool
from kvlife.store.directory import LocalDirectoryStore

logger = logging.getLogger(__name__)


def transfer_config(host_bytes: int, **extra: Any) -> KVTransferConfig:
    """vLLM's ``kv_transfer_config`` that switches kvlife on: the offloading connector
    with this spec, a host tier of ``host_bytes`` and any other extra-config keys."""
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "KVLifeOffloadingSpec",
            "spec_module_path": "kvlife.integrations.vllm",
            "host_bytes": host_bytes,
            **extra,
        },
    )




def store_namespace(config: Any, model_id: str | None = None) -> str:
    """The persistent tier's namespace for one model, KV cache shape and parallel rank
    (``model_id`` overrides the model name/path); the rank is a second component."""
    identity = {
        "model": model_id if model_id is not None else config.model.name,
        "dtype": str(config.model.dtype),
        "kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tokens_per_block": [g.tokens_per_block for g in config.groups],
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "layout": config.kv_cache_layout,
        "layers": [list(g.layer_names) for g in config.groups],
        "parallel": [config.parallel.world_size, config.parallel.tp_size, config.parallel.pp_size],
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return f"vllm-{digest}/rank{config.parallel.rank}"


class KVLifeOffloadingSpec(OffloadingSpec):  # type: ignore[misc]
    """The vLLM offloading spec (see :func:`transfer_config`); its extra-config keys are
    in ``docs/vllm.md``."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        kinds = {"counter": OffloadingCounterMetadata, "gauge": OffloadingGaugeMetadata}
        return {name: kinds[kind](documentation=doc) for name, (kind, doc) in METRICS.items()}

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        extra = self.extra_config
        host_bytes = extra.get("host_bytes")
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes <= 0:
            raise ConfigError(
                "kvlife: kv_connector_extra_config['host_bytes'] must be a positive int "
                f"(bytes), got {host_bytes!r}"
            )
        self.host_bytes = host_bytes
        eviction = extra.get("eviction", "lru")
        if eviction != "lru":
            raise ConfigError(f"kvlife: eviction {eviction!r} is not supported (only 'lru')")
        strict = extra.get("strict", False)
        if not isinstance(strict, bool):
            raise ConfigError(f"kvlife: strict must be a bool, got {strict!r}")
        self.strict = strict
        store_dir = extra.get("store_dir")
        self.store_dir: str | None = None if store_dir is None else os.fspath(store_dir)
        report_dir = extra.get("report_dir")
        self.report_dir: str | None = None if report_dir is None else os.fspath(report_dir)
        if len(config.groups) != 1:
            raise ConfigError(f"kvlife: one KV cache group is supported, got {len(config.groups)}")
        if self.blocks_per_chunk != 1:
            raise ConfigError(f"kvlife: blocks_per_chunk must be 1, got {self.blocks_per_chunk}")
        self.page_bytes = int(config.worker_kv_bytes_per_block)
        self.capacity = self.host_bytes // self.page_bytes
        if self.capacity < 1:
            raise ConfigError(
                f"kvlife: host_bytes {self.host_bytes} hold no block of {self.page_bytes} bytes"
            )
        model_id = extra.get("model_id")
        self.namespace = store_namespace(config, None if model_id is None else str(model_id))
        self._pool_key = f"{config.engine_id}/{config.parallel.rank}"
        self._manager: KVLifeOffloadingManager | None = None
        self._worker: KVLifeWorker | None = None

    def _open_store(self) -> LocalDirectoryStore | None:
        if self.store_dir is None:
            return None
        return LocalDirectoryStore(self.store_dir, self.namespace)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            # Single process: the worker built the pool first; allocate from that same memory.
            pool = _SHARED_POOLS.get(self._pool_key)
            if pool is not None and pool.capacity == self.capacity:
                del _SHARED_POOLS[self._pool_key]
            else:  # multiprocess: page indices here, the bytes in the worker process
                pool = HostPagePool(self.capacity, 1, torch.int8, pin_memory=False)
            self._manager = KVLifeOffloadingManager(
                pool, strict=self.strict, disk=self._open_store(), report_dir=self.report_dir
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            row = sum(int(view.shape[1]) for view in _block_views(kv_caches))
            pool = HostPagePool(self.capacity, row, torch.int8)
            _SHARED_POOLS[self._pool_key] = pool
            self._worker = KVLifeWorker(
                kv_caches,
                pool,
                store=self._open_store(),
                report_dir=self.report_dir,
                pool_key=self._pool_key,
                tokens_per_block=self.tokens_per_block[0],
            )
        return self._worker
