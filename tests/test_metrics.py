"""The Prometheus collector shows exactly the manager's snapshot."""

from __future__ import annotations

import pytest
import torch

from kvlife import FinishReason
from kvlife.engine.cpu import CpuCopyEngine
from kvlife.errors import ManagerError
from kvlife.layout import PageFirstLayout
from kvlife.manager import OffloadManager
from kvlife.pool import HostPagePool
from kvlife.store.memory import MemoryStore

prometheus_client = pytest.importorskip("prometheus_client")

from kvlife.metrics import ManagerCollector, scalar_fields  # noqa: E402


def test_collector_matches_snapshot() -> None:
    layout = PageFirstLayout.zeros(1, 16, 4, 1, 4, dtype=torch.float32)
    host = HostPagePool(8, layout.page_numel, torch.float32)
    store = MemoryStore()
    with CpuCopyEngine(layout, host, copy_delay=0.01) as engine:
        manager = OffloadManager(engine, host, store, page_size=4)
        registry = prometheus_client.CollectorRegistry()
        registry.register(ManagerCollector(manager, labels={"rank": "0"}))
        lc = manager.start("r", [], None)
        manager.offload(lc, list(range(9)), [0, 1, 2])
        manager.finish(lc, FinishReason.ABORTED)
        # a step after finish is refused and counted
        with pytest.raises(ManagerError, match="decoding has ended"):
            manager.offload(lc, list(range(9)), [0, 1, 2])
        manager.close()
    store.close()
    snap = manager.metrics()
    sample = registry.get_sample_value
    assert len(scalar_fields()) == 20  # every scalar but the latency summary's
    for field, kind, _ in scalar_fields():
        name = f"kvlife_{field}_total" if kind == "counter" else f"kvlife_{field}"
        assert sample(name, {"rank": "0"}) == getattr(snap, field), field
    assert sample("kvlife_pages_stored_total", {"rank": "0"}) == 2
    assert sample("kvlife_lifecycles", {"rank": "0", "state": "RELEASED"}) == 1
    assert sample("kvlife_refused_events_total", {"rank": "0", "error": "ManagerError"}) == 1
    assert sample("kvlife_ack_latency_seconds_count", {"rank": "0"}) == 1
