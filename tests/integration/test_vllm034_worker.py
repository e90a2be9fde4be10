"""kvlife's vLLM worker under vLLM 0.34's worker API: jobs name their device blocks by
pointers (``DevicePointers``, resolved by vLLM's own ``resolve_device_pointers``), and a
failed job is reported, never hidden or made fatal (vLLM 0.34 recomputes a failed load and
drops a failed store). Runs in the vLLM 0.34 venv (.ci/vllm034.sh); skipped elsewhere."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

base = pytest.importorskip("vllm.v1.kv_offload.base")
if not hasattr(base, "DevicePointers"):
    pytest.skip("vLLM before 0.34: block ids, not device pointers", allow_module_level=True)

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    DevicePointers,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers  # noqa: E402

from kvlife.integrations.vllm import HostBlocksSpec, KVLifeWorker  # noqa: E402
from kvlife.integrations.vllm.worker import TAKES_FAILURES  # noqa: E402
from kvlife.pool import HostPagePool  # noqa: E402

ROW = 64


def rig(blocks: int = 16, layers: int = 2) -> tuple[KVLifeWorker, CanonicalKVCaches]:
    views = [
        torch.randint(
            -128, 127, (blocks, ROW), dtype=torch.int8, generator=torch.Generator().manual_seed(i)
        )
        for i in range(layers)
    ]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(v, ROW) for v in views],
        group_data_refs=[[CanonicalKVCacheRef(i, ROW) for i in range(layers)]],
    )
    return KVLifeWorker(caches, HostPagePool(8, layers * ROW, torch.int8)), caches


def pointers(caches: CanonicalKVCaches, blocks: list[int]) -> DevicePointers:
    """What vLLM 0.34's connector hands the worker for ``blocks`` (its own resolution)."""
    spec = GPULoadStoreSpec(blocks, [len(blocks)], [0])
    spec.block_ids = np.asarray(blocks, dtype=np.int64)
    return resolve_device_pointers(spec, caches)


def keys(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 8 for i in range(n)]


def finished(worker: KVLifeWorker) -> list[tuple[int, bool]]:
    worker.flush(timeout=10)
    return [(r.job_id, r.success) for r in worker.get_finished()]


def test_the_worker_knows_vllm_034() -> None:
    assert TAKES_FAILURES


def test_a_store_and_a_load_by_device_pointers_copy_every_byte() -> None:
    """Scenario: vLLM 0.34 stores blocks 3 and 9 to host pages 0 and 1 and loads them back
    into blocks 5 and 12, each job by device pointers. Every byte of every view lands where
    it belongs, and both jobs succeed."""
    worker, caches = rig()
    views = [t.tensor for t in caches.tensors]
    before = [v.clone() for v in views]
    assert worker.submit_store(1, pointers(caches, [3, 9]), HostBlocksSpec([0, 1], keys(2)))
    assert finished(worker) == [(1, True)]
    assert worker.submit_load(2, HostBlocksSpec([0, 1], keys(2)), pointers(caches, [5, 12]))
    assert finished(worker) == [(2, True)]
    for view, old in zip(views, before, strict=True):
        assert torch.equal(view[5], old[3]) and torch.equal(view[12], old[9])
        assert torch.equal(view[3], old[3])  # the source is untouched
    worker.shutdown()


@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_failed_copy_is_reported_failed_not_made_again(direction: str) -> None:
    """Scenario: the copy engine fails a job's copy. vLLM 0.34 takes a failed job (a load
    is recomputed, a store dropped), so the result says so; the worker does not make the
    copy again behind vLLM's back as it must on vLLM 0.32 (which stops on a failure). The
    next job succeeds."""
    worker, caches = rig()
    worker.engine.fail_next()
    if direction == "store":
        worker.submit_store(1, pointers(caches, [2]), HostBlocksSpec([0], keys(1)))
    else:
        worker.submit_load(1, HostBlocksSpec([0], keys(1)), pointers(caches, [2]))
    assert finished(worker) == [(1, False)]
    assert worker.stats["copies_made_directly"] == 0 and worker.refusals.count("copy_failures") == 1
    worker.submit_store(2, pointers(caches, [4]), HostBlocksSpec([1], keys(1)))
    assert finished(worker) == [(2, True)]
    worker.shutdown()


def test_a_stale_load_of_a_freed_host_page_fails_and_a_stale_store_is_skipped() -> None:
    """Found by review: a job naming a host page the manager already freed (vLLM reset the
    offloaded cache before it submitted the job) was skipped and reported a success, a
    load too: vLLM then ran on blocks nothing wrote. Now such a load fails (vLLM 0.34
    recomputes it); a store is skipped as before. Nothing is copied either way."""
    worker, caches = rig()
    views = [t.tensor for t in caches.tensors]
    assert worker.submit_store(1, pointers(caches, [3]), HostBlocksSpec([0], keys(1)))
    assert finished(worker) == [(1, True)]
    worker.pool.free([0, 1], owner=worker)  # the manager freed them: vLLM's reset
    before = [v.clone() for v in views]
    assert worker.submit_load(2, HostBlocksSpec([0], keys(1)), pointers(caches, [7]))
    assert worker.submit_store(3, pointers(caches, [4]), HostBlocksSpec([1], keys(1)))
    assert finished(worker) == [(2, False), (3, True)]
    assert worker.stats["stale_jobs_skipped"] == 2
    assert all(torch.equal(v, old) for v, old in zip(views, before, strict=True))
    worker.shutdown()


def test_pointers_the_cache_does_not_hold_fail_the_job_and_copy_nothing() -> None:
    """Scenario: a job's pointers name rows outside this worker's KV cache views (another
    engine's cache, a stale resolution) or views that disagree on the block. The job fails,
    counted and logged once, nothing is copied, and nothing is raised into vLLM."""
    worker, caches = rig()
    good = pointers(caches, [1, 2])
    host_before = worker.pool.tensor.clone()
    shifted = DevicePointers(
        good.ptrs + np.uint64(1 << 40),
        good.sizes,
        good.group_block_counts,
        good.group_data_ref_counts,
        good.block_indices,
    )
    mixed_ptrs = good.ptrs.copy()
    mixed_ptrs[-1] = good.ptrs[-2]  # the second view names block 1 for the job's block 2
    mixed = DevicePointers(
        mixed_ptrs,
        good.sizes,
        good.group_block_counts,
        good.group_data_ref_counts,
        good.block_indices,
    )
    for job_id, bad in ((1, shifted), (2, mixed)):
        assert worker.submit_store(job_id, bad, HostBlocksSpec([0, 1], keys(2)))
    assert finished(worker) == [(1, False), (2, False)]
    assert torch.equal(worker.pool.tensor, host_before)
    assert worker.refusals.count("device_pointers_refused") == 2
    worker.shutdown()


def test_the_manager_and_worker_types_are_vllm_034s() -> None:
    """The worker is vLLM 0.34's OffloadingWorker; its submit calls take 0.34's arguments
    (``expedited`` included) without a per-version copy of the worker."""
    worker, caches = rig()
    ok: Any = worker.submit_load(
        7, HostBlocksSpec([0], keys(1)), pointers(caches, [3]), expedited=True
    )
    assert ok is True and finished(worker) == [(7, True)]
    worker.shutdown()


def test_the_spec_builds_both_roles_from_vllm_034s_config(tmp_path: Any) -> None:
    """Scenario: vLLM 0.34 builds kvlife's spec from its own ``OffloadingConfig``, takes
    the manager and the worker, stores two blocks through the manager's plan (by device
    pointers, with a persistent tier) and loads them back: the same spec as on vLLM 0.32,
    no copy per version."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm_config import offloading_config

    from kvlife.integrations.vllm import KVLifeOffloadingSpec

    extra = {"host_bytes": 8 * 2 * ROW, "store_dir": str(tmp_path), "model_id": "m"}
    config = offloading_config(block_bytes=2 * ROW, **extra)
    spec = KVLifeOffloadingSpec(config)
    _, caches = rig()
    worker = spec.get_worker(caches)
    manager = spec.get_manager()
    (info,) = manager.config_info()  # vLLM publishes the labels the spec names, no other
    assert tuple(info) == KVLifeOffloadingSpec.config_info_keys(config.extra_config)
    ctx = ReqContext("r")
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys(2), ctx)
    assert out is not None
    views = [t.tensor for t in caches.tensors]
    worker.submit_store(1, pointers(caches, [3, 4]), out.store_spec)
    assert finished(worker) == [(1, True)]
    manager.complete_store(keys(2), ctx)
    load = manager.prepare_load(keys(2), ctx)
    worker.submit_load(2, load, pointers(caches, [10, 11]))
    assert finished(worker) == [(2, True)]
    manager.complete_load(keys(2), ctx)
    for view in views:
        assert torch.equal(view[10], view[3]) and torch.equal(view[11], view[4])
    assert worker.stats["disk_pages_written"] == 2  # the persistent tier has both
    worker.shutdown()
    manager.shutdown()
