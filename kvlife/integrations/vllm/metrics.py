"""The vLLM backend's metric table (vLLM's ``get_stats``) and its Prometheus collector."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from kvlife.integrations.vllm._common import live_managers, live_workers
from kvlife.manager import ManagerMetrics
from kvlife.metrics import ManagerCollector, summed

logger = logging.getLogger(__name__)

#: Metric name -> (kind, documentation). Counters are deltas per ``get_stats``.
METRICS: dict[str, tuple[str, str]] = {
    "vllm:kvlife_stored_blocks": ("counter", "Blocks whose store to the host tier completed."),
    "vllm:kvlife_loaded_blocks": ("counter", "Blocks loaded back to the device."),
    "vllm:kvlife_loaded_from_store_blocks": (
        "counter",
        "Blocks loaded from the persistent tier (host miss).",
    ),
    "vllm:kvlife_promoted_blocks": (
        "counter",
        "Persistent-tier pages read and verified into the host tier before a hit.",
    ),
    "vllm:kvlife_promote_misses": (
        "counter",
        "Persistent-tier pages found, then damaged or gone (or no room) at the read: misses.",
    ),
    "vllm:kvlife_evicted_blocks": ("counter", "Host blocks evicted (LRU) to make room."),
    "vllm:kvlife_dropped_host_full": (
        "counter",
        "prepare_store calls refused because every host page was pinned or pending.",
    ),
    "vllm:kvlife_refused": ("counter", "Lifecycle refusals and calls naming no known job."),
    "vllm:kvlife_pending_blocks": ("gauge", "Host blocks whose store is in flight."),
    "vllm:kvlife_host_usage_perc": ("gauge", "Fraction of host pages in use."),
}


class _LiveManagers:
    """The metrics source of this process's vLLM backend: its live managers' records summed."""

    def metrics(self) -> ManagerMetrics:
        return summed([m.metrics() for m in live_managers()])


class OffloadCollector(ManagerCollector):
    """The core's :class:`~kvlife.metrics.ManagerCollector` over this process's kvlife
    managers (``kvlife_vllm_*``: the fields of ``kvlife_*``), plus the workers' transfer
    seconds: ``REGISTRY.register(OffloadCollector())`` (families: ``docs/vllm.md``)."""

    def __init__(self, *, labels: dict[str, str] | None = None) -> None:
        super().__init__(_LiveManagers(), labels=labels, prefix="kvlife_vllm")

    def collect(self) -> Iterator[Any]:
        """The record's families, then the workers' transfer time by direction."""
        from prometheus_client.core import CounterMetricFamily

        yield from super().collect()
        names, values = list(self.labels), list(self.labels.values())
        seconds = CounterMetricFamily(
            "kvlife_vllm_transfer_seconds", "Worker transfer time", labels=[*names, "direction"]
        )
        workers = live_workers()
        for direction in ("store", "load"):
            total = sum(w.seconds[direction] for w in workers)
            seconds.add_metric([*values, direction], total)
        yield seconds
