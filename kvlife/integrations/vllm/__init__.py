"""kvlife as vLLM's KV offloading backend, ``KVLifeOffloadingSpec`` (vLLM 0.32 to 0.34).

Switch it on with ``LLM(..., kv_transfer_config=transfer_config(host_bytes, ...))``. The
rules, keys, call sequence, process layouts, persistent tier, hybrid models and metrics are in
docs/vllm.md. The package mirrors vLLM's own split (docs/design.md, "Architecture"):
:mod:`.spec`, :mod:`.scheduler`, :mod:`.worker`, :mod:`.shared_pool`, :mod:`.metrics`; imports
point one way: ``_common`` <- ``scheduler``, ``worker`` <- ``metrics``, ``spec``.
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
