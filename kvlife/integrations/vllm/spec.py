"""The spec vLLM loads by name (``KVLifeOffloadingSpec``), its config checks and the
persistent tier's namespace."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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

from kvlife._checks import positive_int
from kvlife.errors import ConfigError
from kvlife.integrations.checkpoint import checkpoint_fingerprint
from kvlife.integrations.vllm._common import PersistentTier, shut_down
from kvlife.integrations.vllm.scheduler import CONFIG_INFO_KEYS, METRICS, KVLifeOffloadingManager
from kvlife.integrations.vllm.shared_pool import SharedHostPool
from kvlife.integrations.vllm.worker import KVLifeWorker, host_row_bytes
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


def _bad(key: str, value: object, why: str) -> ConfigError:
    return ConfigError(f"kvlife: kv_connector_extra_config[{key!r}] = {value!r}: {why}")


def _memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def _directory(extra: Mapping[str, Any], key: str, *, make: bool) -> str | None:
    """A directory key: None, or a non-empty path that can be written, checked now so an
    unwritable one fails at start, not at shutdown (``make``: the directory is made now;
    otherwise nothing is created: the store makes it later, with its mode)."""
    value = extra.get(key)
    if value is None:
        return None
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise _bad(key, value, "must be a path (str or os.PathLike)")
    path = os.fspath(value)
    if not isinstance(path, str) or not path.strip():
        raise _bad(key, value, "must be a non-empty path (an unset variable?)")
    # The path is a directory, or its nearest existing parent is one; either takes a file
    # (an unnamed one, gone when closed, so nothing is left there).
    existing = os.path.abspath(path)
    try:
        if make:
            os.makedirs(path, exist_ok=True)
        while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            where = "is not a directory" if existing == os.path.abspath(path) else "is under a file"
            raise _bad(key, value, f"{where} ({existing!r})")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise _bad(key, value, f"cannot be written ({exc.strerror or exc})") from None
    return path


@dataclass(frozen=True, slots=True)
class Settings:
    """The extra-config keys, each checked at start (``docs/vllm.md`` lists them)."""

    host_bytes: int
    store_dir: str | None = None
    report_dir: str | None = None
    strict: bool = False
    model_id: str | None = None
    pending_timeout: float | None = None
    store: str = "directory"
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None

    @classmethod
    def of(cls, extra: Mapping[str, Any]) -> Settings:
        """Parse vLLM's ``kv_connector_extra_config``; a ``ConfigError`` names the first bad
        key and its value, before anything is built."""
        host_bytes = extra.get("host_bytes")
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes <= 0:
            raise _bad("host_bytes", host_bytes, "must be a positive int (bytes)")
        memory = _memory_bytes()
        if memory is not None and host_bytes > memory:
            raise _bad("host_bytes", host_bytes, f"is more than this machine's {memory} B")
        strict = extra.get("strict", False)
        if not isinstance(strict, bool):
            raise _bad("strict", strict, "must be a bool")
        prompt_only = extra.get("offload_prompt_only", True)  # vLLM's key: bool() of any value
        if not isinstance(prompt_only, bool):
            raise _bad(
                "offload_prompt_only", prompt_only, "must be a bool (False: decoded blocks too)"
            )
        model_id = extra.get("model_id")
        if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
            raise _bad("model_id", model_id, "must be a non-empty str")
        timeout = extra.get("pending_timeout")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout < float("inf")
        ):
            raise _bad("pending_timeout", timeout, "must be a positive number of seconds")
        store = extra.get("store", "directory")
        if store not in ("directory", "mooncake"):
            raise _bad("store", store, "must be 'directory' (store_dir) or 'mooncake'")
        mooncake: dict[str, str | None] = {}
        for key in ("mooncake_master", "mooncake_metadata"):
            value = extra.get(key)
            if store == "mooncake" and (not isinstance(value, str) or not value.strip()):
                raise _bad(key, value, "is required with store='mooncake' (a non-empty str)")
            if store != "mooncake" and value is not None:
                raise _bad(key, value, "is only read with store='mooncake'")
            mooncake[key] = value
        if store == "mooncake" and extra.get("store_dir") is not None:
            raise _bad("store_dir", extra["store_dir"], "is not read with store='mooncake'")
        return cls(
            store=store,
            mooncake_master=mooncake["mooncake_master"],
            mooncake_metadata=mooncake["mooncake_metadata"],
            host_bytes=host_bytes,
            store_dir=_directory(extra, "store_dir", make=False),
            report_dir=_directory(extra, "report_dir", make=True),
            strict=strict,
            model_id=model_id,
            pending_timeout=None if timeout is None else float(timeout),
        )


def weights_fingerprint(model: str) -> dict[str, Any]:
    """The checkpoint fingerprint of ``model`` (:func:`kvlife.integrations.checkpoint.
    checkpoint_fingerprint`) at the hub revision vLLM was asked for, looked up where vLLM
    downloads (its ``download_dir``, when its config is current); a checkpoint kvlife cannot
    find on this machine is known by name and revision only, and says so (a warning)."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
    except ImportError:
        current = None
    revision = getattr(getattr(current, "model_config", None), "revision", None)
    revision = revision if isinstance(revision, str) else None
    download_dir = getattr(getattr(current, "load_config", None), "download_dir", None)
    download_dir = download_dir if isinstance(download_dir, str) and download_dir else None
    found = checkpoint_fingerprint(model, revision, cache_dir=download_dir)
    if found["files"] is None:
        logger.warning(
            "kvlife: no checkpoint of %r found on this machine (a directory, a file or a hub "
            "snapshot): the persistent tier knows its weights by name and revision (%r) "
            "only, and new weights under that name are not detected; set model_id to a "
            "version you change with the weights",
            model,
            revision,
        )
    return found


def store_namespace(
    config: Any, model_id: str | None = None, weights: Mapping[str, Any] | None = None
) -> str:
    """The persistent tier's namespace for one checkpoint, KV cache shape and parallel rank:
    ``weights`` is the checkpoint's :func:`checkpoint_fingerprint` (None: the model name
    alone identifies it); ``model_id`` overrides both, for sharing or invalidating a cache
    on purpose. The rank is a second component."""
    identity = {
        "model": model_id if model_id is not None else config.model.name,
        "weights": None if model_id is not None else weights,
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

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33+: the labels the manager's ``config_info()`` fills (vLLM publishes
        only the labels the spec names)."""
        return CONFIG_INFO_KEYS

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        settings = Settings.of(self.extra_config)
        self.settings = settings
        self.host_bytes = settings.host_bytes
        self.store_dir = settings.store_dir
        self.report_dir = settings.report_dir
        if not config.groups:
            raise ConfigError("kvlife: vLLM offers no KV cache group to offload")
        bpc = positive_int("kvlife: blocks_per_chunk", self.blocks_per_chunk)
        # One host page a key, whatever its group: a chunk of blocks_per_chunk blocks of the
        # backing allocation (each group's layers overlay it), from one pool for all groups.
        self.page_bytes = int(config.worker_kv_bytes_per_block) * bpc
        self.capacity = self.host_bytes // self.page_bytes if self.page_bytes > 0 else 0
        if self.capacity < 1:
            raise ConfigError(
                f"kvlife: host_bytes {self.host_bytes} hold no chunk of {self.page_bytes} bytes"
            )
        weights = weights_fingerprint(str(config.model.name)) if settings.model_id is None else None
        self.namespace = store_namespace(config, settings.model_id, weights)
        base, _ = self.namespace.rsplit("/", 1)
        #: Every rank's namespace (the scheduler side checks each one's page before a hit).
        self.rank_namespaces = [f"{base}/rank{r}" for r in range(config.parallel.world_size)]
        self._pool_key = f"{config.engine_id}/{config.parallel.rank}"
        self._engine = f"{config.engine_id}/dp{getattr(config.parallel, 'data_parallel_index', 0)}"
        self._rank = int(config.parallel.rank)
        self._world_size = int(config.parallel.world_size)
        self._manager: KVLifeOffloadingManager | None = None
        self._worker: KVLifeWorker | None = None

    def _open_store(self, namespace: str | None = None) -> PersistentTier | None:
        settings = self.settings
        if settings.store == "mooncake":
            from kvlife.store.mooncake import MooncakeStore

            assert settings.mooncake_master and settings.mooncake_metadata  # checked at start
            return MooncakeStore(
                settings.mooncake_master, settings.mooncake_metadata, namespace or self.namespace
            )
        if self.store_dir is None:
            return None
        return LocalDirectoryStore(self.store_dir, namespace or self.namespace)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            # The persistent tier first: an unusable one (a store_dir that cannot be made, an
            # unreachable Mooncake master) is refused before a pool is taken or mapped, and
            # every worker's shared pool is unlinked (no process maps it any more).
            stores: list[PersistentTier] = []  # this rank's first, then the others'
            try:
                others = [ns for ns in self.rank_namespaces if ns != self.namespace]
                for ns in (self.namespace, *others):
                    if (store := self._open_store(ns)) is not None:
                        stores.append(store)
                self._manager = self._build_manager(stores)
            except BaseException:
                steps = [(f"close {s.namespace}", s.close) for s in stores]
                steps.append(("unlink", self._unlink_shared))
                shut_down("manager start", steps)
                raise
        return self._manager

    def _build_manager(self, stores: list[PersistentTier]) -> KVLifeOffloadingManager:
        pool: HostPagePool | None = None
        rank_pools: list[HostPagePool] = []
        built = SharedHostPool.offered(self._pool_key)
        if built is not None and built.pool.capacity == self.capacity:
            built.withdraw(self._pool_key)  # one process: the worker's pool, taken for here
            pool = built.pool
            built.unlink()  # mapped here already: the name may go
        elif (shared := self._attach_workers()) is not None:  # every rank's worker shared its
            pool, rank_pools = shared.pop(self._rank), shared
        holds_bytes = pool is not None
        if pool is None:  # page indices here, the bytes in the worker processes
            pool = HostPagePool(self.capacity, 1, torch.int8, pin_memory=False)
        return KVLifeOffloadingManager(
            pool,
            strict=self.settings.strict,
            disk=stores[0] if stores else None,
            report_dir=self.report_dir,
            pending_timeout=self.settings.pending_timeout,
            holds_bytes=holds_bytes,
            other_ranks=stores[1:],
            rank_pools=rank_pools,
            page_bytes=self.page_bytes,
        )

    def _unlink_shared(self) -> None:
        """Remove the names of the shared pools this engine's workers made for this process
        (a failed start: nobody maps them now; mappings already made stay valid)."""
        built = SharedHostPool.offered(self._pool_key)
        if built is not None:
            built.unlink()
        if self._has_store():
            for r in range(self._world_size):  # each worker is a child of this process
                SharedHostPool.discard(SharedHostPool.path_for(self._engine, os.getpid(), r))

    def _has_store(self) -> bool:
        return self.settings.store == "mooncake" or self.store_dir is not None

    def _attach_workers(self) -> list[HostPagePool] | None:
        """Map every rank's shared host pool (vLLM's multiprocess executor: the workers are
        this process's children and shared theirs before the scheduler starts); None unless
        every rank's is there. The names go at once: the mappings stay, nothing is left in
        shared memory if a process dies."""
        if not self._has_store():
            return None
        paths = [
            SharedHostPool.path_for(self._engine, os.getpid(), r) for r in range(self._world_size)
        ]
        pools = [SharedHostPool.attach(path, self.capacity, self.page_bytes) for path in paths]
        if any(pool is None for pool in pools):
            if any(pool is not None for pool in pools):
                logger.warning("kvlife: not every rank shared its host tier: the workers read")
            return None
        logger.info("kvlife: host tier shared with %d worker(s): a hit is host bytes", len(pools))
        return [pool for pool in pools if pool is not None]

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            row = host_row_bytes(kv_caches, self.blocks_per_chunk)
            store = self._open_store()  # first, as in get_manager: before the host tier
            shared: SharedHostPool | None = None
            try:
                device = kv_caches.tensors[0].tensor.device.type
                if store is not None and device in ("cpu", "cuda"):
                    # Shared with the scheduler process, so it promotes persistent-tier pages
                    # into host memory itself; for a KV cache on CUDA, page-locked as well.
                    path = SharedHostPool.path_for(self._engine, os.getppid(), self._rank)
                    shared = SharedHostPool.create(path, self.capacity, row, lock=device == "cuda")
                if shared is None:
                    shared = SharedHostPool(HostPagePool(self.capacity, row, torch.int8))
                shared.offer(self._pool_key)
                self._worker = KVLifeWorker(
                    kv_caches,
                    shared,
                    store=store,
                    report_dir=self.report_dir,
                    strict=self.settings.strict,
                    pool_key=self._pool_key,
                    tokens_per_block=self.tokens_per_block,
                    blocks_per_chunk=self.blocks_per_chunk,
                )
            except BaseException:  # a failed start leaves nothing: no name, lock or offer
                steps: list[tuple[str, Callable[[], object]]] = []
                if shared is not None:
                    steps += [
                        ("unshare", lambda: shared.withdraw(self._pool_key)),
                        ("unpin_unlink", shared.close),
                    ]
                if store is not None:
                    steps.append(("store_close", store.close))
                shut_down("worker start", steps)
                raise
        return self._worker
