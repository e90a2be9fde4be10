"""The vLLM backend's Prometheus collector (the metric table vLLM's ``get_stats`` reports,
:data:`METRICS`, is the manager's, in :mod:`.scheduler`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvlife.integrations.vllm.scheduler import METRICS, live_managers
from kvlife.integrations.vllm.worker import live_workers
from kvlife.manager import ManagerMetrics
from kvlife.metrics import ManagerCollector, summed

__all__ = ["METRICS", "OffloadCollector"]


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
