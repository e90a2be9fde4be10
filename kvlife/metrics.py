"""Prometheus exposure of :class:`~kvlife.manager.ManagerMetrics` (needs ``prometheus_client``)::

    from prometheus_client import REGISTRY
    REGISTRY.register(ManagerCollector(manager))

The collector reads ``manager.metrics()`` at scrape time, on the exporter's thread: nothing
on the hot path, the same figures as the snapshot (plain ints, so a scrape may see one
event half-counted across two metrics, never a torn value).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Protocol

from kvlife.errors import MissingDependency

if TYPE_CHECKING:
    from kvlife.manager import ManagerMetrics


class MetricsSource(Protocol):
    """Whatever answers ``metrics()`` with a :class:`~kvlife.manager.ManagerMetrics` record
    (an ``OffloadManager``; an integration's manager, such as the vLLM backend's)."""

    def metrics(self) -> ManagerMetrics: ...


__all__ = ["ManagerCollector", "MetricsSource", "MissingDependency", "scalar_fields", "summed"]

PREFIX = "kvlife"


def scalar_fields() -> list[tuple[str, str, str]]:
    """``(field, kind, help)`` of each scalar :class:`~kvlife.manager.ManagerMetrics` field
    that is exposed as it is: read from the dataclass (counters only grow; gauges go both
    ways)."""
    from kvlife.manager import ManagerMetrics

    return [
        (f.name, f.metadata["kind"], f.metadata["help"])
        for f in fields(ManagerMetrics)
        if "kind" in f.metadata
    ]


def summed(records: Sequence[ManagerMetrics]) -> ManagerMetrics:
    """One record of several (the managers of one process): counts and gauges added, dicts
    added key by key, the latency maximum the largest."""
    from kvlife.manager import ManagerMetrics

    total = ManagerMetrics()
    for record in records:
        for f in fields(ManagerMetrics):
            mine, theirs = getattr(total, f.name), getattr(record, f.name)
            if isinstance(mine, dict):
                setattr(total, f.name, dict(Counter(mine) + Counter(theirs)))
            elif f.name.endswith("_max_s"):
                setattr(total, f.name, max(mine, theirs))
            else:
                setattr(total, f.name, mine + theirs)
    return total


class ManagerCollector:
    """A ``prometheus_client`` collector of one metrics source (an
    :class:`~kvlife.manager.OffloadManager`, or an integration's manager); ``prefix`` begins
    each family's name (``kvlife_vllm`` for the vLLM backend: the same fields)."""

    def __init__(
        self, manager: MetricsSource, *, labels: dict[str, str] | None = None, prefix: str = PREFIX
    ) -> None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise MissingDependency(
                "prometheus_client is not installed: pip install 'kvlife[metrics]'"
            ) from None
        self.manager = manager
        self.prefix = prefix
        self.labels = dict(labels or {})

    def describe(self) -> list[Any]:
        """No up-front description: the registry calls :meth:`collect` instead."""
        return []

    def collect(self) -> Iterator[Any]:
        """One family per snapshot field, read now."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            SummaryMetricFamily,
        )

        snap = self.manager.metrics()
        names, values = list(self.labels), list(self.labels.values())
        for field, kind, help_text in scalar_fields():
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_type(f"{self.prefix}_{field}", help_text, labels=names)
            family.add_metric(values, float(getattr(snap, field)))
            yield family
        states = GaugeMetricFamily(
            f"{self.prefix}_lifecycles", "Request lives by state", labels=[*names, "state"]
        )
        for state, count in snap.lifecycles_by_state.items():
            states.add_metric([*values, state], float(count))
        yield states
        refused = CounterMetricFamily(
            f"{self.prefix}_refused_events", "Events refused, by error", labels=[*names, "error"]
        )
        for error, count in snap.refused_events.items():
            refused.add_metric([*values, error], float(count))
        yield refused
        latency = SummaryMetricFamily(
            f"{self.prefix}_ack_latency_seconds", "Submit-to-ack latency of chunks", labels=names
        )
        latency.add_metric(values, snap.ack_latency_count, snap.ack_latency_sum_s)
        yield latency
