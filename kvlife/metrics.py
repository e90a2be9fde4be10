"""Prometheus exposure of :class:`~kvlife.manager.ManagerMetrics` (needs ``prometheus_client``).

The collector reads ``manager.metrics()`` at scrape time, so it adds nothing to
the hot path and always shows the same figures as the snapshot; each scalar
field's kind and help are the dataclass field's metadata::

    from prometheus_client import REGISTRY
    REGISTRY.register(ManagerCollector(manager))

Scrapes happen on the exporter's thread while the scheduler thread mutates the
manager; the snapshot reads plain integer counters, so a scrape may see one
event half-counted across two metrics, never a torn value or an exception.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from kvlife.errors import MissingDependency

if TYPE_CHECKING:
    from kvlife.manager import OffloadManager

__all__ = ["ManagerCollector", "MissingDependency", "scalar_fields"]

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


class ManagerCollector:
    """A ``prometheus_client`` collector of one :class:`~kvlife.manager.OffloadManager`."""

    def __init__(self, manager: OffloadManager, *, labels: dict[str, str] | None = None) -> None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise MissingDependency(
                "prometheus_client is not installed: pip install 'kvlife[metrics]'"
            ) from None
        self.manager = manager
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
            family = family_type(f"{PREFIX}_{field}", help_text, labels=names)
            family.add_metric(values, float(getattr(snap, field)))
            yield family
        states = GaugeMetricFamily(
            f"{PREFIX}_lifecycles", "Request lives by state", labels=[*names, "state"]
        )
        for state, count in snap.lifecycles_by_state.items():
            states.add_metric([*values, state], float(count))
        yield states
        refused = CounterMetricFamily(
            f"{PREFIX}_refused_events", "Events refused, by error", labels=[*names, "error"]
        )
        for error, count in snap.refused_events.items():
            refused.add_metric([*values, error], float(count))
        yield refused
        latency = SummaryMetricFamily(
            f"{PREFIX}_ack_latency_seconds", "Submit-to-ack latency of chunks", labels=names
        )
        latency.add_metric(values, snap.ack_latency_count, snap.ack_latency_sum_s)
        yield latency
