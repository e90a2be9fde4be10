"""kvlife's UnifiedCacheLinker, loaded by SGLang 0.5.23's own linker factory from the
``--unified-cache-external-linker-config`` JSON, against SGLang's real abstract class, with
kvlife's threaded CpuCopyEngine over real torch KV buffers and kvlife's directory store.
Runs in .venv-sglang; skipped where SGLang is not installed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sglang_stubs
import torch

sglang_stubs.install()
pytest.importorskip("sglang.srt.mem_cache.unified_cache.linker_factory")

from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache.linker_factory import (  # noqa: E402
    create_unified_cache_linker,
)
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (  # noqa: E402
    UnifiedCacheLinker,
)

from kvlife.engine import CpuCopyEngine  # noqa: E402
from kvlife.integrations.sglang_linker import linker_class  # noqa: E402

PS = 2


class KVPool:
    """The two attributes of SGLang's MHATokenToKVPool the linker reads: per-layer buffers."""

    def __init__(self, slots: int = 64, head_dim: int = 4) -> None:
        self.k_buffer = [torch.zeros(slots, 1, head_dim) for _ in range(2)]
        self.v_buffer = [torch.zeros(slots, 1, head_dim) for _ in range(2)]


class Allocator:
    def __init__(self, head_dim: int = 4) -> None:
        self.pool = KVPool(head_dim=head_dim)

    def get_kvcache(self) -> KVPool:
        return self.pool


def make(
    tmp_path: Path,
    model: str = "tiny-model",
    cp: tuple[int, int] = (0, 1),
    head_dim: int = 4,
    **extra: Any,
) -> Any:
    """A linker made by SGLang's factory for ``model`` at attention-CP rank ``cp``."""
    flag = json.dumps(
        {
            "linker": "KVLifeCacheLinker",
            "linker_module_path": "kvlife.integrations.sglang_linker",
            "linker_extra_config": {"store_dir": str(tmp_path), "host_pages": 8, **extra},
        }
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=Allocator(head_dim),
        page_size=PS,
        attn_cp_rank=cp[0],
        attn_cp_size=cp[1],
    )
    server_args = SimpleNamespace(model_path=model)
    return create_unified_cache_linker(
        server_args,
        params,
        backend="dynamic",
        config=json.loads(flag),
        components={ComponentType.FULL},
    )


def indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PS + i for p in pages for i in range(PS)], dtype=torch.int64)


def kv(pages: list[int], keys: list[str]) -> list[PoolTransfer]:
    return [PoolTransfer(name=PoolName.KV, device_indices=indices(pages), keys=keys)]


def fill(linker: Any, page: int, value: float) -> None:
    for buf in linker.pools[PoolName.KV].k_buffer + linker.pools[PoolName.KV].v_buffer:
        buf[page * PS : (page + 1) * PS] = value


def page_of(linker: Any, page: int) -> list[float]:
    pool = linker.pools[PoolName.KV]
    return [float(b[page * PS, 0, 0]) for b in pool.k_buffer + pool.v_buffer]


def test_sglangs_factory_loads_it_and_it_is_a_complete_linker(tmp_path: Path) -> None:
    linker = make(tmp_path)
    assert isinstance(linker, UnifiedCacheLinker) and type(linker) is linker_class()
    assert isinstance(linker.engine, CpuCopyEngine)
    linker.close()


def test_offload_then_lookup_and_load_back(tmp_path: Path) -> None:
    linker = make(tmp_path)
    fill(linker, 0, 1.5)
    fill(linker, 1, 2.5)
    gate = linker.engine.hold_next()
    assert linker.offload(kv([0, 1], ["a" * 64, "b" * 64]))
    assert linker.num_completed_offloads() == 0  # the device copy has not finished
    assert linker.lookup("r", kv([], ["a" * 64, "b" * 64])) == []  # nor is it stored
    gate.open()
    linker.transfers.drain()
    assert linker.num_completed_offloads() == 1 and linker.pop_completed_offload() is True
    assert linker.lookup("r", kv([], ["a" * 64, "b" * 64, "c" * 64])) == [1, 2]
    assert linker.load("r", kv([5, 6], ["a" * 64, "b" * 64]))
    index = linker.start_layer_wise_loading()
    assert linker.finish_layer_wise_loading(index)
    assert page_of(linker, 5) == [1.5] * 4 and page_of(linker, 6) == [2.5] * 4
    # the loaded pages stay on the host tier, unpinned (a cache, evicted for room)
    assert linker.host.num_used == len(linker.tier) == 2 and not linker.tier.counts.pinned
    linker.close()


def test_completions_are_reported_oldest_first_and_late_ones_wait(tmp_path: Path) -> None:
    linker = make(tmp_path)
    gate = linker.engine.hold_next()
    assert linker.offload(kv([0], ["a" * 64]))  # held: a late completion
    assert linker.offload(kv([1], ["b" * 64]))
    assert linker.num_completed_offloads() == 0  # the second may be done; the first is not
    gate.open()
    linker.transfers.drain()
    assert linker.num_completed_offloads() == 2
    assert [linker.pop_completed_offload(), linker.pop_completed_offload()] == [True, True]
    assert linker.pop_completed_offload() is False and linker.refusals.count("pop") == 1
    linker.close()


def test_cancel_touches_only_the_rids_current_queued_load(tmp_path: Path) -> None:
    """rid reuse: the old request's load started (in flight); the new request on the same
    rid queued one; cancelling the rid cancels only the new one, and the old one lands."""
    linker = make(tmp_path)
    fill(linker, 0, 7.0)
    assert linker.offload(kv([0], ["a" * 64]))
    linker.transfers.drain()
    linker.pop_completed_offload()
    assert linker.load("r", kv([3], ["a" * 64]))
    gate = linker.engine.hold_next()
    first = linker.layer_done_counter.producer_index + 1
    started = linker._queued["r"]
    # start_layer_wise_loading waits for its batch: start it on a thread while held
    import threading

    box: list[int] = []
    t = threading.Thread(target=lambda: box.append(linker.start_layer_wise_loading()))
    t.start()
    while "r" in linker._queued:
        pass
    assert linker.load("r", kv([4], ["a" * 64]))  # the new request on the same rid
    queued = linker._queued["r"]
    assert linker.cancel_queued_load("r") is True
    assert linker.cancel_queued_load("r") is False  # nothing queued any more
    assert queued.inflight == 0 and queued.result is None and started.inflight == 1
    gate.open()
    t.join(10)
    assert box == [first] and linker.finish_layer_wise_loading(first)
    assert page_of(linker, 3) == [7.0] * 4 and page_of(linker, 4) == [0.0] * 4
    assert started.inflight == 0 and started.result is True
    linker.close()


def test_reset_waits_and_forgets(tmp_path: Path) -> None:
    linker = make(tmp_path)
    assert linker.offload(kv([0], ["a" * 64]))
    assert linker.load("q", kv([2], ["z" * 64]))
    linker.reset()
    assert linker.num_completed_offloads() == 0 and linker._queued == {}
    # the written page stays on the host tier, unpinned: a cache, evicted for room
    assert linker.host.num_used == len(linker.tier) == 1 and not linker.tier.counts.pinned
    assert linker.lookup("q", kv([], ["a" * 64])) == [1]  # the write finished before reset
    linker.close()


def test_each_model_and_rank_reads_only_its_own_namespace(tmp_path: Path) -> None:
    """Scenario: two ranks of one model (attention context parallel 0 and 1) and another
    model share one store directory. Rank 0 offloads a page; rank 1 and the other model
    look up the same key: neither finds it (on the old code every rank and model used the
    one namespace "sglang", so rank 1 would load rank 0's shard)."""
    rank0 = make(tmp_path, cp=(0, 2))
    fill(rank0, 0, 3.0)
    assert rank0.offload(kv([0], ["a" * 64]))
    rank0.transfers.drain()
    assert rank0.lookup("r", kv([], ["a" * 64])) == [1]
    rank1 = make(tmp_path, cp=(1, 2))
    other = make(tmp_path, model="other-model", cp=(0, 2))
    assert rank1.lookup("r", kv([], ["a" * 64])) == []
    assert other.lookup("r", kv([], ["a" * 64])) == []
    assert len({rank0.namespace, rank1.namespace, other.namespace}) == 3
    for linker in (rank0, rank1, other):
        linker.close()


def test_a_stored_page_of_another_size_is_a_counted_miss(tmp_path: Path) -> None:
    """Scenario: the store holds a page under the key, but of another size (a linker with
    another head size wrote it under the same namespace). The load fails, counted; nothing
    is raised into SGLang (the old code raised torch's RuntimeError) and no page stays
    pinned or leaks."""
    wide = make(tmp_path, head_dim=8)
    fill(wide, 0, 1.0)
    assert wide.offload(kv([0], ["a" * 64]))
    wide.transfers.drain()
    wide.close()
    linker = make(tmp_path)
    assert linker.lookup("r", kv([], ["a" * 64])) == [1]  # the store has a page there
    assert linker.load("r", kv([3], ["a" * 64]))
    index = linker.start_layer_wise_loading()
    assert linker.finish_layer_wise_loading(index) is False
    assert linker.refusals.count("load_miss") == 1
    assert page_of(linker, 3) == [0.0] * 4  # nothing written to the device
    assert linker.host.num_used == 0 and not linker.tier.counts.pinned
    linker.close()


@pytest.mark.parametrize("device_pages", [[40], [1, 1]])
def test_a_refused_offload_or_load_leaks_nothing_and_raises_nothing(
    tmp_path: Path, device_pages: list[int]
) -> None:
    """Scenario: an offload and a load name device pages the engine refuses (out of the
    KV pool's range; one page twice). Each is refused and counted, nothing is raised into
    SGLang, and no host page stays allocated or pinned (the old code leaked the offload's
    host pages and raised the load's EngineError from start_layer_wise_loading)."""
    linker = make(tmp_path)
    keys = ["a" * 64, "b" * 64][: len(device_pages)]
    assert linker.offload(kv(device_pages, keys)) is False
    assert linker.refusals.count("offload") == 1 and linker.host.num_used == 0
    fill(linker, 0, 2.0)
    fill(linker, 1, 4.0)
    assert linker.offload(kv([0, 1][: len(keys)], keys))
    linker.transfers.drain()
    assert linker.pop_completed_offload() is True
    assert linker.load("r", kv(device_pages, keys))
    index = linker.start_layer_wise_loading()
    assert linker.finish_layer_wise_loading(index) is False
    assert linker.refusals.count("load") == 1
    assert not linker.tier.counts.pinned and linker.host.num_used == len(linker.tier)
    linker.close()


def test_an_engine_that_breaks_taking_a_copy_leaks_nothing_and_raises_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scenario: the engine raises an error of its own (not a refusal of its checks: a
    device error, say) taking an offload and then a load. Each is refused and counted,
    nothing reaches SGLang, and no host page stays allocated or pinned (before, the
    offload's host pages leaked and the engine's error was raised into SGLang)."""
    linker = make(tmp_path)
    fill(linker, 0, 2.0)
    assert linker.offload(kv([0], ["a" * 64]))
    linker.transfers.drain()
    assert linker.pop_completed_offload() is True
    used = linker.host.num_used

    def broken(*args: object) -> object:
        raise RuntimeError("device error")

    monkeypatch.setattr(linker.transfers.engine, "submit", broken)
    assert linker.offload(kv([1], ["b" * 64])) is False
    assert linker.refusals.count("offload") == 1 and linker.host.num_used == used
    assert linker.load("r", kv([2], ["a" * 64]))
    index = linker.start_layer_wise_loading()
    assert linker.finish_layer_wise_loading(index) is False
    assert linker.refusals.count("load") == 1 and linker.refusals.count("DuplicateAck") == 0
    assert not linker.tier.counts.pinned and linker.host.num_used == len(linker.tier)
    assert page_of(linker, 2) == [0.0] * 4  # nothing written to the device
    monkeypatch.undo()
    linker.close()
