"""kvlife as vLLM's KV offloading backend, ``KVLifeOffloadingSpec`` (vLLM 0.32).

Switch it on with ``LLM(..., kv_transfer_config=transfer_config(host_bytes, ...))``.
The package mirrors vLLM's own split: :mod:`.spec` (the spec vLLM loads by name from
this module, its config checks, the persistent tier's namespace), :mod:`.scheduler`
(:class:`KVLifeOffloadingManager`, on the scheduler: it decides and copies nothing,
hands out host pages of kvlife's core host tier, one :class:`~kvlife.Lifecycle` per
request) and :mod:`.worker` (:class:`KVLifeWorker`, which holds the bytes and copies
through a kvlife copy engine). The rules, keys, call sequence, process layouts,
persistent tier and metrics are in ``docs/vllm.md``. Limits: one KV cache group (plain
attention models), ``blocks_per_chunk`` 1.
"""

from kvlife.integrations.vllm._common import (
    FROM_STORE,
    HostBlocksSpec,
    live_managers,
    live_workers,
)
from kvlife.integrations.vllm.metrics import METRICS, OffloadCollector
from kvlife.integrations.vllm.scheduler import KVLifeOffloadingManager
from kvlife.integrations.vllm.spec import KVLifeOffloadingSpec, store_namespace, transfer_config
from kvlife.integrations.vllm.worker import BlockViewsLayout, KVLifeWorker

__all__ = [
    "FROM_STORE",
    "METRICS",
    "BlockViewsLayout",
    "HostBlocksSpec",
    "KVLifeOffloadingManager",
    "KVLifeOffloadingSpec",
    "KVLifeWorker",
    "OffloadCollector",
    "live_managers",
    "live_workers",
    "store_namespace",
    "transfer_config",
]
