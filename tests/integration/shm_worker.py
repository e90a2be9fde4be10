"""A vLLM worker role in its own process, for the shared-host-tier tests in
``test_vllm_manager.py``: vLLM's multiprocess executor runs each rank's worker as a child
of the scheduler's process, so the test process plays the scheduler and spawns these.

``worker_main(config, conn)`` builds kvlife's spec for ``config`` (vLLM's own
``OffloadingConfig``, this rank's), a worker over two layers of 8 blocks (16 KiB rows),
says ``("ready", shared)`` and then serves ``("load", job, host_pages, keys, blocks)``
(answering the job's success and each block's bytes) and ``("stop",)`` (its counters).
"""

from __future__ import annotations

import time
from typing import Any

ROW = 16384  # bytes of one block in one layer; a host page holds two layers


def worker_main(config: Any, conn: Any) -> None:
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )

    from kvlife.integrations.vllm import HostBlocksSpec, KVLifeOffloadingSpec

    spec = KVLifeOffloadingSpec(config)
    views = [torch.zeros(8, ROW, dtype=torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(v, ROW) for v in views],
        group_data_refs=[[CanonicalKVCacheRef(i, ROW) for i in range(len(views))]],
    )
    worker = spec.get_worker(caches)
    conn.send(("ready", worker._shared.path is not None))
    while True:
        command, *args = conn.recv()
        if command == "stop":
            worker.shutdown()
            conn.send(("stopped", dict(worker.stats)))
            return
        job, host_pages, keys, blocks = args
        worker.submit_load(
            job, HostBlocksSpec(host_pages, keys), GPULoadStoreSpec(blocks, [len(blocks)], [0])
        )
        results: list[Any] = []
        deadline = time.monotonic() + 30
        while not results and time.monotonic() < deadline:
            results = worker.get_finished()
            time.sleep(0.001)
        rows = [b"".join(v[b].numpy().tobytes() for v in views) for b in blocks]
        conn.send((bool(results and results[0].success), rows))
