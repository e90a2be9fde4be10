"""The vLLM backend's metric table (vLLM's ``get_stats``) and its Prometheus collector."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

# vLLM is an optional dependency: mypy runs without it, hence the ignores.
from kvlife.integrations.vllm._common import live_managers, live_workers

logger = logging.getLogger(__name__)

#: Metric name -> (kind, documentation). Counters are deltas per ``get_stats``.
METRICS: dict[str, tuple[str, str]] = {
    "vllm:kvlife_stored_blocks": ("counter", "Blocks whose store to the host tier completed."),
    "vllm:kvlife_loaded_blocks": ("counter", "Blocks loaded back to the device."),
    "vllm:kvlife_loaded_from_store_blocks": (
        "counter",
        "Blocks loaded from the persistent tier (host miss).",
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

#: The counter metrics' names and the manager's counts they report (``_Counts`` fields).
_COUNTER_NAMES = tuple(name for name, (kind, _) in METRICS.items() if kind == "counter")
_COUNTED = ("stored", "loaded", "loaded_from_store", "evicted", "dropped_host_full", "refused")


class OffloadCollector:
    """A ``prometheus_client`` collector of this process's kvlife roles, read at scrape
    time: ``REGISTRY.register(OffloadCollector())`` (its families: ``docs/vllm.md``)."""

    _GAUGES = ("pending", "pinned", "live_lifecycles", "host_pages_used")

    def describe(self) -> list[Any]:
        """No up-front description: the registry calls :meth:`collect` instead."""
        return []

    def collect(self) -> Iterator[Any]:
        """One family per figure, summed over this process's live managers and workers."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        books = [m.accounting() for m in live_managers()]
        for family_type, names in (
            (CounterMetricFamily, _COUNTED),
            (GaugeMetricFamily, self._GAUGES),
        ):
            for name in names:
                family = family_type(f"kvlife_vllm_{name}", f"kvlife vLLM backend: {name}")
                family.add_metric([], float(sum(b[name] for b in books)))
                yield family
        seconds = CounterMetricFamily(
            "kvlife_vllm_transfer_seconds", "Worker transfer time", labels=["direction"]
        )
        for direction in ("store", "load"):
            seconds.add_metric([direction], sum(w.seconds[direction] for w in live_workers()))
        yield seconds
