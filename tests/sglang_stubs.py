"""The one place SGLang 0.5.23's real modules get stand-ins for imports that cannot load here.

SGLang's decode offload manager and unified-cache linker modules reach, on their way in,
packages that do not load beside the CPU torch: ``torchvision`` (the index's wheel is built
against another torch; reached through ``sglang.srt.multimodal.internvl_utils``, which only
names a few transforms at import time) and SGLang's CUDA kernel package. Everything else
those modules import is the real package (``apache-tvm-ffi``, ``transformers`` and the rest
are installed by ``.ci/sglang.sh``).

:func:`install` adds a stand-in for a module only after trying the real import first, so a
machine with the full SGLang install imports every real module and this file does nothing.
The stand-ins are listed in :data:`STAND_INS` and in docs/sglang.md; a test asserts the two
lists agree. Nothing here is SGLang code: each stand-in is an empty module whose attributes are
inert placeholders, enough for an import-time ``from x import Y`` or a module-level call, and
raising if a test ever *calls into* one.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import queue
import sys
import types
from array import array
from collections.abc import Sequence
from typing import Any

import torch

from kvlife import Lifecycle
from kvlife.engine import CpuCopyEngine
from kvlife.hashing import sglang_page_hashes
from kvlife.layout import LayerFirstLayout
from kvlife.pool import HostPagePool
from kvlife.testing import DevicePages, InlineStore

#: Top-level packages that get a stand-in when their real import fails, with why.
STAND_INS: dict[str, str] = {
    "torchvision": "the index's wheels are built against another torch and fail to load",
}

#: Modules stood in for by the last :func:`install` (empty when every real import loaded).
installed: list[str] = []


class _Inert:
    """An import-time placeholder: attribute access and calls give more placeholders."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Inert(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> Any:
        return _Inert(f"{self._name}()")

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Inert(f"{self.__name__}.{attr}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every submodule of a stood-in package (``torchvision.transforms.functional``)."""

    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: object, target: object = None) -> Any:
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> list[str]:
    """Stand in for each package of :data:`STAND_INS` whose real import fails; return them."""
    missing: set[str] = set()
    for root in STAND_INS:
        if root in sys.modules:
            continue
        try:
            importlib.import_module(root)
        except Exception:  # ImportError, or a wheel whose native part fails to load
            sys.modules.pop(root, None)
            missing.add(root)
    if missing:
        # transformers records at import which packages are installed; let it see the real
        # environment (no torchvision) before the stand-in exists, or it takes the stand-in for
        # an installed torchvision without a version.
        with contextlib.suppress(ImportError):
            importlib.import_module("transformers.utils.import_utils")
    if missing and not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder(missing))
    installed[:] = sorted(missing)
    return list(installed)


# ----------------------------------------------------------------------------- copy and storage
#
# CPU stand-ins for what SGLang's HiCacheController does on a GPU: the device -> host copy
# (kvlife's threaded CpuCopyEngine copies real pages of a real torch KV pool on its worker
# threads) and the host -> storage backup (kvlife's InlineStore). Everything else the tests
# drive is SGLang's: its Req, its ReqToTokenPool, its finish reasons, its decode offload
# manager (its own, and kvlife's subclass of it).

_CARRIER = Lifecycle("sglang-cache-controller", page_size=1)  # the engine carries tickets


class CpuFinishEvent:
    """A copy's finish event (SGLang's ``device_module.Event``): ``query``, ``synchronize``."""

    def __init__(self, controller: CpuCacheController, node_id: int) -> None:
        self._controller, self.node_id = controller, node_id

    def query(self) -> bool:
        self._controller.collect(block=False)
        return self.node_id in self._controller.completed

    def synchronize(self) -> None:
        while self.node_id not in self._controller.completed:
            self._controller.collect(block=True)


class CpuAck:
    """One entry of ``ack_write_queue`` (SGLang's ``HiCacheAck``, the fields its manager reads)."""

    def __init__(self, finish_event: CpuFinishEvent, node_ids: list[int]) -> None:
        self.finish_event, self.node_ids = finish_event, node_ids


class BackupDone:
    """One entry of ``ack_backup_queue`` (SGLang's ``StorageOperation``: its ``id``)."""

    def __init__(self, op_id: int) -> None:
        self.id = op_id


class CpuHostPool:
    """SGLang's decode host KV pool, in tokens, over kvlife's HostPagePool of pages."""

    def __init__(self, host: HostPagePool, page_size: int, owner: object) -> None:
        self.host, self.page_size, self.owner = host, page_size, owner
        self.destroyed = False

    def available_size(self) -> int:
        return self.host.num_free * self.page_size

    def pages_of(self, indices: torch.Tensor) -> list[int]:
        return [int(i) // self.page_size for i in indices[:: self.page_size].tolist()]

    def free(self, host_indices: torch.Tensor) -> None:
        self.host.free(self.pages_of(host_indices), owner=self.owner)

    def destroy(self) -> None:
        self.destroyed = True


class CpuCacheController:
    """The cache controller's copy and storage calls SGLang's decode manager makes."""

    def __init__(self, engine: CpuCopyEngine, host: HostPagePool, page_size: int) -> None:
        from sglang.srt.mem_cache.utils import get_hash_str  # SGLang's own page key

        self.engine, self.page_size = engine, page_size
        self.mem_pool_host = CpuHostPool(host, page_size, owner=self)
        self.store = InlineStore()
        self.get_hash_str = get_hash_str
        self.ack_write_queue: list[CpuAck] = []
        self.ack_backup_queue: queue.Queue[BackupDone] = queue.Queue()
        self.completed: set[int] = set()
        #: Node ids in the order this rank's engine completed them.
        self.completion_order: list[int] = []
        #: Hold each finished backup until :meth:`release_backups` (a slow storage tier: the
        #: host pages it reads come back late).
        self.hold_backups = False
        self._held_backups: list[BackupDone] = []
        self.writes = 0
        self._ops = 0
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    def write(
        self,
        device_indices: torch.Tensor,
        priority: int | None = None,
        node_id: int = -1,
        extra_pools: object = None,
    ) -> torch.Tensor | None:
        ps = self.page_size
        device_pages = [int(i) // ps for i in device_indices[::ps].tolist()]
        host_pages = self.mem_pool_host.host.alloc(len(device_pages), owner=self)
        if host_pages is None:
            return None
        ticket = (_CARRIER, node_id, ("",) * len(device_pages), 0)
        self.engine.submit(ticket, device_pages, host_pages)
        self.writes += 1
        self.ack_write_queue.append(CpuAck(CpuFinishEvent(self, node_id), [node_id]))
        pages = torch.tensor(host_pages, dtype=torch.int64)
        return (pages[:, None] * ps + self._offsets).reshape(-1)

    def collect(self, *, block: bool) -> None:
        for ack in self.engine.drain() if block else self.engine.poll():
            if ack.error is not None:
                raise ack.error
            self.completed.add(ack.ticket[1])
            self.completion_order.append(ack.ticket[1])

    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: Sequence[int],
        hash_value: list[str] | None = None,
        prefix_keys: list[str] | None = None,
        extra_pools: object = None,
    ) -> int:
        assert hash_value is not None
        self._ops += 1
        rows = self.mem_pool_host.host.tensor[self.mem_pool_host.pages_of(host_indices)]
        self.store.put(self._ops, hash_value, rows)
        for result in self.store.poll():
            if result.error is not None:
                raise result.error
        if self.hold_backups:
            self._held_backups.append(BackupDone(self._ops))
        else:
            self.ack_backup_queue.put(BackupDone(self._ops))
        return self._ops

    def release_backups(self, only: int | None = None) -> int:
        """The held backups finish now (``only``: just the one at that index, oldest first);
        how many."""
        held = self._held_backups
        chosen = held if only is None else [held[only]]
        self._held_backups = [done for done in held if done not in chosen]
        for done in chosen:
            self.ack_backup_queue.put(done)
        return len(chosen)


class TokenAllocatorStandIn:
    """The KV allocator's ``free(indices)`` over the kit's device-page accounting hook."""

    def __init__(self, device: DevicePages, page_size: int) -> None:
        self.device, self.page_size = device, page_size
        self.owner_of: dict[int, object] = {}
        self.frees = 0

    def alloc_pages(self, n: int, owner: object) -> list[int]:
        pages = self.device.alloc(n, owner=owner)
        self.owner_of.update(dict.fromkeys(pages, owner))
        return pages

    def free(self, indices: torch.Tensor) -> None:
        pages = list(dict.fromkeys((indices // self.page_size).tolist()))
        if pages:
            self.frees += 1
            owner = self.owner_of[pages[0]]
            for page in pages:
                del self.owner_of[page]
            self.device.free(pages, owner=owner)


class TreeCacheStandIn:
    """The two tree-cache calls SGLang's release makes: free a request's KV row (through the
    KV allocator's ``free``), unlock its prefix."""

    def __init__(self, rows: Any, allocator: Any) -> None:
        self.rows, self.allocator = rows, allocator

    def free_kv_row(self, kv: Any, ranges: Sequence[tuple[int, int]]) -> None:
        for start, stop in ranges:
            self.allocator.free(self.rows.req_to_token[kv.req_pool_idx, start:stop].to(torch.int64))

    def unlock(self, lock: object) -> None:
        return None


def sglang_own_manager(cls: type | None = None, **parts: object) -> Any:
    """SGLang's own DecodeKVCacheOffloadManager (or ``cls``, a subclass of it: kvlife's, whose
    kvlife half the caller then sets up with ``_init_kvlife``) on the same parts, without its
    ``__init__`` (which builds a HiCacheController from the server's config), as SGLang's
    own tests do."""
    from weakref import WeakKeyDictionary

    from sglang.srt.disaggregation.decode_kvcache_offload_manager import (
        DecodeKVCacheOffloadManager,
    )

    mgr = object.__new__(cls or DecodeKVCacheOffloadManager)
    ps = int(parts["page_size"])  # type: ignore[call-overload]
    stride = int(parts.get("stride") or ps)  # type: ignore[call-overload]
    vars(mgr).update(
        req_to_token_pool=parts["req_to_token_pool"],
        token_to_kv_pool_allocator=parts["token_to_kv_pool_allocator"],
        tree_cache=parts["tree_cache"],
        cache_controller=parts["cache_controller"],
        decode_host_mem_pool=parts["host_pool"],
        page_size=ps,
        offload_stride=max(ps, stride // ps * ps),
        request_counter=0,
        tp_group=parts.get("tp_group"),
        tp_world_size=int(parts.get("tp_world_size") or 1),  # type: ignore[call-overload]
        kv_cache=None,
        ongoing_offload={},
        ongoing_backup={},
        offloaded_state=WeakKeyDictionary(),
        offload_inflight=WeakKeyDictionary(),
    )
    return mgr


class DecodeScheduler:
    """What SGLang's decode scheduler does around its offload manager, with real SGLang
    ``Req`` objects and ``ReqToTokenPool``: each decode step ``offload_kv_cache(req)``; at
    finish ``if not offload_kv_cache(req): finalize_release_on_finish(req)``; a retraction
    ``drain_before_retraction()`` then frees the request's KV row through the allocator's
    ``free`` and ``reset_for_retract()``
    (the same Req object resumes); ``check_offload_progress()`` every iteration.

    ``kvlife=False`` builds SGLang's own manager on the same parts; ``tp_group`` and
    ``tp_world_size`` are SGLang's (a torch.distributed group of the tensor-parallel ranks)."""

    def __init__(
        self,
        *,
        kvlife: bool = True,
        page_size: int = 2,
        stride: int = 4,
        host_pages: int = 6,
        device_pages: int = 96,
        copy_delay: float = 0.0,
        delay_jitter: float = 0.0,
        workers: int = 1,
        seed: int = 0,
        tp_group: object = None,
        tp_world_size: int = 1,
        strict: bool = True,
    ) -> None:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from kvlife.integrations.sglang_decode import decode_manager_class

        self.page_size = page_size
        self.layout = LayerFirstLayout.zeros(1, device_pages, page_size, 1, 2, dtype=torch.int32)
        self.host = HostPagePool(host_pages, self.layout.page_numel, torch.int32, pin_memory=False)
        self.engine = CpuCopyEngine(
            self.layout,
            self.host,
            copy_delay=copy_delay,
            delay_jitter=delay_jitter,
            workers=workers,
            seed=seed,
        )
        self.cc = CpuCacheController(self.engine, self.host, page_size)
        self.device = DevicePages(self.layout)
        self.rows = ReqToTokenPool(
            size=64, max_context_len=512, device="cpu", enable_memory_saver=False
        )
        self.allocator = TokenAllocatorStandIn(self.device, page_size)
        self.tree = TreeCacheStandIn(self.rows, self.allocator)
        parts: dict[str, object] = dict(
            req_to_token_pool=self.rows,
            token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree,
            cache_controller=self.cc,
            host_pool=self.cc.mem_pool_host,
            page_size=page_size,
            stride=stride,
            tp_group=tp_group,
            tp_world_size=tp_world_size,
        )
        if kvlife:
            self.mgr: Any = sglang_own_manager(decode_manager_class(), **parts)
            self.mgr._init_kvlife(strict=strict)
        else:
            self.mgr = sglang_own_manager(**parts)

    # -- the request side
    def start(self, rid: str, prompt: Sequence[int]) -> Any:
        """A request admitted after its prefill: KV of every prompt token but the newest."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", prompt[:-1]), SamplingParams(max_new_tokens=1 << 20))
        req.output_ids.append(prompt[-1])
        self._admit(req)
        return req

    def resume(self, req: Any, tokens: Sequence[int]) -> Any:
        """The same Req object back after a retraction; its prefill recomputed ``tokens``."""
        req.origin_input_ids = array("q", tokens[:-1])
        req.output_ids = array("q", tokens[-1:])
        self._admit(req)
        return req

    def step(self, req: Any, tokens: Sequence[int]) -> bool:
        req.output_ids.extend(tokens)
        self._grow(req)
        return bool(self.mgr.offload_kv_cache(req))

    def finish(self, req: Any, *, abort: bool = False) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH

        req.finished_reason = FINISH_ABORT() if abort else FINISH_LENGTH(len(req.output_ids))
        if not self.mgr.offload_kv_cache(req):
            self.mgr.finalize_release_on_finish(req)

    def retract(self, req: Any) -> None:
        self.mgr.drain_before_retraction()
        self.tree.free_kv_row(req.kv, [(0, req.kv.kv_allocated_len)])
        self.rows.free(req)
        req.reset_for_retract()

    def poll(self) -> None:
        self.mgr.check_offload_progress()

    def close(self) -> None:
        try:
            self.mgr.check_offload_progress()
        finally:
            self.engine.close()

    def tokens(self, req: Any) -> list[int]:
        return list(req.origin_input_ids) + list(req.output_ids)

    # -- the device side: pages, the req-to-token row, KV written as pages become whole
    def _admit(self, req: Any) -> None:
        req.kit_pages, req.kit_keys, req.kit_written = [], [], 0
        self.rows.alloc([req])
        self._grow(req)

    def _grow(self, req: Any) -> None:
        ps = self.page_size
        tokens = self.tokens(req)
        need = -(-len(tokens) // ps) - len(req.kit_pages)
        if need > 0:
            first = len(req.kit_pages)
            new = self.allocator.alloc_pages(need, owner=req)
            req.kit_pages.extend(new)
            slots = torch.tensor(new, dtype=torch.int32)[:, None] * ps + torch.arange(ps)
            row = req.kv.req_pool_idx
            self.rows.req_to_token[row, first * ps : (first + need) * ps] = slots.reshape(-1)
        req.kv.kv_allocated_len = len(tokens)
        whole = (len(tokens) - 1) // ps
        if whole > len(req.kit_keys):
            prior = req.kit_keys[-1] if req.kit_keys else None
            chunk = tokens[len(req.kit_keys) * ps : whole * ps]
            req.kit_keys.extend(sglang_page_hashes(chunk, ps, prior))
        while req.kit_written < whole:
            self.device.write(req.kit_pages[req.kit_written], req.kit_keys[req.kit_written])
            req.kit_written += 1


def refuse_writes(controller: CpuCacheController, calls: set[int]) -> list[int]:
    """Make ``controller.write`` answer ``None`` at its ``calls``-th calls (1 is the first), as
    SGLang's ``HiCacheController.write`` does when its host pool's ``alloc`` finds no pages:
    nothing allocated, nothing queued. Returns the node ids refused, appended as they are."""
    write = controller.write
    refused: list[int] = []
    made = [0]

    def refusing(
        device_indices: torch.Tensor,
        priority: int | None = None,
        node_id: int = -1,
        extra_pools: object = None,
    ) -> torch.Tensor | None:
        made[0] += 1
        if made[0] in calls:
            refused.append(node_id)
            return None
        return write(device_indices, priority, node_id, extra_pools)

    controller.write = refusing  # type: ignore[method-assign]
    return refused


def reachable_pages(controller: CpuCacheController, keys: Sequence[str]) -> int:
    """How many of ``keys`` (a request's page keys, in page order) a prefix lookup finds
    stored: the leading run of them the store holds."""
    n = 0
    for key in keys:
        if controller.store.get(key) is None:
            break
        n += 1
    return n
