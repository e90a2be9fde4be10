"""Test a runtime's offload bookkeeping with kvlife.testing: ``pytest examples/test_my_runtime.py``.

The runtime here is built on kvlife's OffloadManager, with its own subclass
(it counts releases); ManagerAdapter plugs it into the kit with a scripted
copy engine, so the kit decides when every copy completes. A runtime not
built on kvlife writes its own adapter (see kvlife.testing.RuntimeAdapter).
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings

from kvlife.manager import OffloadManager
from kvlife.testing import (
    KIT_SETTINGS,
    CheckConfig,
    KitOptions,
    ManagerAdapter,
    check_exhaustively,
    run_kit,
)

#: What the kit may do to this runtime (the defaults: it has a per-copy failure path and
#: retracts and resumes requests). The same options drive both checks below.
OPTIONS = KitOptions()


class MyManager(OffloadManager):
    """The runtime's manager: kvlife's, plus a count of releases for its dashboard."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.releases = 0

    def _on_release(self, lc: Any) -> None:
        self.releases += 1
        super()._on_release(lc)


def my_adapter() -> ManagerAdapter:
    """The runtime as the kit drives it: 4-token pages, a 2-page stride, a tiny host pool."""
    return ManagerAdapter(page_size=4, stride=8, host_pages=4, manager_factory=MyManager)


def test_my_runtime_keeps_the_lifecycle_rules() -> None:
    """Reused rids, late and out-of-order completions, aborts, retractions, resumes."""
    run_kit(
        my_adapter, settings(KIT_SETTINGS, max_examples=50, stateful_step_count=30), options=OPTIONS
    )


def test_my_runtime_in_every_interleaving() -> None:
    """Every interleaving of two lives sharing a rid, one one-page chunk each."""

    def one_page_stride() -> ManagerAdapter:  # each decode step makes one chunk due
        return ManagerAdapter(page_size=4, host_pages=5, manager_factory=MyManager)

    cfg = CheckConfig(requests=2, chunks=1, page_size=4, options=OPTIONS)
    report = check_exhaustively(cfg, one_page_stride)
    assert report.ok, report.violations
    print(f"{report.interleavings} interleavings in {report.elapsed_s:.1f} s")
