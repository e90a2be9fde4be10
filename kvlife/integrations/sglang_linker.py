"""An SGLang ``UnifiedCacheLinker`` (SGLang #40595) backed by kvlife.

SGLang's unified radix cache reaches an external KV store through a linker whose
completions carry no identity (a count, and ``pop_completed_offload()`` oldest first) and
whose loads are cancelled by rid. Here every load and every offload is a kvlife
:class:`~kvlife.Lifecycle` of its own: a load is ``Lifecycle.load`` (a ``LoadTicket``), an
offload a chunk ``Ticket``; the copy engine's ack carries the ticket, so a late completion
can only settle its own life, and ``cancel_queued_load(rid)`` can only reach the rid's
*current* queued load, never one already started for an earlier request on that rid. An
offload is reported complete (in submission order) only after its device -> host copy was
acked and the store answered; lookups read the store, where a key still being written is
not a hit.

Load it from SGLang's own factory::

    --unified-cache-external-linker-config '{"linker": "KVLifeCacheLinker",
      "linker_module_path": "kvlife.integrations.sglang_linker",
      "linker_extra_config": {"store": "directory", "store_dir": "/path", "host_pages": 4096}}'

``linker_extra_config``: ``store`` (``"directory"``, default, with ``store_dir`` and
``namespace``; or ``"memory"``), ``host_pages`` (host pages for copies in flight),
``strict`` (raise kvlife refusals instead of counting them). See docs/sglang.md.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

import torch

from kvlife._lifecycle import FinishReason, Lifecycle, LoadTicket, Ticket
from kvlife.engine.base import Ack
from kvlife.errors import ConfigError, KVLifeError, ManagerError
from kvlife.layout import LayerFirstLayout
from kvlife.pool import HostPagePool

__all__ = ["linker_class"]  # and KVLifeCacheLinker, made on first use (it subclasses SGLang's)

logger = logging.getLogger(__name__)


class _Op:
    """One load or offload: its life, ticket, pages, and (offloads) its result."""

    __slots__ = ("device", "host", "keys", "lc", "result", "rid", "ticket")

    def __init__(self, rid: str, lc: Lifecycle, keys: list[str], device: list[int]) -> None:
        self.rid, self.lc, self.keys, self.device = rid, lc, keys, device
        self.ticket: Ticket | LoadTicket | None = None
        self.host: list[int] = []
        self.result: bool | None = None


class _KVLifeCacheLinker:
    """The kvlife half of ``KVLifeCacheLinker`` (no SGLang import here)."""

    layer_done_counter: Any
    pools: dict[Any, object]
    forward_stream: Any

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
        self.strict = bool(cfg.get("strict", False))
        kv = params.token_to_kv_pool_allocator.get_kvcache()
        self.layout = LayerFirstLayout(list(kv.k_buffer), list(kv.v_buffer), self.page_size)
        self.host = HostPagePool(
            int(cfg.get("host_pages", 1024)), self.layout.page_numel, self.layout.dtype
        )
        self.engine = _engine(self.layout, self.host)
        self.store = _store(cfg)
        self._kv_pool = PoolName.KV
        self.pools = {PoolName.KV: kv}
        self.layer_done_counter = LayerWiseLoadCounter(self.layout.num_layers)
        #: Refusals by kind (counted and logged; raised with ``strict``).
        self.refusals: Counter[str] = Counter()
        self._queued: dict[str, _Op] = {}  # rid -> its current life's load, not started
        self._batches: dict[int, list[_Op]] = {}  # counter index -> loads started together
        self._offloads: deque[_Op] = deque()  # submission order; reported oldest first
        self._by_life: dict[Lifecycle, _Op] = {}  # ops in flight, by the life their ack names
        self._storing: dict[int, _Op] = {}  # store token -> offload being written

    # ------------------------------------------------------------ lookups and loads

    def lookup(self, rid: str, transfers: list[Any]) -> list[int]:
        """Every prefix length (pages) whose pages are all in the store."""
        keys = self._kv(transfers).keys or []
        self._progress()
        n = 0
        for key in keys:
            if not self.store.contains(key):
                break
            n += 1
        return list(range(1, n + 1))

    def load(self, rid: str, transfers: list[Any]) -> bool:
        """Queue a load of the stored pages into the transfer's device indices (a new life)."""
        try:
            kv = self._kv(transfers)
            keys = list(kv.keys or [])
            device = self._pages(kv.device_indices)
            if rid in self._queued:
                raise ManagerError(f"a load for rid {rid!r} is already queued")
            if not keys or len(keys) != len(device):
                raise ManagerError(f"{len(keys)} keys for {len(device)} device pages")
            lc = Lifecycle(rid, page_size=self.page_size)
            op = _Op(rid, lc, keys, device)
            op.ticket = lc.load(keys)
        except KVLifeError as exc:
            return self._refused("load", exc)
        self._queued[rid] = op
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        """Cancel the rid's current load if it has not started; never touches a started one."""
        op = self._queued.pop(rid, None)
        if op is None:
            return False
        assert op.ticket is not None
        op.lc.ack(op.ticket)  # it never ran: settled, and the life released
        op.lc.finish(FinishReason.ABORTED)
        return True

    def start_layer_wise_loading(self) -> int:
        """Start every queued load: stored pages into host pages, then host -> device."""
        index = int(self.layer_done_counter.update_producer())
        ops, self._queued = list(self._queued.values()), {}
        started: list[_Op] = []
        for op in ops:
            if self._start_load(op):
                started.append(op)
        self._batches[index] = started
        # The batch lands before the forward reads it: wait for its copies here, then every
        # layer is ready (a layer-wise engine would complete layers as they land).
        self._progress(wait=True)
        landed = all(op.result for op in started)
        for layer in range(self.layout.num_layers):
            if landed:
                self.layer_done_counter.complete(index, layer)
        if not landed:
            self.layer_done_counter.fail(index, RuntimeError("a kvlife load failed"))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        """True when every load of the batch ``counter_index`` landed in device memory."""
        ops = self._batches.pop(counter_index, [])
        ok = bool(self.layer_done_counter.finish(counter_index))
        return ok and all(op.result for op in ops)

    # ------------------------------------------------------------ offloads

    def offload(self, transfers: list[Any], session_id: str | None = None) -> bool:
        """Queue a device -> host -> store copy of the transfer's pages under its keys."""
        try:
            kv = self._kv(transfers)
            keys = list(kv.keys or [])
            device = self._pages(kv.device_indices)
            if not keys or len(keys) != len(device):
                raise ManagerError(f"{len(keys)} keys for {len(device)} device pages")
            host = self.host.alloc(len(device), owner=self)
            if host is None:
                self.refusals["host_pool_exhausted"] += 1
                return False
            given = tuple(keys)
            lc = Lifecycle(
                session_id or "offload",
                page_size=self.page_size,
                hasher=lambda tokens, page_size, prior: list(given),
            )
            op = _Op(lc.rid if isinstance(lc.rid, str) else "", lc, keys, device)
            op.host = host
            ticket = lc.submit([0] * (len(keys) * self.page_size))
            lc.finish(FinishReason.FINISHED)  # released at the ack
            op.ticket = ticket
            self.engine.submit(ticket, device, host)
        except KVLifeError as exc:
            return self._refused("offload", exc)
        self._by_life[lc] = op
        self._offloads.append(op)
        return True

    def num_completed_offloads(self) -> int:
        """Offloads whose copy finished and whose store write answered, oldest first."""
        self._progress()
        n = 0
        for op in self._offloads:
            if op.result is None:
                break
            n += 1
        return n

    def pop_completed_offload(self) -> bool:
        """Consume the oldest completed offload; its result (False if none is complete)."""
        if not self._offloads or self._offloads[0].result is None:
            self._refused("pop", ManagerError("no completed offload to pop"))
            return False
        return bool(self._offloads.popleft().result)

    # ------------------------------------------------------------ lifecycle

    def reset(self) -> None:
        """Wait for every copy and write, cancel queued loads, forget completed offloads."""
        for rid in list(self._queued):
            self.cancel_queued_load(rid)
        self._progress(wait=True)
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

    # ------------------------------------------------------------ internals

    def _kv(self, transfers: Sequence[Any]) -> Any:
        for transfer in transfers:
            if transfer.name == self._kv_pool:
                return transfer
        raise ManagerError("no KV pool transfer (kvlife's linker serves the KV pool)")

    def _pages(self, indices: Any) -> list[int]:
        if indices is None:
            return []
        ps = self.page_size
        return [int(i) // ps for i in torch.as_tensor(indices)[::ps].tolist()]

    def _start_load(self, op: _Op) -> bool:
        host = self.host.alloc(len(op.keys), owner=self)
        pages = [self.store.get(key) for key in op.keys]
        if host is None or any(page is None for page in pages):
            if host is not None:
                self.host.free(host, owner=self)
            op.result = False
            self._settle(op)
            return True
        for page, data in zip(host, pages, strict=True):
            assert data is not None
            self.host.tensor[page].view(torch.uint8).copy_(
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
            )
        op.host = host
        assert op.ticket is not None
        self.engine.submit(op.ticket, op.device, host)
        self._by_life[op.lc] = op
        return True

    def _progress(self, wait: bool = False) -> None:
        acks = self.engine.drain() if wait else self.engine.poll()
        for ack in acks:
            self._on_ack(ack)
        results = self.store.drain() if wait else self.store.poll()
        for result in results:
            op = self._storing.pop(result.token)
            self.host.free(op.host, owner=self)
            op.result = result.ok

    def _on_ack(self, ack: Ack) -> None:
        op = self._by_life.pop(ack.ticket[0], None)  # the life the ack names, nothing else
        if op is None:
            self._refused("ack", ManagerError(f"an ack of no copy in flight: {ack.ticket[:2]!r}"))
            return
        if ack.is_load:
            self.host.free(op.host, owner=self)
            op.result = ack.ok
            self._settle(op)
            return
        op.lc.ack(op.ticket)  # type: ignore[arg-type]  # the device copy is done: released
        if not ack.ok:
            self.host.free(op.host, owner=self)
            op.result = False
            return
        token = id(op)
        self._storing[token] = op
        self.store.put(token, op.keys, self.host.tensor[op.host])

    def _settle(self, op: _Op) -> None:
        assert op.ticket is not None
        op.lc.ack(op.ticket)
        op.lc.finish(FinishReason.FINISHED if op.result else FinishReason.ABORTED)

    def _refused(self, kind: str, exc: KVLifeError) -> bool:
        self.refusals[kind] += 1
        if self.strict:
            raise exc
        logger.error("kvlife linker refused %s: %s", kind, exc)
        return False


def _engine(layout: LayerFirstLayout, host: HostPagePool) -> Any:
    if layout.device.type == "cuda":
        from kvlife.engine import CudaCopyEngine

        return CudaCopyEngine(layout, host)
    from kvlife.engine import CpuCopyEngine

    return CpuCopyEngine(layout, host)


def _store(cfg: dict[str, Any]) -> Any:
    kind = cfg.get("store", "directory")
    if kind == "memory":
        from kvlife.store import MemoryStore

        return MemoryStore()
    if kind == "directory":
        from kvlife.store import LocalDirectoryStore

        if "store_dir" not in cfg:
            raise ConfigError("linker_extra_config needs store_dir for the directory store")
        return LocalDirectoryStore(str(cfg["store_dir"]), str(cfg.get("namespace", "sglang")))
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
