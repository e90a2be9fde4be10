"""kvlife as vLLM's KV offloading backend, ``KVLifeOffloadingSpec`` (vLLM 0.32 to 0.34).

Switch it on with ``LLM(..., kv_transfer_config=transfer_config(host_bytes, ...))``.
The package mirrors vLLM's own split: :mod:`.spec` (the spec vLLM loads by name from
this module, its config checks, the persistent tier's namespace), :mod:`.scheduler`
(:class:`KVLifeOffloadingManager`, on the scheduler: it decides and copies nothing,
hands out host pages of kvlife's core host tier, one :class:`~kvlife.Lifecycle` per
request; its metric table) and :mod:`.worker` (:class:`KVLifeWorker`, which holds the
bytes and copies through kvlife's copy pipeline); :mod:`.metrics` is the Prometheus
collector over both. Imports point one way: ``_common`` <- ``scheduler``, ``worker``
<- ``metrics``, ``spec``. The rules, keys, call sequence, process layouts,
persistent tier and metrics are in ``docs/vllm.md``. Hybrid models (several KV cache
groups: full attention with sliding window or Mamba, each group's own block size) and
``blocks_per_chunk`` > 1 are taken as vLLM's connector offers them, every group's keys
sharing one host tier (``docs/vllm.md``, "Hybrid models").
"""

from kvlife.integrations.vllm._common import FROM_STORE, HostBlocksSpec
from kvlife.integrations.vllm.metrics import OffloadCollector
from kvlife.integrations.vllm.scheduler import METRICS, KVLifeOffloadingManager, live_managers
from kvlife.integrations.vllm.spec import KVLifeOffloadingSpec, store_namespace, transfer_config
from kvlife.integrations.vllm.worker import (
    BlockViewsLayout,
    GroupedBlocksLayout,
    KVLifeWorker,
    live_workers,
)

__all__ = [
    "FROM_STORE",
    "METRICS",
    "BlockViewsLayout",
    "GroupedBlocksLayout",
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
