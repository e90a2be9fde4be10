"""Agreement across ranks with real processes in a real gloo group (no mocks).

Each multi-rank test spawns its ranks once and runs several scenarios in
them; every rank writes what it saw to a JSON file, and the test compares the
ranks here. A rank that hangs is killed by the spawner, so a test fails
instead of hanging.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kvlife import cli
from kvlife._lifecycle import Lifecycle, LoadTicket, Ticket
from kvlife.distributed import TorchAgreement, chunk_fingerprint
from kvlife.engine.base import Ack
from kvlife.engine.cpu import CpuCopyEngine, CpuCopyEvent
from kvlife.errors import AgreementError, ConfigError, GroupBroken
from kvlife.layout import LayerFirstLayout
from kvlife.manager import OffloadManager, OffloadRequest
from kvlife.pool import HostPagePool
from kvlife.sim.distributed import init_rank, run_rank, spawn_ranks
from kvlife.sim.runtime import SimConfig
from kvlife.store.memory import MemoryStore

PAGE = 4
TIMEOUT = 30.0  # the agreement's collective timeout in the scenarios (a hang guard)


def tokens(n: int, salt: int) -> list[int]:
    """``n`` token ids that differ for every salt."""
    return [(salt * 7919 + i * 31) % 50_000 for i in range(n)]


# ---------------------------------------------------------------- parts in a rank


class RecordingEngine:
    """The CPU engine, recording when each ack reached the scheduler thread (monotonic clock)."""

    def __init__(self, inner: CpuCopyEngine) -> None:
        self.inner = inner
        self.reported: dict[str, float] = {}
        self.events: dict[str, CpuCopyEvent] = {}

    def check(
        self, device_pages: Sequence[int], host_pages: Sequence[int], load: bool = False
    ) -> None:
        self.inner.check(device_pages, host_pages, load=load)

    def submit(
        self, ticket: Ticket, device_pages: Sequence[int], host_pages: Sequence[int]
    ) -> None:
        self.events[name(ticket)] = self.inner.submit(ticket, device_pages, host_pages)

    def _record(self, acks: list[Ack]) -> list[Ack]:
        now = time.monotonic()
        for ack in acks:
            self.reported[name(ack.ticket)] = now
        return acks

    def poll(self) -> list[Ack]:
        return self._record(self.inner.poll())

    def drain(self, timeout: float | None = None) -> list[Ack]:
        return self._record(self.inner.drain(timeout))

    @property
    def inflight(self) -> int:
        return self.inner.inflight

    def close(self) -> None:
        self.inner.close()


class RecordingAgreement(TorchAgreement):
    """TorchAgreement, recording each agreed ack's name and the monotonic time it was returned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.applied: list[str] = []
        self.applied_at: dict[str, float] = {}

    def agree(self, acks: list[Ack]) -> list[Ack]:
        out = super().agree(acks)
        now = time.monotonic()
        for ack in out:
            self.applied.append(name(ack.ticket))
            self.applied_at[name(ack.ticket)] = now
        return out


def name(ticket: Ticket) -> str:
    """A chunk's name that every rank gives it alike: rid/seq."""
    return f"{ticket[0].rid}/{ticket[1]}"


@dataclass
class Rig:
    """One rank's offload parts: KV shard, host pool, engine, store, manager, agreement."""

    layout: LayerFirstLayout
    host: HostPagePool
    cpu: CpuCopyEngine
    engine: RecordingEngine
    store: ReadFailingStore
    agreement: RecordingAgreement
    manager: OffloadManager
    released: list[str] = field(default_factory=list)

    def on_release(self, lc: OffloadRequest, pages: object) -> None:
        self.released.append(str(lc.rid))

    def close_parts(self) -> None:
        self.cpu.close()
        self.store.close()


class ReadFailingStore(MemoryStore):
    """A memory store whose reads of ``fail_reads`` keys fail after ``contains`` said yes:
    a page that vanished between a load's agreed lookup and its read (forced here)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_reads: set[str] = set()

    def get(self, key: str) -> bytes | None:
        if key in self.fail_reads:
            raise OSError(f"read of {key[:8]} failed")
        return super().get(key)

    def contains(self, key: str) -> bool:
        return super().get(key) is not None


def make_rig(
    rank: int,
    *,
    copy_delay: float = 0.0,
    workers: int = 1,
    timeout: float = TIMEOUT,
    host_pages: int = 64,
) -> Rig:
    layout = LayerFirstLayout.zeros(1, 64, PAGE, 1, 4, dtype=torch.float32)
    layout.k_buffers[0].fill_(rank + 1.0)  # each rank's shard holds its own values
    host = HostPagePool(host_pages, layout.page_numel, torch.float32, pin_memory=False)
    cpu = CpuCopyEngine(
        layout, host, copy_delay=copy_delay, delay_jitter=copy_delay, seed=rank, workers=workers
    )
    engine = RecordingEngine(cpu)
    store = ReadFailingStore()
    agreement = RecordingAgreement(timeout=timeout, host=host)
    manager = OffloadManager(engine, host, store, page_size=PAGE, agreement=agreement)
    return Rig(layout, host, cpu, engine, store, agreement, manager)


# ---------------------------------------------------------------- scenarios (run in each rank)


def gated_scenario(rank: int, world: int) -> dict[str, Any]:
    """The first chunk's copy is held on the last rank: no rank may apply it, or anything after."""
    rig = make_rig(rank, workers=2)  # a held copy blocks one worker; the other runs on
    m, slow = rig.manager, rank == world - 1
    a = m.start("a", [], rig.on_release)
    b = m.start("b", [], rig.on_release)
    gate = rig.cpu.hold_next() if slow else None
    assert m.offload(a, tokens(2 * PAGE + 1, 1), [0, 1, 2]) is not None  # a/0: 2 pages
    assert m.offload(b, tokens(PAGE + 1, 2), [10, 11]) is not None  # b/0
    assert m.offload(a, tokens(3 * PAGE + 1, 1), [0, 1, 2, 3]) is not None  # a/1
    for chunk, event in rig.engine.events.items():
        if not (slow and chunk == "a/0"):
            event.synchronize(TIMEOUT)  # complete here: only the held copy is missing
    for _ in range(5):
        m.poll()
    held = {
        "applied": list(rig.agreement.applied),
        "pending": rig.agreement.pending,
        "a_inflight": a.inflight,
        "b_inflight": b.inflight,
    }
    if gate is not None:
        gate.open()
    while rig.agreement.pending:  # the same on every rank: the ranks poll in lockstep
        m.poll()
    after = {"applied": list(rig.agreement.applied), "a": a.inflight, "b": b.inflight}
    m.finish(a)
    m.finish(b)
    m.close(timeout=TIMEOUT)
    rig.close_parts()
    return {
        "held": held,
        "after": after,
        "released": rig.released,
        "stored": sorted(rig.store.keys()),
    }


def slow_rank_scenario(rank: int, world: int) -> dict[str, Any]:
    """The last rank copies slowly (two workers: out of order); rank 0's 4th copy fails."""
    rig = make_rig(rank, copy_delay=0.02 if rank == world - 1 else 0.0, workers=2)
    m = rig.manager
    lives = [m.start(f"r{i}", tokens(3, 100 + i), rig.on_release) for i in range(6)]
    pages = {lc: list(range(8 * i, 8 * i + 8)) for i, lc in enumerate(lives)}
    toks = {lc: tokens(3, 100 + i) for i, lc in enumerate(lives)}
    submitted, armed = 0, False
    for step in range(24):
        for i, lc in enumerate(lives):
            if step > 12 + i:
                continue  # finished: no more steps
            toks[lc].append((step * 13 + i) % 50_000)
            if rank == 0 and submitted == 3 and not armed:
                rig.cpu.fail_next()
                armed = True
            if m.offload(lc, toks[lc], pages[lc]) is not None:
                submitted += 1
            if step == 12 + i:
                m.finish(lc)
        m.poll()
    m.close(timeout=TIMEOUT)
    rig.close_parts()
    metrics = m.metrics()
    return {
        "submitted": submitted,
        "reported": rig.engine.reported,
        "applied": rig.agreement.applied,
        "applied_at": rig.agreement.applied_at,
        "released": rig.released,
        "stored": sorted(rig.store.keys()),
        "copy_failures": metrics.copy_failures,
        "peer_failures": rig.agreement.peer_failures,
        "host_used": rig.host.num_used,
    }


def divergence_scenario(rank: int, world: int) -> dict[str, Any]:
    """The last rank submits a different third chunk; then, in a new agreement, one extra chunk."""
    out: dict[str, Any] = {}
    for case in ("different", "extra"):
        rig = make_rig(rank)
        m, odd = rig.manager, rank == world - 1
        x = m.start("x", [], rig.on_release)
        y = m.start("y", [], rig.on_release)
        m.offload(x, tokens(PAGE + 1, 1), [0, 1])
        m.offload(y, tokens(PAGE + 1, 2), [8, 9])
        m.poll()  # agreed so far: the check point moves past the first two chunks
        salt = 99 if (case == "different" and odd) else 3
        m.offload(x, tokens(PAGE + 1, 1) + tokens(PAGE, salt), [0, 1, 2])
        if case == "extra" and odd:
            m.offload(y, tokens(2 * PAGE + 1, 2), [8, 9, 10])
        before = (x.snapshot(), y.snapshot(), rig.host.num_used)
        seen: list[Any] = []
        for _ in range(2):  # the second poll must raise at once, not run a collective
            try:
                m.poll()
                seen.append(None)
            except AgreementError as exc:
                assert type(exc) is GroupBroken and "different chunk sequences" in str(exc)
                seen.append({"index": exc.index, "chunks": exc.chunks, "message": str(exc)})
        after = (x.snapshot(), y.snapshot(), rig.host.num_used)
        out[case] = {"seen": seen, "unchanged": before == after}
        rig.close_parts()
    return out


def load_scenario(rank: int, world: int) -> dict[str, Any]:
    """Loads across ranks: a conversation stored 3 pages and returns on a reused rid.

    1. The last rank's store lost page 2 (a write that failed there): every rank's lookup
       answers 2 ready pages, though rank 0 holds all 3.
    2. Page 1 cannot be read on rank 0 after the lookup: every rank loads page 0 only.
    3. The load's copy is held on the last rank: no rank applies its ack until it is done.
    4. A load whose copy fails on rank 0 fails on every rank (the request recomputes).
    5. A rank that looks up while its peers poll: GroupBroken on every rank, not a hang.
    """
    rig = make_rig(rank, workers=2)
    m, last = rig.manager, rank == world - 1
    prompt = tokens(3 * PAGE + 1, 5)
    first = m.start("c", [], rig.on_release)  # it decoded ``prompt``: its pages are stored
    m.offload(first, [*prompt, 0], [0, 1, 2, 3])
    m.finish(first)
    m.close(timeout=TIMEOUT)
    keys = m.lookup(prompt).keys
    if last:
        del rig.store._pages[keys[2]]
    found = m.lookup(prompt)
    if rank == 0:
        rig.store.fail_reads.add(keys[1])  # gone after the lookup: only rank 0 finds out
    back = m.start("c", prompt, rig.on_release)
    rig.layout.write_page(20, torch.full((rig.layout.page_numel,), -1.0))  # poison
    ticket = m.load(back, [20, 21, 22])
    loaded = [] if ticket is None else list(ticket.keys)
    m.close(timeout=TIMEOUT)
    restored = bool(torch.equal(rig.layout.read_page(20), rig.layout.read_page(0)))
    m.finish(back)

    held_case: dict[str, Any] = {}
    gated = m.start("g", prompt, rig.on_release)
    gate = rig.cpu.hold_next() if last else None
    assert m.load(gated, [30], pages=1) is not None
    for _ in range(5):
        m.poll()
    held_case["loading_while_held"] = gated.loading
    if gate is not None:
        gate.open()
    while rig.agreement.pending:  # the ranks poll in lockstep
        m.poll()
    held_case["loading_after"] = gated.loading
    m.finish(gated)

    failing = m.start("f", prompt, rig.on_release)
    if rank == 0:
        rig.cpu.fail_next()
    assert m.load(failing, [40], pages=1) is not None
    m.close(timeout=TIMEOUT)
    failed = (failing.load_failures, failing.loaded_pages)
    m.finish(failing)
    m.close(timeout=TIMEOUT)
    out = {
        "lookup": [found.ready, found.pending],
        "loaded": len(loaded),
        "restored": restored,
        "held": held_case,
        "failed": list(failed),
        "released": rig.released,
        "pinned": m.tier.counts.pinned,
        "host_used": rig.host.num_used,
        "peer_failures": rig.agreement.peer_failures,
    }
    rig.close_parts()

    rig = make_rig(rank)
    try:
        if rank == 0:
            rig.manager.lookup(prompt)
        else:
            rig.manager.poll()
        out["mismatch"] = None
    except GroupBroken as exc:
        out["mismatch"] = str(exc)
    rig.close_parts()
    return out


def sim_scenario(rank: int, world: int) -> dict[str, Any]:
    """The simulator on a small host pool: stores and release sequences per rank."""
    delay = 0.004 if rank == world - 1 else 0.0005
    cfg = SimConfig(
        requests=40, concurrency=8, host_pages=2, copy_delay=delay, rank=rank, rid_pool=4
    )
    figures = run_rank(cfg, timeout=TIMEOUT)
    keep = ("ok", "stored_keys", "stored_keys_digest", "releases", "release_digest")
    return {k: figures[k] for k in keep} | {"exhausted": figures["host_pool_exhausted"]}


def scenarios_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of the multi-rank test: every scenario in turn, in one gloo group."""
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    try:
        init_rank(rank, world, port, TIMEOUT)
        scenarios = (
            gated_scenario,
            slow_rank_scenario,
            divergence_scenario,
            load_scenario,
            sim_scenario,
        )
        for scenario in scenarios:
            result[scenario.__name__] = scenario(rank, world)
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def failing_peer_main(rank: int, world: int, port: int, out_dir: str, mode: str) -> None:
    """The last rank crashes (``os._exit``) or stops polling; the others must raise."""
    torch.set_num_threads(1)
    timeout = 2.0 if mode == "stuck" else TIMEOUT
    init_rank(rank, world, port, TIMEOUT)
    rig = make_rig(rank, timeout=timeout)  # the agreement's own wait, per collective
    m = rig.manager
    lc = m.start("c", [], rig.on_release)
    result: dict[str, Any] = {"rank": rank}
    t0 = time.monotonic()
    try:
        for step in range(40):
            if rank == world - 1 and step == 5:
                if mode == "crash":
                    os._exit(3)
                deadline = time.monotonic() + 10 * timeout  # alive, but not polling,
                while not Path(out_dir, "rank0.json").exists():  # until rank 0 gave up
                    assert time.monotonic() < deadline, "rank 0 never raised"
                    time.sleep(0.05)
            m.offload(lc, tokens(step + 2, 7), list(range(1 + (step + 1) // PAGE)))
            m.poll()
        result["error"] = None
    except GroupBroken as exc:
        result.update(error=type(exc).__name__, message=str(exc))
        try:
            m.poll()
        except GroupBroken as again:
            result["again"] = type(again).__name__
    result["elapsed"] = time.monotonic() - t0
    rig.close_parts()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # the group is broken: no orderly teardown


def promotion_failure_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of the promotion test: a 6-page host pool, three stored pages, and a read of
    page 1 that fails on rank 0 only (gone after every rank agreed it was there)."""
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    try:
        init_rank(rank, world, port, TIMEOUT)
        rig = make_rig(rank, host_pages=6)
        m, ag = rig.manager, rig.agreement
        prompt = tokens(3 * PAGE + 1, 5)
        first = m.start("c", [], rig.on_release)  # it decoded ``prompt``: 3 pages stored
        m.offload(first, [*prompt, 0], [0, 1, 2, 3])
        m.finish(first)
        m.close(timeout=TIMEOUT)
        m.poll()  # every page back: the budget is the whole pool again
        keys = m.lookup(prompt).keys
        budgets: dict[str, Any] = {"before": ag._budget}
        if rank == 0:
            rig.store.fail_reads.add(keys[1])
        back = m.start("b", prompt, rig.on_release)
        ticket = m.load(back, [20, 21, 22])
        budgets["after_load"] = ag._budget
        loaded = 0 if ticket is None else len(ticket.keys)
        # The next offload (4 pages) and polls: admitted alike on every rank, or on none.
        new = m.start("d", [], rig.on_release)
        offloads: list[bool] = []
        errors: list[str | None] = []
        toks = tokens(4 * PAGE, 9)
        for _ in range(4):
            toks.append(1)
            offloads.append(m.offload(new, toks, list(range(30, 36))) is not None)
            try:
                m.poll()
                errors.append(None)
            except GroupBroken as exc:
                errors.append(str(exc))
                break
        budgets["end"] = ag._budget
        if errors[-1] is None:
            m.finish(back)
            m.finish(new)
            m.close(timeout=TIMEOUT)
        result.update(
            budgets=budgets,
            loaded=loaded,
            offloads=offloads,
            errors=errors,
            stored=sorted(rig.store.keys()),
            released=rig.released,
            host_used=rig.host.num_used,
            pinned=m.tier.counts.pinned,
        )
        rig.close_parts()
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a broken group has no orderly teardown


def spawn(
    target: Callable[..., object], world: int, tmp_path: Path, *args: Any
) -> tuple[list[int | None], list[dict[str, Any] | None]]:
    codes = spawn_ranks(target, world, str(tmp_path), *args, join_timeout=240)
    results: list[dict[str, Any] | None] = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return codes, results


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_apply_only_what_every_rank_completed(world: int, tmp_path: Path) -> None:
    """Scenario: a tensor-parallel group of ``world`` ranks, one of them slow.

    1. The first chunk's copy is held on the last rank: after five polls no
       rank applied it, nor the two chunks after it that every rank completed
       (submission order); once released, all three are applied in order.
    2. The last rank copies slowly and out of order; rank 0's 4th copy fails:
       every rank applies each ack only after every rank reported it complete,
       treats the failure as a failure, and ends with the same store and the
       same release sequence.
    3. Divergent submissions raise GroupBroken on every rank, naming
       the first differing chunk; nothing changes; later polls raise again.
    4. The simulator with a host pool that runs out: identical stores and releases.
    """
    codes, results = spawn(scenarios_main, world, tmp_path)
    assert codes == [0] * world, (codes, results)
    ranks: list[dict[str, Any]] = []
    for r in results:
        assert r is not None and "error" not in r, r
        ranks.append(r)

    # 1. a held copy on one rank holds back every rank
    for r in ranks:
        gated = r["gated_scenario"]
        assert gated["held"] == {"applied": [], "pending": 3, "a_inflight": 2, "b_inflight": 1}
        assert gated["after"] == {"applied": ["a/0", "b/0", "a/1"], "a": 0, "b": 0}
        assert gated["released"] == ["a", "b"]
        assert gated["stored"] == ranks[0]["gated_scenario"]["stored"]
        assert len(gated["stored"]) == 4

    # 2. no rank applies an ack before every rank completed it
    slow = [r["slow_rank_scenario"] for r in ranks]
    first = slow[0]
    assert first["submitted"] > 20
    assert sorted(first["applied"]) == sorted(first["reported"])
    for s in slow:
        assert s["applied"] == first["applied"]  # the same acks, in the same order
        assert s["released"] == first["released"]
        assert s["stored"] == first["stored"]
        assert s["copy_failures"] == 1
        assert s["host_used"] == 0
        for chunk, applied_at in s["applied_at"].items():
            latest = max(t["reported"][chunk] for t in slow)
            assert applied_at >= latest, (chunk, applied_at, latest)
    assert [s["peer_failures"] for s in slow] == [0] + [1] * (world - 1)

    # 3. divergence is detected on every rank, at the first differing chunk
    for r in ranks:
        div = r["divergence_scenario"]
        for case in ("different", "extra"):
            seen = div[case]["seen"]
            assert div[case]["unchanged"]
            assert seen[0] is not None and seen[0]["index"] == {"different": 2, "extra": 3}[case]
            assert seen[1] == seen[0]  # sticky: the same error again
        different = div["different"]["seen"][0]
        assert different["chunks"][0] is not None and "rid='x' seq=1" in different["chunks"][0]
        assert different["chunks"][world - 1] != different["chunks"][0]
        extra = div["extra"]["seen"][0]
        assert extra["chunks"][:-1] == [None] * (world - 1)
        assert "rid='y' seq=1" in extra["chunks"][-1]
        message = different["message"]
        assert "the first differing chunk is submission 2: rank 0: chunk rid='x'" in message

    # 4. loads: every rank loads what every rank holds, and applies the load's ack together
    loads = [r["load_scenario"] for r in ranks]
    for i, lo in enumerate(loads):
        assert lo["lookup"] == [2, False]  # rank 0 alone would have said 3
        assert lo["loaded"] == 1 and lo["restored"]  # rank 0's page 1 failed: one page
        assert lo["held"] == {"loading_while_held": True, "loading_after": False}
        assert lo["failed"] == [1, 0]  # failed on rank 0: a failure on every rank
        assert lo["released"] == ["c", "c", "g", "f"]
        assert lo["pinned"] == 0 and lo["host_used"] == 0
        assert lo["peer_failures"] == (0 if i == 0 else 1)
        assert lo["mismatch"] is not None and "diverged" in lo["mismatch"]

    # 5. the simulator: identical stores and releases, though the host pool ran out
    sims = [r["sim_scenario"] for r in ranks]
    assert all(s["ok"] for s in sims)
    assert sims[0]["exhausted"] > 0 and sims[0]["stored_keys"] > 0
    assert all(s == sims[0] for s in sims)  # exhaustion too: the ranks agreed on it


@pytest.mark.parametrize("mode", ["crash", "stuck"])
def test_a_failed_rank_becomes_an_error_not_a_hang(mode: str, tmp_path: Path) -> None:
    """Scenario: the last of three ranks dies (``os._exit``), or stops polling.

    The others raise a GroupBroken (saying no peer answered in time when it is silent)
    instead of waiting forever; later polls raise at once. A rank that hung
    would be killed by the spawner and fail the test.
    """
    world = 3 if mode == "crash" else 2
    codes, results = spawn(failing_peer_main, world, tmp_path, mode)
    assert codes[:-1] == [0] * (world - 1), (codes, results)
    for r in results[:-1]:
        assert r is not None
        assert r["error"] == "GroupBroken", r
        assert r["again"] == r["error"]
        assert "crashed, hung or stopped polling" in r["message"]
        if mode == "stuck":
            assert "no peer answer in time" in r["message"], r
    if mode == "crash":
        assert codes[-1] == 3


def test_a_promotion_failing_on_one_rank_keeps_every_rank_budget_equal(tmp_path: Path) -> None:
    """Scenario: two ranks with a 6-page host pool each hold a 3-page prompt in the store; the
    read of page 1 fails on rank 0 after every rank agreed it was there (an eviction).

    The load copies page 0 on both ranks (the prefix every rank promoted). Every rank's host
    budget stays equal (before: 6 and 6, then 4 on rank 0 and 3 on rank 1, so a 4-page
    offload was admitted on rank 0 only and every rank raised GroupBroken at the next poll,
    for good): the offload is deferred or taken alike on both, every poll agrees, the
    offloaded pages reach the store, and nothing stays pinned or allocated.
    """
    codes, results = spawn(promotion_failure_main, 2, tmp_path)
    assert codes == [0, 0], (codes, results)
    ranks: list[dict[str, Any]] = []
    for r in results:
        assert r is not None and "error" not in r, r
        ranks.append(r)
    first, second = ranks
    assert first["budgets"]["before"] == second["budgets"]["before"] == 6
    # Every page the load would promote is charged on every rank before any read; the two
    # not loaded come back with the budget at the next poll.
    assert first["budgets"]["after_load"] == second["budgets"]["after_load"] == 6 - 3
    assert first["loaded"] == second["loaded"] == 1
    for r in ranks:
        assert r["errors"] == [None] * 4, r["errors"]
        assert any(r["offloads"]), r["offloads"]
        assert r["host_used"] == 0 and r["pinned"] == 0
        assert r["released"] == ["c", "b", "d"]
    assert first["offloads"] == second["offloads"] == [False, True, False, False]
    assert first["budgets"]["end"] == second["budgets"]["end"]
    assert first["stored"] == second["stored"] and len(first["stored"]) == 3 + 4


def test_simulate_command_with_two_ranks() -> None:
    """``kvlife simulate --world-size 2 --json``: real processes, ranks agree, exit 0; both
    halves run: prefixes are restored on both ranks alike, every page checked."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(
            ["simulate", "--world-size", "2", "--requests", "40", "--concurrency", "4", "--json"]
        )
    report = json.loads(out.getvalue().strip().splitlines()[-1])
    assert status == 0, report
    assert report["ok"] and report["ranks_agreed"] and report["world_size"] == 2
    assert [r["rank"] for r in report["per_rank"]] == [0, 1]
    assert (
        report["per_rank"][0]["stored_keys_digest"] == report["per_rank"][1]["stored_keys_digest"]
    )
    restored = [(r["restores"], r["pages_restored"]) for r in report["per_rank"]]
    assert restored[0][0] > 0 and restored[0] == restored[1]
    assert all(r["corrupted_restores"] == 0 for r in report["per_rank"])


# ---------------------------------------------------------------- one process (world of 1)


@pytest.fixture
def world1() -> Iterator[None]:
    """A gloo group of one rank in this process (an in-memory rendezvous)."""
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_agreement_needs_a_process_group_and_a_sane_timeout() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="not initialized"):
        TorchAgreement()
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ConfigError, match="timeout"):
            TorchAgreement(timeout=bad)


def chunk(lc: Lifecycle, salt: int, n_pages: int = 1) -> Ticket:
    return lc.submit(tokens(n_pages * PAGE, salt))


def test_single_rank_applies_in_submission_order_and_refuses_bad_input(world1: None) -> None:
    """Acks come back in submission order; bad input is refused before anything changes."""
    ag = TorchAgreement(timeout=5)
    lc = Lifecycle("r", page_size=PAGE)
    t0, t1, t2 = chunk(lc, 1), chunk(lc, 2, 2), chunk(lc, 3)
    for t in (t0, t1, t2):
        ag.submitted(t)
    assert ag.pending == 3
    refusals = []
    with pytest.raises(AgreementError, match="already submitted") as err:
        ag.submitted(t1)
    refusals.append(err.value)
    for junk in (
        ("not", "a", "ticket"),
        ("not", "a", ("ticket",), 0),  # a 4-tuple is not a ticket by its length alone
        (lc, 3, 0, ("k",)),  # the field order before keys moved third
    ):
        with pytest.raises(AgreementError, match="expected a Ticket") as err:
            ag.submitted(junk)  # type: ignore[arg-type]
        refusals.append(err.value)
    with pytest.raises(AgreementError, match="not a str") as err:
        ag.submitted((lc, 3, (b"bytes key",), 4))
    refusals.append(err.value)
    with pytest.raises(AgreementError, match="expected an Ack") as err:
        ag.agree([Ack(t2, (0,), (0,)), "junk"])  # type: ignore[list-item]
    refusals.append(err.value)
    # A refusal is not GroupBroken: the agreement stays usable (the next calls work).
    assert all(type(e) is AgreementError for e in refusals)
    assert ag.pending == 3 and ag.collectives == 0  # nothing changed, no collective ran
    assert ag.agree([Ack(t2, (0,), (0,))]) == []  # t0 is not complete: nothing yet
    out = ag.agree([Ack(t1, (1, 2), (1, 2)), Ack(t0, (3,), (3,))])
    assert [a.ticket for a in out] == [t0, t1, t2]
    assert ag.pending == 0 and ag.collectives == 2 and ag.chunks_agreed == 3
    # A duplicate of an applied ack, and a foreign one, go through for the Lifecycle to refuse.
    stray = Ack(t0, (3,), (3,))
    assert ag.agree([stray]) == [stray]


class _Job:
    """A host's own record of one operation (a vLLM job, a linker load): no rid."""


def test_tickets_of_a_host_record_are_agreed_and_named_in_refusals(world1: None) -> None:
    """A ticket's owner may be a host's record instead of a Lifecycle: its chunks and loads
    are agreed, and a refusal names them (it raised AttributeError for want of a rid)."""
    ag = TorchAgreement(timeout=5)
    job = _Job()
    stored: Ticket = (job, 0, ("ab",), 0)
    loaded = LoadTicket(job, 0, ("cd",))
    ag.submitted(stored)
    ag.submitted(loaded)
    for again in (stored, loaded):
        with pytest.raises(AgreementError, match="already submitted"):
            ag.submitted(again)
    out = ag.agree([Ack(loaded, (1,), (1,)), Ack(stored, (0,), (0,))])
    assert [a.ticket for a in out] == [stored, loaded] and ag.pending == 0


def test_single_rank_failure_caps_the_poll_and_duplicates_follow_the_original(
    world1: None,
) -> None:
    ag = TorchAgreement(timeout=5)
    lc = Lifecycle("r", page_size=PAGE)
    t = [chunk(lc, i) for i in range(4)]
    for ticket in t:
        ag.submitted(ticket)
    fault = RuntimeError("copy fault")
    acks = [Ack(t[0], (0,), (0,)), Ack(t[1], (1,), (1,), fault), Ack(t[2], (2,), (2,), fault)]
    dup = Ack(t[0], (0,), (0,))
    out = ag.agree([*acks, dup, Ack(t[3], (3,), (3,))])
    assert out == [acks[0], dup, acks[1]]  # up to and including the first failure
    assert ag.agree([]) == [acks[2]]  # the next failure, next poll
    assert [a.ticket for a in ag.agree([])] == [t[3]]
    assert ag.pending == 0


def test_host_budget_is_the_free_pages_at_the_last_poll(world1: None) -> None:
    host = HostPagePool(8, 4, torch.float32, pin_memory=False)
    ag = TorchAgreement(timeout=5, host=host)
    assert ag.collectives == 1  # the constructor agreed on the first budget
    assert ag.admit(5) and ag.admit(3) and not ag.admit(1)
    host.alloc(2, owner="someone")
    ag.agree([])
    assert not ag.admit(7) and ag.admit(6) and not ag.admit(1)
    assert TorchAgreement(timeout=5).admit(10**9)  # no pool: the runtime's business


def test_fingerprint_is_stable_and_sees_page_count_and_key() -> None:
    """The fingerprint must be the same in every process (no salted ``hash``)."""
    fp = chunk_fingerprint(0, 2, "ab" * 32)
    assert fp == chunk_fingerprint(0, 2, "ab" * 32) == 30208006176404869
    assert fp != chunk_fingerprint(0, 3, "ab" * 32)
    assert fp != chunk_fingerprint(0, 2, "ac" * 32)
    assert chunk_fingerprint(fp, 1, "k") != chunk_fingerprint(
        chunk_fingerprint(0, 1, "k"), 2, "ab" * 32
    )


def test_agreement_errors_are_kvlife_errors() -> None:
    from kvlife.errors import KVLifeError

    assert issubclass(AgreementError, KVLifeError)
    assert issubclass(GroupBroken, AgreementError) and issubclass(GroupBroken, RuntimeError)
