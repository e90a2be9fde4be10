"""kvlife's decode offload manager for SGLang with tensor parallelism: 2 real processes in a real
gloo group, each driving its own manager through the calls SGLang's scheduler makes (as
tests/test_sglang_decode.py does at one rank), with kvlife's TorchAgreement in place of
SGLang's MIN all-reduce.

Rank 1 is the slow rank: its copies are delayed (and its first one held), so the two ranks'
engines complete copies in different orders, and a retraction comes while rank 1 still copies;
its storage backups finish late, so its host pages come back later than rank 0's. The ranks
must still apply the same acks in the same scheduler call, free the same device pages at the
same call, admit the same chunks, store the same pages and leak nothing. Seeded bugs (a rank
that admits by its own host pool, a rank that applies its own acks without the agreement, a
guard that frees on the rank's own completion) each break one of those, and the test sees it.

Runs in .venv-sglang (``.ci/sglang.sh``); skipped where SGLang is not installed.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sglang_stubs
import torch
import torch.distributed as dist

sglang_stubs.install()
pytest.importorskip("sglang.srt.disaggregation.decode_kvcache_offload_manager")

from sglang_stubs import DecodeScheduler, refuse_writes  # noqa: E402

from kvlife import State  # noqa: E402
from kvlife.errors import GroupBroken  # noqa: E402
from kvlife.sim.distributed import init_rank, spawn_ranks  # noqa: E402
from kvlife.testing import page_bytes_of  # noqa: E402

WORLD = 2
PAGE, STRIDE = 2, 4  # a chunk: 4 tokens, 2 pages
TIMEOUT = 60.0  # the gloo group's timeout (a hang guard; the spawner kills a hung rank)


# ---------------------------------------------------------------- seeded bugs (in each rank)


def _no_bug(sched: DecodeScheduler) -> None:
    return None


def _local_admission(sched: DecodeScheduler) -> None:
    """Each rank admits a chunk by its own host pool, not by the agreed budget."""
    pool = sched.mgr.decode_host_mem_pool
    sched.mgr.agreement.admit = lambda pages: int(pool.available_size()) >= pages * PAGE


def _own_acks(sched: DecodeScheduler) -> None:
    """Each rank applies its own acks as it drains them (and admits by its own pool): no
    agreement, as a manager would that dropped SGLang's collective without replacing it."""
    sched.mgr.agreement = None


def _free_on_local_completion(sched: DecodeScheduler) -> None:
    """The allocator guard lets a free through once this rank's own copy completed, before
    the ack is agreed."""
    mgr, cc = sched.mgr, sched.cc
    guarded = mgr._guarded_free

    def free(indices: torch.Tensor) -> None:
        cc.collect(block=False)
        pins = mgr._pins
        mgr._pins = {i: read for i, read in pins.items() if i not in cc.completed}
        try:
            guarded(indices)
        finally:
            mgr._pins = pins

    sched.allocator.free = free  # what the scheduler's release calls
    mgr._guarded_free = free


MUTANTS: dict[str, Callable[[DecodeScheduler], None]] = {
    "none": _no_bug,
    "local_admission": _local_admission,
    "own_acks": _own_acks,
    "free_on_local_completion": _free_on_local_completion,
}


# ---------------------------------------------------------------- one rank's run


class Timeline:
    """What one rank's manager did, by scheduler call: acks applied, device frees, admissions."""

    def __init__(self, sched: DecodeScheduler) -> None:
        self.sched, self.call = sched, 0
        self.applied: list[list[Any]] = []  # [call, rid, ack id, tokens]
        self.frees: list[list[Any]] = []  # [call, rid, device pages]
        self.admits: list[list[Any]] = []  # [call, pages, answer, this rank's free pages]
        mgr = sched.mgr
        apply, admit, device_free = mgr._apply, mgr._admit, sched.device.free

        def applying(ack_id: int) -> None:
            req, _, tokens = mgr.ongoing_offload[ack_id][:3]
            self.applied.append([self.call, req.rid, ack_id, len(tokens)])
            apply(ack_id)

        def admitting(n_tokens: int) -> bool:
            here = int(mgr.decode_host_mem_pool.available_size()) // PAGE
            answer = bool(admit(n_tokens))
            self.admits.append([self.call, n_tokens // PAGE, answer, here])
            return answer

        def freeing(pages: Any, owner: Any) -> None:
            self.frees.append([self.call, owner.rid, list(pages)])
            device_free(pages, owner)

        mgr._apply, mgr._admit, sched.device.free = applying, admitting, freeing

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One scheduler call."""
        self.call += 1
        return fn(*args)


def books(mgr: Any, cc: Any, tl: Any, sched: DecodeScheduler) -> dict[str, Any]:
    """What one rank applied, freed, admitted, stored (and whether the bytes are right),
    refused and found full: the figures every workload reports for the ranks to compare."""
    return {
        "applied": tl.applied,
        "frees": tl.frees,
        "admits": tl.admits,
        "stored": sorted(cc.store.keys()),
        "stored_ok": all(
            cc.store.get(k) == page_bytes_of(k, sched.layout.page_nbytes)
            for k in cc.store.keys()  # noqa: SIM118 (a store, not a dict)
        ),
        "refusals": mgr.refusals.snapshot(),
        "host_pool_exhausted": mgr.host_pool_exhausted,
    }


def unreleased(sched: DecodeScheduler) -> int:
    """Lives the manager still holds that were not released."""
    return sum(life.lifecycle.state is not State.RELEASED for life in sched.mgr._lives.values())


def wait_local(sched: DecodeScheduler, node_id: int) -> None:
    """Until this rank's engine completed copy ``node_id`` (nothing applied: no manager call)."""
    deadline = time.monotonic() + 10
    while node_id not in sched.cc.completed:
        assert time.monotonic() < deadline, f"copy {node_id} never completed"
        sched.cc.collect(block=False)
        time.sleep(0.001)


def workload(rank: int, mutant: str) -> dict[str, Any]:
    """The same scheduler calls on every rank; rank 1 copies and backs up slowly."""
    slow = rank == 1
    sched = DecodeScheduler(
        page_size=PAGE,
        stride=STRIDE,
        host_pages=6,
        device_pages=160,
        workers=2,  # a held copy blocks one worker, the next copy runs on the other
        copy_delay=0.002 if slow else 0.0,
        delay_jitter=0.004 if slow else 0.0,
        seed=rank,
        tp_group=dist.group.WORLD,
        tp_world_size=WORLD,
    )
    mgr, cc = sched.mgr, sched.cc
    cc.hold_backups = slow  # rank 1's host pages come back only at release_backups()
    MUTANTS[mutant](sched)
    tl = Timeline(sched)
    out: dict[str, Any] = {}
    lives = 0
    try:
        # 1. Rank 1 completes b's copy before a's; a is retracted while rank 1 still copies it.
        a = tl.run(sched.start, "a", [1, 2, 3])
        b = tl.run(sched.start, "b", [11, 12, 13])
        lives += 2
        gate = sched.engine.hold_next() if slow else None
        assert tl.run(sched.step, a, [4, 5, 6, 7])  # copy 1: held on rank 1
        if not slow:
            wait_local(sched, 1)  # rank 0: a's copy completes first
        assert tl.run(sched.step, b, [14, 15, 16, 17])  # copy 2
        wait_local(sched, 2)
        a_pages = list(a.kit_pages)
        tl.run(sched.retract, a)  # drain_before_retraction, then the row's free
        out["at_retraction"] = {
            "completed_here": sorted(cc.completed),
            "deferred_frees": mgr.deferred_frees,
            "frees": len(tl.frees),
            "inflight": mgr.has_inflight_device_transfer(),
        }
        tl.run(sched.resume, a, sched.tokens(a))  # the same Req, new pages
        lives += 1
        out["resumed_reuses_held_pages"] = bool(set(a.kit_pages) & set(a_pages))
        if gate is not None:
            threading.Timer(0.2, gate.open).start()
        tl.run(sched.poll)  # rank 1 waits for its copy; both apply both acks, free a's row
        out["after_poll"] = {"frees": len(tl.frees), "deferred_frees": mgr.deferred_frees}

        # 2. Churn: rids reused, finish-time flushes, a small host pool that rank 1 frees late.
        rng = random.Random(7)  # the same draws on every rank
        running = [a, b]
        token = 100
        for i in range(40):
            for req in list(running):
                token += 2
                tl.run(sched.step, req, [token, token + 1])
            if running and rng.random() < 0.3:
                done = running.pop(rng.randrange(len(running)))
                tl.run(sched.finish, done)
            if len(running) < 3 and rng.random() < 0.5:
                rid = rng.choice("abc")
                running.append(tl.run(sched.start, rid, [rng.randrange(1000) for _ in range(5)]))
                lives += 1
            if slow and i % 4 == 3:
                cc.release_backups()
            tl.run(sched.poll)
        for req in running:
            tl.run(sched.finish, req)
        tl.run(sched.poll)  # the last acks; their backups are held on rank 1
        cc.release_backups()
        tl.run(sched.poll)  # every host page back
        tl.run(sched.close)
    except Exception as exc:
        out["error"] = {"type": type(exc).__name__, "message": str(exc)}
        if not isinstance(exc, GroupBroken):
            out["error"]["traceback"] = traceback.format_exc()
        with contextlib.suppress(Exception):
            sched.engine.close()
    out.update(
        completion_order=list(cc.completion_order),
        **books(mgr, cc, tl, sched),
        lives=lives,
        released=mgr.released,
        leaks={
            "device_pages": sched.device.allocated(),
            "host_pages": sched.host.num_used,
            "copies": len(mgr.ongoing_offload),
            "backups": len(mgr.ongoing_backup),
            "held_frees": len(mgr._held),
            "lives": unreleased(sched),
        },
    )
    return out


def retraction_after_skew(rank: int, kvlife: bool) -> dict[str, Any]:
    """SGLang's drain where it refuses: the ranks' host pools skewed, then a retraction.

    Both ranks' backups finish out of order (rank 0 backs up a's 2-page chunk first, rank 1
    b's 4-page chunk), so after SGLang's MIN-counted backup check rank 0 has 2 free host
    pages and rank 1 has 4. a's next chunk (4 pages) then goes in flight on rank 1 only, and
    SGLang's drain refuses the retraction on every rank. kvlife's manager, on the same calls,
    refuses that chunk on both ranks (the agreed budget) and retracts."""
    sched = DecodeScheduler(
        kvlife=kvlife,
        page_size=PAGE,
        stride=STRIDE,
        host_pages=6,
        tp_group=dist.group.WORLD,
        tp_world_size=WORLD,
    )
    cc, mgr = sched.cc, sched.mgr
    cc.hold_backups = True
    out: dict[str, Any] = {"offloaded": []}
    a = sched.start("a", [1, 2, 3])
    b = sched.start("b", [11, 12, 13])
    out["offloaded"].append(sched.step(a, [4, 5, 6, 7]))  # 2 pages
    out["offloaded"].append(sched.step(b, list(range(14, 22))))  # 4 pages: the pool is full
    sched.poll()  # both copies applied, their backups held
    cc.release_backups(only=rank)  # rank 0: a's backup finishes first; rank 1: b's
    sched.poll()
    out["host_free"] = sched.host.num_free
    out["offloaded"].append(sched.step(a, list(range(30, 38))))  # 4 pages
    sched.poll()
    try:
        sched.retract(a)
        out["refused"] = None
    except RuntimeError as exc:
        out["refused"] = str(exc)
    out["copies_tracked"] = len(mgr.ongoing_offload)
    cc.release_backups()
    if kvlife:  # goes on: the retracted life releases, b finishes, nothing leaks
        sched.poll()
        sched.finish(b)
        sched.poll()
        cc.release_backups()
        sched.poll()
        sched.close()
        out["leaks"] = [sched.device.allocated(), sched.host.num_used, unreleased(sched)]
        out["released"] = mgr.released
    else:  # SGLang's scheduler would have to handle the RuntimeError; stop here
        sched.engine.close()
    out["stored"] = sorted(cc.store.keys())
    return out


def refused_write_on_one_rank(rank: int) -> dict[str, Any]:
    """Rank 0's cache controller refuses two writes (``write`` returns ``None``: no host
    pages) that rank 1's takes: b's first chunk, then a later chunk of b just before b is
    retracted. The same scheduler calls on both ranks."""
    sched = DecodeScheduler(
        page_size=PAGE,
        stride=STRIDE,
        host_pages=8,
        device_pages=64,
        tp_group=dist.group.WORLD,
        tp_world_size=WORLD,
        strict=False,  # as inside SGLang
    )
    mgr, cc = sched.mgr, sched.cc
    refused = refuse_writes(cc, {2, 5}) if rank == 0 else []
    tl = Timeline(sched)
    out: dict[str, Any] = {"offloaded": []}
    offloaded = out["offloaded"]
    try:
        a = tl.run(sched.start, "a", [1, 2, 3])
        b = tl.run(sched.start, "b", [11, 12, 13])
        offloaded.append(tl.run(sched.step, a, [4, 5, 6, 7]))  # write 1
        offloaded.append(tl.run(sched.step, b, [14, 15, 16, 17]))  # write 2: refused on rank 0
        out["b_first_chunk"] = list(b.kit_keys[1:3])
        out["after_refusal"] = [sched.host.num_used, mgr.has_inflight_device_transfer()]
        tl.run(sched.poll)  # the group fails b's chunk on both ranks
        out["after_poll"] = [sched.host.num_used, mgr.chunks_failed]
        offloaded.append(tl.run(sched.step, b, [18]))  # write 3: b's chunk again, 4 tokens of 5
        offloaded.append(tl.run(sched.step, a, [8, 9, 10, 11]))  # write 4
        tl.run(sched.poll)
        offloaded.append(tl.run(sched.step, b, [19, 20, 21, 22]))  # write 5: refused on rank 0
        tl.run(sched.retract, b)  # its row's free waits for the group's verdict on both ranks
        out["held_at_retraction"] = mgr.deferred_frees
        tl.run(sched.resume, b, sched.tokens(b))
        tl.run(sched.poll)  # failed on both ranks: the held free runs at this call on both
        offloaded.append(tl.run(sched.step, b, [23, 24, 25, 26]))  # write 6
        tl.run(sched.finish, a)
        tl.run(sched.finish, b)
        tl.run(sched.poll)
        tl.run(sched.close)
    except Exception as exc:
        out["error"] = {"type": type(exc).__name__, "message": str(exc)}
        with contextlib.suppress(Exception):
            sched.engine.close()
    out.update(
        refused_here=refused,
        writes_refused=mgr.writes_refused,
        chunks_failed=mgr.chunks_failed,
        **books(mgr, cc, tl, sched),
        released=mgr.released,
        leaks=[sched.device.allocated(), sched.host.num_used, len(mgr._pins), unreleased(sched)],
    )
    return out


def ranks_main(rank: int, world: int, port: int, out_dir: str, mutants: list[str]) -> None:
    """One rank: each workload in turn (the clean one, then the seeded bugs), one gloo group;
    then the retraction after skewed host pools, on SGLang's manager and on kvlife's."""
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    try:
        init_rank(rank, world, port, TIMEOUT)
        for mutant in mutants:
            dist.barrier()
            result[mutant] = workload(rank, mutant)
        for kvlife in (False, True):
            dist.barrier()
            result[f"skew_kvlife={kvlife}"] = retraction_after_skew(rank, kvlife)
        dist.barrier()
        result["refused_write"] = refused_write_on_one_rank(rank)
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


# ---------------------------------------------------------------- the comparison (here)


AGREED = ("applied", "frees", "stored", "refusals", "host_pool_exhausted", "released")


def divergence(r0: dict[str, Any], r1: dict[str, Any]) -> list[str]:
    """What the two ranks did differently, of what they must do alike."""
    diffs = [what for what in AGREED if r0[what] != r1[what]]
    if [x[:3] for x in r0["admits"]] != [x[:3] for x in r1["admits"]]:
        diffs.append("admits")
    return diffs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out_dir = tmp_path_factory.mktemp("sglang_tp")
    codes = spawn_ranks(ranks_main, WORLD, str(out_dir), list(MUTANTS), join_timeout=400)
    results = []
    for rank in range(WORLD):
        path = out_dir / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    assert codes == [0] * WORLD, (codes, results)
    for r in results:
        assert r is not None and "error" not in r, r
    names = [*MUTANTS, "skew_kvlife=False", "skew_kvlife=True", "refused_write"]
    return {m: [r[m] for r in results if r is not None] for m in names}


def test_ranks_apply_the_same_acks_free_the_same_pages_and_leak_nothing(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    """The copy on rank 1 is delayed and its first one held: the ranks' engines complete in
    different orders, a retraction comes while rank 1 still copies, rank 1's host pages come
    back late. Both ranks apply the same acks at the same scheduler call, hold the retracted
    row's free until the agreed ack and run it at the same call, admit the same chunks (rank 0
    refuses chunks its own pool had room for, because rank 1's had not), store the same pages
    and leak nothing."""
    r0, r1 = runs["none"]
    for r in (r0, r1):
        assert "error" not in r, r["error"]
    # Different completion orders: rank 0 finished a's copy (1) first, rank 1 b's (2).
    assert r0["completion_order"][:2] == [1, 2] and r1["completion_order"][:2] == [2, 1]
    assert r0["at_retraction"]["completed_here"] == [1, 2]
    assert r1["at_retraction"]["completed_here"] == [2]
    # The retraction: refused on no rank, the row's free held on both, run at the same call.
    for r in (r0, r1):
        assert r["at_retraction"]["deferred_frees"] == 1 and r["at_retraction"]["frees"] == 0
        assert r["at_retraction"]["inflight"]
        assert not r["resumed_reuses_held_pages"]
        assert r["after_poll"]["frees"] == 1
    assert r0["frees"][0] == r1["frees"][0] and r0["frees"][0][1] == "a"
    assert divergence(r0, r1) == []
    # Host admission was agreed, and it mattered: rank 0 alone would have admitted more.
    assert r0["host_pool_exhausted"] > 0
    assert any(not ok and here >= pages for _, pages, ok, here in r0["admits"])
    assert len(r0["applied"]) > 15
    for r in (r0, r1):
        assert r["stored_ok"] and len(r["stored"]) > 30
        assert r["leaks"] == {k: 0 for k in r["leaks"]}, r["leaks"]
        assert r["released"] == r["lives"]  # each life released once, the retracted one too
        assert r["refusals"] == {}


def test_local_admission_is_caught_as_a_divergence_on_every_rank(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    """Seeded bug: a rank admits by its own host pool. Rank 1's pool is full when rank 0's is
    not, so the ranks submit different chunks, and the next agreement raises GroupBroken on
    both ranks, naming the first differing chunk."""
    for r in runs["local_admission"]:
        assert r["error"]["type"] == "GroupBroken", r.get("error")
        assert "different chunk sequences" in r["error"]["message"]
    assert runs["local_admission"][0]["error"] == runs["local_admission"][1]["error"]


@pytest.mark.parametrize("mutant", ["own_acks", "free_on_local_completion"])
def test_a_rank_that_acts_on_its_own_completions_is_caught(
    mutant: str, runs: dict[str, list[dict[str, Any]]]
) -> None:
    """Seeded bugs: a rank applies its own acks without the agreement (and so admits by its
    own pool), or lets a held free through on its own copy's completion. The ranks then do
    different things: the comparison the clean run passes fails."""
    r0, r1 = runs[mutant]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert divergence(r0, r1) != []
    if mutant == "free_on_local_completion":  # rank 0 freed a's row at the retraction itself
        assert r0["at_retraction"]["frees"] == 1 and r1["at_retraction"]["frees"] == 0
        assert r0["resumed_reuses_held_pages"]


def test_sglangs_drain_refuses_after_skewed_host_pools_and_kvlifes_retracts(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    """Where SGLang's drain really refuses (at one rank it waits, and is safe): its ranks
    decide host exhaustion each for itself. Backups finishing in another order on each rank
    leave rank 0 with 2 free host pages and rank 1 with 4; a 4-page chunk then goes in flight
    on rank 1 only, SGLang's MIN-counted progress check leaves it there, and its drain raises
    ``refusing to retract`` on both ranks. kvlife's manager on the same calls refuses that
    chunk on both ranks alike and retracts; nothing leaks."""
    s0, s1 = runs["skew_kvlife=False"]
    assert [s0["host_free"], s1["host_free"]] == [2, 4]
    assert s0["offloaded"] == [True, True, False] and s1["offloaded"] == [True, True, True]
    for s in (s0, s1):
        assert s["refused"] is not None and "refusing to retract" in s["refused"]
    assert [s0["copies_tracked"], s1["copies_tracked"]] == [0, 1]
    k0, k1 = runs["skew_kvlife=True"]
    for k in (k0, k1):
        assert k["offloaded"] == [True, True, False]  # the agreed budget: 2 pages, not 4
        assert k["refused"] is None and k["leaks"] == [0, 0, 0]
        assert k["released"] == 2  # b, and a's retracted life, though a never came back
    assert k0["stored"] == k1["stored"] and len(k0["stored"]) == 6


def test_defect36_2_a_write_refused_on_one_rank_breaks_no_rank(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    """Scenario: at TP=2 rank 0's cache controller refuses the write of b's first chunk
    (``write`` returns ``None``), which rank 1's takes. kvlife acked it at once on rank 0 and
    never told the agreement, so rank 1 reported a chunk rank 0 never submitted, and the next
    progress check raised ``GroupBroken`` into SGLang's scheduler on both ranks. Now every rank
    submits the chunk and answers True; the check fails it on both ranks (rank 1's host pages
    go back unwritten) and b offers it again at its next step, with the same keys, on both.
    A second refusal on rank 0 comes just before b is retracted: the retraction's free of b's
    row waits for the group's verdict on both ranks (rank 0 has no copy) and runs at the same
    call. The ranks apply, free, admit and store alike, every page of b's first chunk is
    stored, and nothing leaks."""
    r0, r1 = runs["refused_write"]
    for r in (r0, r1):
        assert "error" not in r, r["error"]
    assert r0["refused_here"] == [2, 5] and r1["refused_here"] == []
    assert [r0["writes_refused"], r1["writes_refused"]] == [2, 0]
    assert r0["offloaded"] == r1["offloaded"] == [True] * 6
    assert r0["after_refusal"] == [2, True] and r1["after_refusal"] == [4, True]
    assert r0["after_poll"] == r1["after_poll"] == [0, 1]  # a's backed up, b's given back
    assert r0["held_at_retraction"] == r1["held_at_retraction"] == 1
    assert divergence(r0, r1) == []
    assert r0["chunks_failed"] == r1["chunks_failed"] == 2
    for r in (r0, r1):
        assert r["refusals"] == {} and r["stored_ok"]
        assert set(r["b_first_chunk"]) <= set(r["stored"])  # offered again, stored
        assert r["leaks"] == [0, 0, 0, 0], r["leaks"]
    assert [f[1] for f in r0["frees"]] == ["b", "a", "b"]  # the retracted row, then at finish
