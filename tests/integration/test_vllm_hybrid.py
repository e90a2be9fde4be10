"""Hybrid models: several KV cache groups (full attention + sliding window, or any group
vLLM's connector offers) and chunks of several blocks (``blocks_per_chunk`` > 1).

The worker tests run on both vLLM APIs with vLLM's own types: 0.32's ``GPULoadStoreSpec``
(the CPU build, ``.venv-vllm``) and 0.34's ``DevicePointers`` resolved by vLLM's own
``resolve_device_pointers`` (``.venv-vllm034``). The end-to-end test runs a tiny
random-init Llama whose layers mix full attention and sliding window (``layer_types``), so
vLLM's CPU build makes two KV cache groups; it needs a vLLM that runs models (0.32's CPU
build) and is skipped on 0.34.

Run: ``.venv-vllm/bin/python -m pytest -q tests/integration/test_vllm_hybrid.py`` (and the
same with ``.venv-vllm034/bin/python``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

base = pytest.importorskip(
    "vllm.v1.kv_offload.base", reason="vLLM is not installed: CI runs these in its vLLM steps"
)

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    make_offload_key,
)

from kvlife.errors import ConfigError  # noqa: E402
from kvlife.integrations.vllm import HostBlocksSpec, KVLifeOffloadingSpec, KVLifeWorker  # noqa: E402
from kvlife.integrations.vllm.worker import (  # noqa: E402
    TAKES_FAILURES,
    GroupedBlocksLayout,
    host_row_bytes,
)
from kvlife.pool import HostPagePool  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCKS = 16
#: Group 0 (full attention): two layers of 64 B blocks; group 1 (sliding window): one
#: layer of 32 B blocks (a group's own block size); group 2 overlays group 0's tensors (as
#: vLLM's hybrid allocator lays groups over one backing allocation).
ROWS = (64, 64, 32)
GROUP_TENSORS = ((0, 1), (2,), (0, 1))


def caches() -> CanonicalKVCaches:
    tensors = [
        CanonicalKVCacheTensor(
            torch.randint(
                -128,
                127,
                (BLOCKS, row),
                dtype=torch.int8,
                generator=torch.Generator().manual_seed(i),
            ),
            row,
        )
        for i, row in enumerate(ROWS)
    ]
    refs = [[CanonicalKVCacheRef(i, ROWS[i]) for i in group] for group in GROUP_TENSORS]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def rig(bpc: int = 1, pages: int = 8) -> tuple[KVLifeWorker, CanonicalKVCaches]:
    kv = caches()
    pool = HostPagePool(pages, host_row_bytes(kv, bpc), torch.int8)
    return KVLifeWorker(kv, pool, tokens_per_block=(32, 16, 32), blocks_per_chunk=bpc), kv


def device(kv: CanonicalKVCaches, groups: list[tuple[list[int], int]]) -> Any:
    """What vLLM's connector hands the worker for these blocks, group by group, each group
    with the request's index of its first block: vLLM 0.32's ``GPULoadStoreSpec``, or 0.34's
    ``DevicePointers`` resolved from it by vLLM's own ``resolve_device_pointers``."""
    ids = [b for blocks, _ in groups for b in blocks]
    spec = GPULoadStoreSpec(ids, [len(b) for b, _ in groups], [first for _, first in groups])
    if not TAKES_FAILURES:
        return spec
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    spec.block_ids = np.asarray(ids, dtype=np.int64)
    return resolve_device_pointers(spec, kv)


def keys(*groups: int) -> list[Any]:
    """One key a chunk: a block hash and the chunk's group index, as vLLM makes them."""
    return [make_offload_key(bytes([i + 1]) * 8, g) for i, g in enumerate(groups)]


def done(worker: KVLifeWorker) -> list[tuple[int, bool]]:
    worker.flush(timeout=10)
    return [(r.job_id, r.success) for r in worker.get_finished()]


def views(kv: CanonicalKVCaches) -> list[torch.Tensor]:
    return [t.tensor for t in kv.tensors]


def test_several_groups_of_different_block_sizes_round_trip_every_byte() -> None:
    """Scenario: one store job names blocks of three groups (two layers of 64 B; one of
    32 B; one over the first group's tensors) and one load job brings them back into other
    blocks. Each key's host page holds its group's blocks and nothing else; each loaded
    block equals its source byte for byte in its own group's tensors only; every tensor row
    no group named is untouched. Fails on the code that refused several groups."""
    worker, kv = rig()
    assert isinstance(worker.layout, GroupedBlocksLayout)
    assert worker.row_bytes == 128  # the widest group's block: one pool for every group
    before = [v.clone() for v in views(kv)]
    host = HostBlocksSpec([4, 0, 2, 6], keys(0, 0, 1, 2))
    assert worker.submit_store(1, device(kv, [([3, 9], 0), ([4], 0), ([7], 0)]), host)
    assert done(worker) == [(1, True)]
    t0, t1, t2 = before
    pool = worker.pool.tensor
    assert torch.equal(pool[4], torch.cat([t0[3], t1[3]]))
    assert torch.equal(pool[0], torch.cat([t0[9], t1[9]]))
    assert torch.equal(pool[2, :32], t2[4])  # a 32 B block in a 128 B page, from its start
    assert torch.equal(pool[6], torch.cat([t0[7], t1[7]]))
    assert worker.submit_load(2, host, device(kv, [([5, 12], 0), ([6], 0), ([10], 0)]))
    assert done(worker) == [(2, True)]
    v0, v1, v2 = views(kv)
    for new, old in ((5, 3), (12, 9), (10, 7)):
        assert torch.equal(v0[new], t0[old]) and torch.equal(v1[new], t1[old])
    assert torch.equal(v2[6], t2[4])
    written = {0: {5, 12, 10}, 1: {5, 12, 10}, 2: {6}}
    for i, (view, old) in enumerate(zip(views(kv), before, strict=True)):
        for b in set(range(BLOCKS)) - written[i]:
            assert torch.equal(view[b], old[b]), (i, b)
    stats = worker.stats
    assert [stats[f"stored_keys_group{g}"] for g in range(3)] == [2, 1, 1]
    assert [stats[f"loaded_keys_group{g}"] for g in range(3)] == [2, 1, 1]
    worker.shutdown()


def test_chunks_of_several_blocks_round_trip_with_offsets_and_null_placeholders() -> None:
    """Scenario (``blocks_per_chunk`` 2): a store names group 0's blocks from the request's
    block 1 (its first chunk half full, as vLLM 0.32 hands a sliding-window tail) and
    group 1's two blocks with vLLM 0.34's null block 0 kept as a placeholder; a load
    brings them back into other blocks from other offsets. Each block lands in its chunk's
    slot and back byte for byte; the placeholder's slot is never loaded into a live block."""
    worker, kv = rig(bpc=2)
    assert worker.row_bytes == 256
    before = [v.clone() for v in views(kv)]
    host = HostBlocksSpec([3, 1, 5], keys(0, 0, 1))
    assert worker.submit_store(1, device(kv, [([3, 9, 11], 1), ([0, 4], 0), ([], 0)]), host)
    assert done(worker) == [(1, True)]
    t0, t1, t2 = before
    pool = worker.pool.tensor
    assert torch.equal(pool[3, 128:], torch.cat([t0[3], t1[3]]))  # slot 1 of the first chunk
    assert torch.equal(pool[1], torch.cat([t0[9], t1[9], t0[11], t1[11]]))
    assert torch.equal(pool[5, 128:160], t2[4])
    assert worker.submit_load(2, host, device(kv, [([5, 12, 13], 1), ([6], 1), ([], 0)]))
    assert done(worker) == [(2, True)]
    v0, v1, v2 = views(kv)
    for new, old in ((5, 3), (12, 9), (13, 11)):
        assert torch.equal(v0[new], t0[old]) and torch.equal(v1[new], t1[old])
    assert torch.equal(v2[6], t2[4])
    assert torch.equal(v2[0], t2[0]) and torch.equal(v0[0], t0[0])  # no null block written
    assert not worker.layout.chunks  # type: ignore[union-attr]  # released with the jobs
    worker.shutdown()


def test_a_device_spec_that_does_not_fit_the_groups_fails_the_job_and_copies_nothing() -> None:
    """Scenario: jobs whose device side does not make one chunk per key (a block short),
    or names a group this worker does not have. Each job fails (counted), nothing is
    copied, nothing raised into vLLM; the next good job succeeds."""
    worker, kv = rig()
    host_before = worker.pool.tensor.clone()
    short = device(kv, [([3], 0), ([4], 0), ([], 0)])
    assert worker.submit_store(1, short, HostBlocksSpec([0, 1, 2], keys(0, 0, 1)))
    if not TAKES_FAILURES:  # 0.32: a GPULoadStoreSpec of another group count
        extra = GPULoadStoreSpec([1, 2], [1, 1], [0, 0])
        assert worker.submit_store(2, extra, HostBlocksSpec([0, 1], keys(0, 1)))
    results = done(worker)
    assert all(not ok for _, ok in results) and len(results) == (1 if TAKES_FAILURES else 2)
    assert torch.equal(worker.pool.tensor, host_before)
    assert worker.refusals.count("device_spec_refused") == len(results)
    assert worker.submit_store(
        3, device(kv, [([3], 0), ([], 0), ([], 0)]), HostBlocksSpec([0], keys(0))
    )
    assert done(worker) == [(3, True)]
    worker.shutdown()


@pytest.mark.skipif(TAKES_FAILURES, reason="0.34's device pointers are checked in the cache")
def test_a_block_id_past_the_cache_is_refused_not_read_from_another_group() -> None:
    """Found by review: on vLLM 0.32's block ids, block ``BLOCKS + 1`` of group 0 was read
    as block 1 of the next part (another group's tensor) and the job reported copied."""
    worker, _ = rig()
    host_before = worker.pool.tensor.clone()
    spec = GPULoadStoreSpec([BLOCKS + 1], [1, 0, 0], [0, 0, 0])
    assert worker.submit_store(1, spec, HostBlocksSpec([0], keys(0)))
    assert done(worker) == [(1, False)]
    assert torch.equal(worker.pool.tensor, host_before)
    assert worker.refusals.count("device_spec_refused") == 1
    worker.shutdown()


def test_a_store_read_that_raises_fails_the_load_and_keeps_no_chunk(tmp_path: Path) -> None:
    """Found by review: a persistent-tier read that raised (a Mooncake cluster that does not
    answer) went into vLLM from ``submit_load``; the job never got a result and its chunk
    of two blocks stayed registered, so the next load of those blocks was refused. Now the
    read is a miss like a page gone: the job fails (counted), nothing stays."""
    from kvlife.errors import StoreUnavailable
    from kvlife.integrations.vllm import FROM_STORE
    from kvlife.store.directory import LocalDirectoryStore

    kv = caches()
    pool = HostPagePool(8, host_row_bytes(kv, 2), torch.int8)
    store = LocalDirectoryStore(tmp_path, "ns")
    worker = KVLifeWorker(kv, pool, store=store, tokens_per_block=(32, 16, 32), blocks_per_chunk=2)

    def unanswered(name: str) -> bytes | None:
        raise StoreUnavailable("the master did not answer")

    store.get = unanswered  # type: ignore[method-assign]
    blocks = [([5, 6], 0), ([], 0), ([], 0)]
    assert worker.submit_load(1, HostBlocksSpec([FROM_STORE], keys(0)), device(kv, blocks))
    assert done(worker) == [(1, False)]
    assert worker.refusals.count("disk_load_errors") == 1
    assert worker.inflight == 0 and not worker.layout.chunks  # type: ignore[union-attr]
    assert worker.submit_load(2, HostBlocksSpec([0], keys(0)), device(kv, blocks))
    assert done(worker) == [(2, True)]
    worker.shutdown()


def test_a_failed_disk_part_stays_failed_when_the_host_part_is_stale(tmp_path: Path) -> None:
    """Found reviewing this change: a load with a page the persistent tier no longer
    answers for (the job fails) and a host page the manager already freed (a stale part,
    skipped) reported a success on vLLM 0.32: the skip overwrote the earlier failure."""
    from kvlife.errors import StoreUnavailable
    from kvlife.integrations.vllm import FROM_STORE
    from kvlife.store.directory import LocalDirectoryStore

    kv = caches()
    pool = HostPagePool(8, host_row_bytes(kv, 1), torch.int8)
    store = LocalDirectoryStore(tmp_path, "ns")
    worker = KVLifeWorker(kv, pool, store=store, tokens_per_block=(32, 16, 32))
    first, second = keys(0, 0)
    assert worker.submit_store(
        1, device(kv, [([3], 0), ([], 0), ([], 0)]), HostBlocksSpec([0], [first])
    )
    assert done(worker) == [(1, True)]

    def unanswered(name: str) -> bytes | None:
        raise StoreUnavailable("the master did not answer")

    store.get = unanswered  # type: ignore[method-assign]
    worker.pool.free([0], owner=worker)  # the manager freed it: vLLM's reset
    blocks = device(kv, [([5, 6], 0), ([], 0), ([], 0)])
    assert worker.submit_load(2, HostBlocksSpec([FROM_STORE, 0], [second, first]), blocks)
    assert done(worker) == [(2, False)]
    assert worker.refusals.count("disk_load_errors") == worker.stats["stale_jobs_skipped"] == 1
    worker.shutdown()


def test_a_store_tier_read_waits_for_a_copy_still_reading_its_block(tmp_path: Path) -> None:
    """Found by review: a load from the persistent tier writes its device blocks here, outside
    the engine, and after an abort or a reset vLLM can hand it a block an earlier store job
    still reads. That job then stored the disk page's bytes under its own key. Now the read
    waits for the copies in flight on its blocks, as an engine submit does (counted). The
    worker's engine copies on a thread of its own, and holds the store's copy (its gate
    forces the interleaving)."""
    import threading

    from kvlife.engine import CpuCopyEngine
    from kvlife.integrations.vllm import FROM_STORE
    from kvlife.store.directory import LocalDirectoryStore

    kv = caches()
    pool = HostPagePool(8, host_row_bytes(kv, 1), torch.int8)
    store = LocalDirectoryStore(tmp_path, "ns")
    worker = KVLifeWorker(kv, pool, store=store, tokens_per_block=(32, 16, 32), copy_threads=1)
    first, second = keys(0, 0)
    only = [([7], 0), ([], 0), ([], 0)]
    assert worker.submit_store(1, device(kv, only), HostBlocksSpec([0], [first]))
    assert done(worker) == [(1, True)]  # the persistent tier holds block 7 under `first`
    t0, t1, _ = (v.clone() for v in views(kv))
    assert isinstance(worker.engine, CpuCopyEngine)
    gate = worker.engine.hold_next()
    block5 = [([5], 0), ([], 0), ([], 0)]
    assert worker.submit_store(2, device(kv, block5), HostBlocksSpec([1], [second]))
    opener = threading.Timer(0.3, gate.open)
    opener.start()
    assert worker.submit_load(3, HostBlocksSpec([FROM_STORE], [first]), device(kv, block5))
    assert sorted(done(worker)) == [(2, True), (3, True)]
    opener.join()
    assert torch.equal(pool.tensor[1], torch.cat([t0[5], t1[5]]))  # what block 5 held
    assert torch.equal(views(kv)[0][5], t0[7])  # then the tier's page landed
    assert worker.stats["engine_busy_waits"] == 1
    worker.shutdown()


def test_shutdown_keeps_the_pool_locked_while_a_copy_may_still_use_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: shutdown undid the pool's page lock (on CUDA, vLLM's host_register)
    even when its drain ran out of time, under a copy still in flight. Now only the pool's
    name goes and the step counts as a shutdown error; nothing is raised into vLLM. A copy
    that does not end (a layout held on an event: a stand-in for a DMA that hangs) forces it."""
    import functools
    import threading

    kv = caches()
    pool = HostPagePool(8, host_row_bytes(kv, 1), torch.int8)
    worker = KVLifeWorker(kv, pool, tokens_per_block=(32, 16, 32), copy_threads=1)
    stuck = threading.Event()
    gather = worker.layout.gather_runs

    def hangs(*args: Any, **kwargs: Any) -> None:
        stuck.wait(10)
        gather(*args, **kwargs)

    monkeypatch.setattr(worker.layout, "gather_runs", hangs)
    calls: list[str] = []
    monkeypatch.setattr(worker._shared, "close", lambda: calls.append("close"))
    monkeypatch.setattr(worker._shared, "unlink", lambda: calls.append("unlink"))
    monkeypatch.setattr(worker, "drain_timeout_s", 0.2)
    monkeypatch.setattr(worker.engine, "close", functools.partial(worker.engine.close, 0.2))
    try:
        spec = device(kv, [([3], 0), ([], 0), ([], 0)])
        assert worker.submit_store(1, spec, HostBlocksSpec([0], keys(0)))
        worker.shutdown()  # the drain and the pool's release fail, counted
        assert calls == ["unlink"] and worker.stats["shutdown_errors"] == 2
    finally:
        stuck.set()


def test_bad_group_layouts_are_refused_at_start() -> None:
    """A group with no layer, groups whose caches hold different block counts and a
    blocks_per_chunk that is not a positive int are refused with a ConfigError, before any
    worker exists."""
    kv = caches()
    empty = CanonicalKVCaches(kv.tensors, [kv.group_data_refs[0], []])
    odd = CanonicalKVCaches(
        [*kv.tensors, CanonicalKVCacheTensor(torch.zeros((BLOCKS + 1, 64), dtype=torch.int8), 64)],
        [kv.group_data_refs[0], [CanonicalKVCacheRef(3, 64)]],
    )
    for bad, bpc in ((empty, 1), (odd, 1), (kv, 0)):
        with pytest.raises(ConfigError):
            KVLifeWorker(bad, HostPagePool(4, 128, torch.int8), blocks_per_chunk=bpc)


def _config(groups: int, bpc: int, host_bytes: int = 1 << 20) -> Any:
    from dataclasses import replace

    from vllm.v1.kv_offload.config import OffloadingCacheConfig, OffloadingGroupConfig
    from vllm_config import offloading_config

    config = offloading_config(host_bytes=host_bytes)
    layers = [(f"l{g}",) for g in range(groups)]
    return replace(
        config,
        groups=tuple(OffloadingGroupConfig(32 * (g + 1), layers[g], g) for g in range(groups)),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=bpc),
    )


@pytest.mark.parametrize(("groups", "bpc"), [(2, 1), (3, 2), (1, 4)])
def test_the_spec_takes_several_groups_and_chunks_and_shares_the_host_tier(
    groups: int, bpc: int
) -> None:
    """The spec vLLM builds for a hybrid model (groups of their own block sizes) or with
    ``blocks_per_chunk`` > 1 starts (it was refused), and its host tier is one pool of
    chunk-sized pages for every group: its capacity is the host bytes over one chunk,
    never divided by the number of groups (vLLM #56871)."""
    spec = KVLifeOffloadingSpec(_config(groups, bpc))
    assert spec.page_bytes == 32768 * bpc
    assert spec.capacity == (1 << 20) // (32768 * bpc)


def test_the_spec_refuses_a_host_tier_smaller_than_one_chunk() -> None:
    with pytest.raises(ConfigError, match="no chunk"):
        KVLifeOffloadingSpec(_config(2, 4, host_bytes=32768 * 3))


# ----------------------------------------------------------------- end to end, vLLM's CPU build


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    if TAKES_FAILURES:
        pytest.skip("vLLM 0.34 has no CPU kernels: end to end on vllm-cpu 0.32 only")
    from test_vllm import _build_model

    # The first layer full attention, the second a sliding window of 64 tokens (two blocks).
    path = tmp_path_factory.mktemp("hybrid")
    _build_model(path, 0, layer_types=["full_attention", "sliding_attention"], sliding_window=64)
    return str(path)


PROMPTS = [[(7 * i + 31 * j) % 1021 + 3 for j in range(90 + 5 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def hybrid_baseline(hybrid_dir: str) -> list[list[int]]:
    """Greedy outputs of the hybrid model with no offloading; vLLM made two KV cache
    groups for it (one per attention kind)."""
    from test_vllm import _generate, _llm, _shutdown

    plain = _llm(hybrid_dir, None)
    kv_cache = plain.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    assert len(kv_cache.kv_cache_groups) == 2
    outputs = _generate(plain, PROMPTS)
    _shutdown(plain)
    return outputs


@pytest.mark.parametrize("bpc", [1, 2])
def test_a_hybrid_model_offloads_and_loads_every_group_with_unchanged_outputs(
    hybrid_dir: str, hybrid_baseline: list[list[int]], bpc: int
) -> None:
    """Scenario: a model of a full-attention and a sliding-window layer (two KV cache
    groups in vLLM) serves 8 prompts, its prefix cache is reset, and it serves them again,
    with one block a chunk and with two. Greedy outputs equal vLLM's without kvlife both
    times; blocks of both groups were stored and loaded (the sliding-window group's
    reachable tail only, as vLLM's connector asks); every key took a page of one host
    tier; kvlife's books balance."""
    from test_vllm import _generate, _llm, _roles, _shutdown, assert_clean, assert_worker_clean

    extra: dict[str, Any] = {"host_bytes": 4 << 20}
    if bpc > 1:
        extra["blocks_per_chunk"] = bpc
    llm = _llm(hybrid_dir, extra)
    try:
        manager, worker = _roles()
        first = _generate(llm, PROMPTS)
        assert llm.reset_prefix_cache(reset_connector=False)
        second = _generate(llm, PROMPTS)
        assert first == second == hybrid_baseline
        stats = worker.stats
        for g in (0, 1):
            assert stats[f"stored_keys_group{g}"] > 0, dict(stats)
            assert stats[f"loaded_keys_group{g}"] > 0, dict(stats)
        # The sliding window keeps only its tail: fewer keys than full attention's prefix
        # (with 2 blocks a chunk, a prompt's one whole chunk is both).
        assert stats["stored_keys_group1"] < stats["stored_keys_group0"] or bpc > 1
        acc = manager.accounting()
        assert acc["host_keys"] == stats["stored_keys_group0"] + stats["stored_keys_group1"]
        assert manager.pool.capacity == (4 << 20) // worker.row_bytes  # one tier, not halved
        _generate(llm, [[5, 6, 7, 8]])  # delivers vLLM's late finish signals
        assert_clean(manager)
        assert_worker_clean(worker)
    finally:
        _shutdown(llm)
