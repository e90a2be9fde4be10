"""The host tier (kvlife/host_tier.py): pending/ready entries, pin counts, per-key completion,
prefix-aware eviction, the pending deadline and the events, each refusal changing nothing."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlife.errors import ConfigError, TierError
from kvlife.host_tier import HostTier, Lookup, TierEvent
from kvlife.pool import HostPagePool
from kvlife.refusals import Refusals


def tier(pages: int = 4, *, strict: bool = False, **kwargs: object) -> HostTier[str]:
    pool = HostPagePool(pages, 2, torch.int8, pin_memory=False)
    return HostTier(pool, refusals=Refusals(strict=strict), **kwargs)  # type: ignore[arg-type]


def state(t: HostTier[str]) -> tuple[object, ...]:
    """Everything observable: per key (lookup, page, pins), the counts, the pool."""
    held = tuple(
        (k, t.lookup(k), e.page, e.pins) for k in t.held() if (e := t.entry(k)) is not None
    )
    return held, t.counts, t.pool.num_used, t.pool.owned_by(t)


def store(t: HostTier[str], *keys: str) -> None:
    plan = t.prepare_store(keys)
    assert plan is not None
    t.complete_store(plan.keys)


def reachable(t: HostTier[str], prefix: list[str]) -> int:
    """Blocks a lookup that stops at the first miss would load."""
    n = 0
    while n < len(prefix) and t.lookup(prefix[n]) is Lookup.HIT:
        n += 1
    return n


def test_scenario_eviction_keeps_the_head_a_lookup_can_reach() -> None:
    """Scenario: request A stores its 4-page prefix and finishes; request B needs 2 pages.
    Plain LRU evicts A's head (a0, a1) and keeps a tail no lookup reaches (0 blocks for a
    returning A). The tier evicts A's tail: a returning A loads its first 2 pages."""
    t = tier(4)
    prefix = ["a0", "a1", "a2", "a3"]
    store(t, *prefix)
    t.finished(prefix)
    plan = t.prepare_store(["b0", "b1"])
    assert plan is not None and plan.evicted == ["a3", "a2"]
    assert reachable(t, prefix) == 2


def test_recency_is_per_request_a_finished_request_keeps_its_head_last() -> None:
    t = tier(4)
    store(t, "a0", "a1")
    store(t, "c0", "c1")
    t.finished(["a0", "a1"])  # A finished after C stored: A is the more recent request
    plan = t.prepare_store(["b0"])
    assert plan is not None and plan.evicted == ["c0"]  # C's head is older than all of A


PREFIX = ["a0", "a1", "a2", "a3"]


def _completion_orders() -> list[object]:
    orders: list[object] = [tuple(p) for p in itertools.permutations(PREFIX)]
    orders += [set(PREFIX), [["a3", "a1"], ["a0"], ["a2"]]]  # a set; two jobs, then one
    return orders


@pytest.mark.parametrize("finish_first", [True, False], ids=["finished-first", "finished-last"])
@pytest.mark.parametrize("completions", _completion_orders())
def test_scenario_a_finished_prefix_loses_its_tail_first_whatever_its_completion_order(
    finish_first: bool, completions: object
) -> None:
    """Scenario: request A prepares the stores of its 4-page prefix; it finishes before
    (or after) they complete, and the completions come in any order: every permutation
    as a tuple, a set (vLLM 0.32's connector hands one: its order follows
    PYTHONHASHSEED), or several jobs. The tail goes first whatever the order: a
    returning A still reaches its head. Before, keys pending at the finish went idle at
    the recent end in completion order, so the head could be evicted first."""
    t = tier(4)
    assert t.prepare_store(PREFIX) is not None
    if finish_first:
        t.finished(PREFIX)
    jobs = completions if isinstance(completions, list) else [completions]
    for job in jobs:
        t.complete_store(job)  # type: ignore[arg-type]
    if not finish_first:
        t.finished(PREFIX)
    plan = t.prepare_store(["b0", "b1"])
    assert plan is not None and plan.evicted == ["a3", "a2"]
    assert reachable(t, PREFIX) == 2


@pytest.mark.parametrize("finish_first", [True, False], ids=["finished-first", "finished-last"])
def test_scenario_a_finished_prefix_read_by_a_load_loses_its_tail_first(
    finish_first: bool,
) -> None:
    """Scenario: request B loads A's stored prefix and finishes before (or after) its load
    completes, the completions head first: pinned keys are ranked at the finish too (before,
    they went idle at the recent end in completion order: the head was evicted first)."""
    t = tier(4)
    store(t, *PREFIX)
    t.finished(PREFIX)
    assert t.prepare_load(PREFIX) is not None
    if finish_first:
        t.finished(PREFIX)
    for key in PREFIX:
        t.complete_load([key])
    if not finish_first:
        t.finished(PREFIX)
    plan = t.prepare_store(["b0", "b1"])
    assert plan is not None and plan.evicted == ["a3", "a2"]


def test_scenario_an_old_requests_late_completion_never_outranks_a_newer_request() -> None:
    """Scenario: old request O prepares its stores and finishes; new request N stores,
    completes and finishes; O's copies complete last. O is still the older request: its
    tail is the first victim, then its head, and N's keys stay. Before, O's late
    completion made O's keys the most recent and N's head went first."""
    t = tier(4)
    assert t.prepare_store(["o0", "o1"]) is not None
    t.finished(["o0", "o1"])
    store(t, "n0", "n1")
    t.finished(["n0", "n1"])
    t.complete_store({"o1", "o0"})
    plan = t.prepare_store(["x"])
    assert plan is not None and plan.evicted == ["o1"]
    assert t.eviction_order() == ["o0", "n1", "n0"]


def test_a_pin_or_a_completion_moves_no_key_in_the_eviction_order() -> None:
    """A key keeps its place by rank while a load pins it: passed over while pinned, it is the
    next victim again once unpinned, as its rank says (no pin or unpin re-ranks it)."""
    t = tier(3)
    store(t, "a", "b")
    assert t.prepare_load(["a"]) is not None
    plan = t.prepare_store(["c", "d"])
    assert plan is not None and plan.evicted == ["b"]  # a is pinned: passed over
    t.complete_store(["d", "c"])
    t.complete_load(["a"])
    assert t.eviction_order() == ["a", "c", "d"]
    plan = t.prepare_store(["e"])
    assert plan is not None and plan.evicted == ["a"]


def test_a_running_requests_keys_rank_by_position_below_later_requests() -> None:
    """rank(): a running request's keys as (request, -position): its tail goes before its
    head, the whole request before a later one's keys and before any key re-ranked after."""
    t = tier(6)
    store(t, "r0", "r1", "r2")
    request = t.new_rank()[0]
    t.rank([("r2", (request, -3)), ("r0", (request, -1)), ("r1", (request, -2))])
    store(t, "s0")
    assert t.eviction_order() == ["r2", "r1", "r0", "s0"]
    t.rank([("s0", (0, 0))])  # lower than s0's own rank: kept
    t.finished(["r0", "r1"])
    assert t.eviction_order() == ["r2", "s0", "r1", "r0"]
    assert t.rank_of("r0") is not None and t.rank_of("zz") is None
    plan = t.prepare_store(["v", "w", "x", "y", "z"])  # victims in that order: heap and lane
    assert plan is not None and plan.evicted == ["r2", "s0", "r1"]


_SEEDED = """
from kvlife.host_tier import HostTier
from kvlife.pool import HostPagePool
import torch
t = HostTier(HostPagePool(4, 2, torch.int8, pin_memory=False))
prefix = [f"request-7/block-{i}" for i in range(4)]
t.prepare_store(prefix)
t.finished(prefix)
t.complete_store(set(prefix))
print(t.prepare_store(["other"]).evicted == [prefix[-1]])
"""


def test_tail_first_under_several_hash_seeds() -> None:
    """Scenario: the completion is a set, iterated in an order PYTHONHASHSEED decides; under
    every seed the prefix's tail is the first victim (before: the head in most seeds)."""
    results = []
    for seed in ("0", "1", "2", "3", "4"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _SEEDED], env=env, capture_output=True, text=True, check=True
        )
        results.append(out.stdout.strip())
    assert results == ["True"] * 5, results


@pytest.mark.parametrize(
    "completions",
    [
        [["k1"], ["k2"], ["k3"]],  # subsets, one key at a time
        [["k1", "k2", "k3"]],  # the union of two jobs
        [["k3"], ["k2", "k1"]],  # out of order, across jobs
    ],
)
def test_completion_is_per_key_whatever_the_grouping(completions: list[list[str]]) -> None:
    t = tier(4)
    assert t.prepare_store(["k1", "k2"]) is not None and t.prepare_store(["k3"]) is not None
    for keys in completions:
        t.complete_store(keys)
    assert [t.lookup(k) for k in ("k1", "k2", "k3")] == [Lookup.HIT] * 3
    assert (t.counts.pending, t.counts.evictable, t.refusals.total) == (0, 3, 0)


def test_a_completion_naming_a_key_with_nothing_in_flight_is_refused_and_changes_nothing() -> None:
    t = tier(4)
    t.prepare_store(["k1"])
    before = state(t)
    t.complete_store(["k9"])  # a superset's extra key: never stored
    t.complete_load(["k1"])  # pending, not pinned
    assert state(t) == before and t.refusals.total == 2
    strict = tier(4, strict=True)
    strict.prepare_store(["k1"])
    before = state(strict)
    with pytest.raises(TierError, match="nothing in flight"):
        strict.complete_store(["k1", "k9"])  # strict: checked before k1 is settled
    with pytest.raises(TierError):
        strict.complete_store(["k1", "k1"])  # the second k1 has nothing left
    assert state(strict) == before


def test_two_identical_loads_are_two_pins_and_need_two_completions() -> None:
    t = tier(2)
    store(t, "k")
    assert t.prepare_load(["k"]) == t.prepare_load(["k"]) == [t.entry("k").page]  # type: ignore[union-attr]
    assert t.entry("k").pins == 2 and t.counts.evictable == 0  # type: ignore[union-attr]
    assert t.prepare_store(["x", "y"]) is None  # k is pinned: no room, nothing changed
    t.complete_load(["k"])
    assert t.entry("k").pins == 1 and t.counts.evictable == 0  # type: ignore[union-attr]
    t.complete_load(["k"])
    assert t.entry("k").pins == 0 and t.counts.evictable == 1  # type: ignore[union-attr]
    before = state(t)
    t.complete_load(["k"])  # a third: refused, pins never negative
    assert state(t) == before and t.refusals.count("complete_load") == 1


def test_a_pending_key_is_never_a_hit_nor_loaded_nor_evicted() -> None:
    t = tier(1)
    t.prepare_store(["k"])
    assert t.lookup("k") is Lookup.PENDING
    before = state(t)
    assert t.prepare_load(["k"]) is None
    assert t.prepare_store(["x"]) is None  # the only page is pending
    assert state(t) == before


def test_scenario_a_store_past_its_deadline_stops_being_a_hit_but_its_page_waits() -> None:
    """Scenario: a store's completion never comes (vLLM #49829). Past the deadline its key
    is a miss; its page is still being written, so it is freed only by the late completion."""
    now = [0.0]
    t = tier(2, pending_timeout=5.0, clock=lambda: now[0])
    plan = t.prepare_store(["k"])
    assert plan is not None
    now[0] = 4.9
    assert t.expire() == [] and t.lookup("k") is Lookup.PENDING
    now[0] = 5.0
    assert t.expire() == ["k"] and t.lookup("k") is Lookup.MISS
    assert t.pool.owner_of(plan.pages[0]) is t  # never freed under the copy
    assert t.counts.expired == t.counts.orphans == 1
    assert t.prepare_store(["k"]) == ([], [], [])  # not stored again while the copy may run
    t.complete_store(["k"])  # the late completion
    assert t.pool.owner_of(plan.pages[0]) is None and t.counts.orphans == 0
    assert t.lookup("k") is Lookup.MISS and t.counts.late_completions == 1


def test_events_come_in_order_a_removal_before_the_store_reusing_its_page() -> None:
    t = tier(1)
    store(t, "a")
    plan = t.prepare_store(["b"])
    assert plan is not None and plan.evicted == ["a"]
    t.complete_store(["b"])
    assert t.take_events() == [
        TierEvent(("a",), False),
        TierEvent(("a",), True),
        TierEvent(("b",), False),
    ]
    assert t.take_events() == []


def test_a_staging_tier_frees_an_entry_once_idle_and_says_so() -> None:
    t = tier(2, keep=False)
    store(t, "a")
    assert t.lookup("a") is Lookup.MISS and t.pool.num_used == 0
    assert t.take_events() == [TierEvent(("a",), False), TierEvent(("a",), True)]


def test_reset_keeps_pages_under_copies_until_their_completion() -> None:
    t = tier(3)
    store(t, "r")
    t.prepare_load(["r"])
    t.prepare_store(["p"])
    store(t, "i")
    t.reset()
    assert len(t) == 0 and t.pool.num_used == 2  # r (pinned) and p (pending) wait
    t.complete_load(["r"])
    t.complete_store(["p"])
    assert t.pool.num_used == 0 and t.counts.orphans == 0 and t.counts.pinned == 0


def test_adopt_keeps_staged_pages_and_gives_back_duplicates() -> None:
    t = tier(3)
    store(t, "a")
    owner = object()
    pages = t.pool.alloc(2, owner)
    assert pages is not None
    assert t.adopt(["a", "b"], pages, owner) == ["b"]
    assert t.pool.owner_of(pages[0]) is None and t.pool.owner_of(pages[1]) is t
    assert t.lookup("b") is Lookup.HIT


def test_a_bad_pending_timeout_is_a_config_error() -> None:
    for bad in (0, -1, float("inf"), True, "5"):
        with pytest.raises(ConfigError, match="pending_timeout"):
            tier(2, pending_timeout=bad)


KEYS = st.sampled_from([f"k{i}" for i in range(6)])


class TierMachine(RuleBasedStateMachine):
    """Random prepare/complete/load/evict/deadline sequences against a plain model: no key
    both pending and evicted, pins never negative, capacity never exceeded, nothing stuck
    after every copy completed."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.t: HostTier[str] = tier(3, pending_timeout=10.0, clock=lambda: self.now)
        self.pending: list[str] = []  # stores in flight (their keys), incl. expired ones
        self.loads: list[str] = []  # pins in flight
        self.refused = 0  # refusals the model expects (loads of keys not ready)

    @rule(keys=st.lists(KEYS, min_size=1, max_size=3))
    def prepare_store(self, keys: list[str]) -> None:
        order = [k for k in self.t.eviction_order() if k not in keys]
        plan = self.t.prepare_store(keys)
        if plan is not None:
            assert plan.evicted == order[: len(plan.evicted)]  # the least recent idle keys
            assert not set(plan.evicted) & set(keys)
            assert not set(plan.evicted) & set(self.pending) & set(self.t.held())
            assert not set(plan.evicted) & set(self.loads)
            self.pending += plan.keys

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        keys = data.draw(st.lists(st.sampled_from(self.pending), min_size=1, unique=True))
        for key in keys:
            self.pending.remove(key)
        self.t.complete_store(keys, success=success)
        assert self.t.refusals.total == self.refused

    @rule(key=KEYS)
    def load(self, key: str) -> None:
        hit = self.t.lookup(key) is Lookup.HIT
        before = state(self.t)
        pages = self.t.prepare_load([key])
        assert (pages is not None) == hit
        if pages is not None:
            self.loads.append(key)
        else:  # pending or missing: refused, nothing pinned
            assert state(self.t) == before
            self.refused += 1

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.loads))
        self.loads.remove(key)
        self.t.complete_load([key])
        assert self.t.refusals.total == self.refused

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4, unique=True))
    def finish(self, keys: list[str]) -> None:
        self.t.finished(keys)
        ranks = [self.t.rank_of(k) for k in keys if k in self.t.held()]
        assert ranks == sorted(ranks, reverse=True)  # the head the most recent

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4, unique=True), lower=st.booleans())
    def rank_running(self, keys: list[str], lower: bool) -> None:
        """A running request ranks its keys by position (into the heap; prepare_store's
        victims must still follow eviction_order across the heap and the lane)."""
        request = self.t.new_rank()[0]
        self.t.rank([(k, (request, -i)) for i, k in enumerate(keys)], lower=lower)
        held = [k for k in keys if k in self.t.held()]
        assert [self.t.rank_of(k) for k in held] == [(request, -keys.index(k)) for k in held]

    @rule(key=KEYS)
    def stray_completion(self, key: str) -> None:
        if key not in self.pending and key not in self.loads:
            before = state(self.t)
            total = self.t.refusals.total
            self.t.complete_store([key])
            self.t.complete_load([key])
            assert state(self.t) == before and self.t.refusals.total == total + 2
            self.refused += 2

    @rule(dt=st.floats(0, 8))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        for key in self.t.expire():
            assert self.t.lookup(key) is Lookup.MISS

    @invariant()
    def accounted(self) -> None:
        t, c = self.t, self.t.counts
        assert t.pool.num_used <= t.capacity
        entries = [t.entry(k) for k in t.held()]
        assert all(e is not None and e.pins >= 0 for e in entries)
        assert c.pinned == len(self.loads) and c.pinned >= 0
        assert c.pending == sum(1 for e in entries if e and e.pending)
        assert c.evictable == sum(1 for e in entries if e and not e.pending and not e.pins)
        assert t.pool.num_used == len(entries) + c.orphans

    def teardown(self) -> None:
        self.t.complete_store(list(self.pending))
        self.t.complete_load(list(self.loads))
        c = self.t.counts
        assert (c.pending, c.pinned, c.orphans) == (0, 0, 0)
        assert self.t.refusals.total == self.refused
        assert c.evictable == len(self.t)


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
