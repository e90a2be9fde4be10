"""An SGLang ``UnifiedCacheLinker`` (SGLang #40595) backed by kvlife (docs/sglang.md,
"The unified-cache linker": its config, namespaces and the contract kept).

Every load and every offload is a small record (:class:`_Op`) that owns its one ticket, so a
late completion settles only its own operation; the copies go through kvlife's one pipeline
(:class:`~kvlife.transfers.Transfers`). Load it from SGLang's own factory::

    --unified-cache-external-linker-config '{"linker": "KVLifeCacheLinker",
      "linker_module_path": "kvlife.integrations.sglang_linker",
      "linker_extra_config": {"store": "directory", "store_dir": "/path", "host_pages": 4096}}'
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from kvlife._lifecycle import LoadTicket, Ticket
from kvlife.engine import Ack, CpuCopyEngine, CudaCopyEngine
from kvlife.errors import ConfigError, DuplicateAck, EngineError, KVLifeError, ManagerError
from kvlife.host_tier import HostTier
from kvlife.layout import LayerFirstLayout
from kvlife.pool import HostPagePool
from kvlife.refusals import Refusals
from kvlife.store.base import StoreResult
from kvlife.transfers import Transfers

__all__ = ["linker_class"]  # and KVLifeCacheLinker, made on first use (it subclasses SGLang's)

logger = logging.getLogger(__name__)


class _Op:
    """One load or offload: the owner of its one ticket, its pages, and its result."""

    __slots__ = ("device", "inflight", "keys", "result", "rid", "ticket")

    def __init__(self, rid: str, keys: list[str], device: list[int], load: bool) -> None:
        self.rid, self.keys, self.device = rid, keys, device
        self.ticket: Ticket | LoadTicket = (
            LoadTicket(self, 0, tuple(keys)) if load else (self, 0, tuple(keys), 0)
        )
        #: 1 while its copy is in flight (what the pipeline reads), else 0.
        self.inflight = 0
        #: None until known; then whether the load landed, or the offload was stored.
        self.result: bool | None = None

    def ack(self, ticket: Any) -> None:
        """Settle the copy in flight; any other ticket is refused and changes nothing."""
        if ticket is not self.ticket or not self.inflight:
            raise DuplicateAck(
                f"linker {'load' if type(ticket) is LoadTicket else 'offload'} of rid "
                f"{self.rid!r} has no copy in flight for this ticket",
                event="ack",
                state=None,
                rid=self.rid,
                ident=id(self),
            )
        self.inflight = 0


class _KVLifeCacheLinker:
    """The kvlife half of ``KVLifeCacheLinker`` (no SGLang import here)."""

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any = None,
        extra_config: dict[str, Any] | None = None,
        forward_stream: Any = None,
    ) -> None:
        from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
            PoolName,
        )
        from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
            LayerWiseLoadCounter,
        )

        cfg = dict(extra_config or {})
        self.page_size = int(params.page_size)
        self.forward_stream = forward_stream
        #: Refusals by kind (counted and logged; raised with ``strict``).
        self.refusals = Refusals(strict=bool(cfg.get("strict", False)), logger=logger)
        kv = params.token_to_kv_pool_allocator.get_kvcache()
        self.layout = LayerFirstLayout(list(kv.k_buffer), list(kv.v_buffer), self.page_size)
        self.host = HostPagePool(
            int(cfg.get("host_pages", 1024)), self.layout.page_numel, self.layout.dtype
        )
        engine = CudaCopyEngine if self.layout.device.type == "cuda" else CpuCopyEngine
        self.engine = engine(self.layout, self.host)
        self.namespace = linker_namespace(cfg, server_args, params)
        self.store = _store(cfg, self.namespace)
        #: Loaded pages stay here (evicted for room), pinned while a load reads them.
        self.tier: HostTier[str] = HostTier(self.host, refusals=self.refusals)
        self.transfers = Transfers(
            self.engine,
            self.host,
            self.store,
            refusals=self.refusals,
            tier=self.tier,
            acked=self._acked,
            stored=self._stored,
        )
        self._kv_pool = PoolName.KV
        self.pools = {PoolName.KV: kv}
        self.layer_done_counter = LayerWiseLoadCounter(self.layout.num_layers)
        self._queued: dict[str, _Op] = {}  # rid -> its current life's load, not started
        self._batches: dict[int, list[_Op]] = {}  # counter index -> loads started together
        self._offloads: deque[_Op] = deque()  # submission order; reported oldest first
        #: Offloads declined because the host pool was full (SGLang offers them again).
        self.host_pool_exhausted = 0

    def lookup(self, rid: str, transfers: list[Any]) -> list[int]:
        """Every prefix length (pages) whose pages are all in the store."""
        try:
            keys = self._kv(transfers).keys or []
        except KVLifeError as exc:
            self.refusals.refuse("lookup", exc)
            return []
        self.transfers.poll()
        in_store = self.transfers.in_store
        n = next((i for i, key in enumerate(keys) if not in_store(key)), len(keys))
        return list(range(1, n + 1))

    def load(self, rid: str, transfers: list[Any]) -> bool:
        """Queue a load of the stored pages into the transfer's device indices."""
        try:
            keys, device = self._keys_and_pages(transfers)
            if rid in self._queued:
                raise ManagerError(f"a load for rid {rid!r} is already queued")
        except KVLifeError as exc:
            self.refusals.refuse("load", exc)
            return False
        self._queued[rid] = _Op(rid, keys, device, load=True)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        """Cancel the rid's current load if it has not started; never touches a started one."""
        return self._queued.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        """Start every queued load: stored pages into host pages, then host -> device."""
        index = int(self.layer_done_counter.update_producer())
        ops, self._queued = list(self._queued.values()), {}
        for op in ops:
            self._start_load(op)
        self._batches[index] = ops
        # The batch lands before the forward reads it: wait for its copies here, then every
        # layer is ready (a layer-wise engine would complete layers as they land).
        self.transfers.drain()
        if all(op.result for op in ops):
            for layer in range(self.layout.num_layers):
                self.layer_done_counter.complete(index, layer)
        else:
            self.layer_done_counter.fail(index, RuntimeError("a kvlife load failed"))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        """True when every load of the batch ``counter_index`` landed in device memory."""
        ops = self._batches.pop(counter_index, [])
        ok = bool(self.layer_done_counter.finish(counter_index))
        return ok and all(op.result for op in ops)

    def offload(self, transfers: list[Any], session_id: str | None = None) -> bool:
        """Queue a device -> host -> store copy of the transfer's pages under its keys."""
        try:
            keys, device = self._keys_and_pages(transfers)
            op = _Op(session_id or "offload", keys, device, load=False)
            n = len(device)
            host = self.host.alloc(n, owner=op)
            if host is None and self.tier.make_room(n):  # evict loaded pages kept
                host = self.host.alloc(n, owner=op)
            if host is None:  # host pressure, not a refusal: counted, never raised
                self.host_pool_exhausted += 1
                return False
            try:
                self.transfers.submit(op.ticket, device, host, checked=False)
            except EngineError:
                self.host.free(host, owner=op)  # refused: nothing copies, nothing leaks
                raise
        except KVLifeError as exc:
            self.refusals.refuse("offload", exc)
            return False
        op.inflight = 1
        self._offloads.append(op)
        return True

    def num_completed_offloads(self) -> int:
        """Offloads whose copy finished and whose store write answered, oldest first."""
        self.transfers.poll()
        ops = self._offloads
        return next((i for i, op in enumerate(ops) if op.result is None), len(ops))

    def pop_completed_offload(self) -> bool:
        """Consume the oldest completed offload; its result (False if none is complete)."""
        if not self._offloads or self._offloads[0].result is None:
            self.refusals.refuse("pop", ManagerError("no completed offload to pop"))
            return False
        return bool(self._offloads.popleft().result)

    def reset(self) -> None:
        """Wait for every copy and write, cancel queued loads, forget completed offloads."""
        self._queued.clear()
        self.transfers.drain()
        self._offloads.clear()
        self._batches.clear()
        self.layer_done_counter.reset()

    def close(self) -> None:
        """Reset, then shut the engine and the store down."""
        try:
            self.reset()
        finally:
            self.engine.close()
            self.store.close()

    def _kv(self, transfers: Sequence[Any]) -> Any:
        for transfer in transfers:
            if transfer.name == self._kv_pool:
                return transfer
        raise ManagerError("no KV pool transfer (kvlife's linker serves the KV pool)")

    def _keys_and_pages(self, transfers: Sequence[Any]) -> tuple[list[str], list[int]]:
        kv = self._kv(transfers)
        keys = list(kv.keys or [])
        indices = kv.device_indices
        ps = self.page_size
        device = (
            []
            if indices is None
            else [int(i) // ps for i in torch.as_tensor(indices)[::ps].tolist()]
        )
        if not keys or len(keys) != len(device):
            raise ManagerError(f"{len(keys)} keys for {len(device)} device pages")
        return keys, device

    def _start_load(self, op: _Op) -> None:
        """Promote every page of the load into the host tier (pinned), then copy them to
        the device; a page missing, damaged or of another size fails the load, counted."""
        tier = self.tier
        pages = self.transfers.pin_for_load(op.keys)
        if len(pages) < len(op.keys):
            tier.complete_load(op.keys[: len(pages)])
            op.result = False
            key = op.keys[len(pages)]
            self.refusals.refuse(
                "load_miss", ManagerError(f"page {key[:16]} is not a whole page in the store")
            )
            return
        try:
            self.transfers.submit(op.ticket, op.device, pages, checked=False)
        except EngineError as exc:
            tier.complete_load(op.keys)
            op.result = False
            self.refusals.refuse("load", exc)
            return
        op.inflight = 1

    def _acked(self, op: object, ack: Ack) -> None:
        """A copy settled: a load landed or not; a failed offload copy is over."""
        assert isinstance(op, _Op)
        if ack.is_load or not ack.ok:
            op.result = ack.ok

    def _stored(self, op: object, result: StoreResult) -> None:
        assert isinstance(op, _Op)
        op.result = result.ok


def linker_namespace(cfg: dict[str, Any], server_args: Any, params: Any) -> str:
    """``<namespace>/<model>/tp<r>of<n>[-pp..][-cp..]``: one namespace per model and rank,
    so no rank reads another rank's shard or another model's pages."""
    from kvlife.integrations.sglang import _model_component, _shard

    prefix = str(cfg.get("namespace", "sglang-linker"))
    model = _model_component(getattr(server_args, "model_path", None))
    group, rank, size = getattr(params, "tp_cache_group", None), 0, 1
    if group is not None and torch.distributed.is_initialized():
        rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    return f"{prefix}/{model}/{_shard(f'tp{rank}of{size}', params, ('pp', 'attn_cp'))}"


def _store(cfg: dict[str, Any], namespace: str) -> Any:
    kind = cfg.get("store", "directory")
    if kind == "memory":
        from kvlife.store import MemoryStore

        return MemoryStore()
    if kind == "directory":
        from kvlife.store import LocalDirectoryStore

        if "store_dir" not in cfg:
            raise ConfigError("linker_extra_config needs store_dir for the directory store")
        return LocalDirectoryStore(str(cfg["store_dir"]), namespace)
    raise ConfigError(f"linker_extra_config store must be 'directory' or 'memory': {kind!r}")


def linker_class() -> type:
    """``KVLifeCacheLinker``: a subclass of SGLang's ``UnifiedCacheLinker`` (imports SGLang)."""
    from kvlife.integrations.sglang_decode import sglang_subclass

    return sglang_subclass(
        _KVLifeCacheLinker,
        "sglang.srt.mem_cache.unified_cache.unified_cache_linker",
        "UnifiedCacheLinker",
        "KVLifeCacheLinker",
        __name__,
    )


def __getattr__(name: str) -> Any:
    if name == "KVLifeCacheLinker":  # what SGLang's factory looks up by name
        return linker_class()
    raise AttributeError(name)
