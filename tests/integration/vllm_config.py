"""vLLM's own ``OffloadingConfig`` as the integration tests build it (one group of two
layers), in one place. Importing it needs vLLM (0.32's CPU build or 0.34)."""

from __future__ import annotations

from typing import Any


def offloading_config(
    model: str = "m",
    *,
    block_bytes: int = 32768,
    tp: int = 1,
    rank: int = 0,
    engine_id: str = "e",
    **extra: Any,
) -> Any:
    """One KV cache group of two layers whose blocks are ``block_bytes`` on the worker,
    rank ``rank`` of ``tp``, ``extra`` the spec's extra config (1 MiB of host by default)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(32, ("l0", "l1"), 0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config={"host_bytes": 1 << 20, **extra},
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp,
            tp_size=tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
        kv_cache_layout="LBHNC",
    )
