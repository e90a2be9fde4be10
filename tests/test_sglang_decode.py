"""kvlife's decode offload manager for SGLang, driven through the calls SGLang's scheduler
makes, on SGLang 0.5.23's real classes (its Req, ReqToTokenPool, finish reasons and decode
offload manager), with CPU stand-ins only for the cache controller's copy and storage calls
(kvlife's threaded CpuCopyEngine over a real torch KV pool; kvlife's InlineStore).

Runs in .venv-sglang (``.ci/sglang.sh``); skipped where SGLang is not installed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
import sglang_stubs
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

sglang_stubs.install()
pytest.importorskip("sglang.srt.disaggregation.decode_kvcache_offload_manager")

from sglang_stubs import DecodeScheduler  # noqa: E402

from kvlife import FinishReason, State  # noqa: E402
from kvlife.errors import KVLifeError  # noqa: E402
from kvlife.hashing import sglang_page_hashes  # noqa: E402
from kvlife.integrations import sglang_decode  # noqa: E402
from kvlife.testing import (  # noqa: E402
    KIT_SETTINGS,
    Finish,
    InvariantViolation,
    KitEvent,
    KitOptions,
    Oracle,
    Release,
    RuntimeMachine,
    Start,
    Step,
    page_bytes_of,
    replay_trace,
    run_kit,
)
from kvlife.testing.adapter import AdapterError  # noqa: E402


def life_of(sched: DecodeScheduler, req: Any) -> Any:
    return sched.mgr._lives[req].lifecycle


def stored_ok(sched: DecodeScheduler) -> int:
    """Every stored page holds the bytes its key's page had on the device; how many."""
    n = 0
    for key in sched.cc.store.keys():  # noqa: SIM118 (a store, not a dict)
        assert sched.cc.store.get(key) == page_bytes_of(key, sched.layout.page_nbytes), key
        n += 1
    return n


def test_it_is_sglangs_class_and_install_replaces_the_schedulers_name() -> None:
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import (
        DecodeKVCacheOffloadManager,
    )
    from sglang.srt.managers import scheduler

    cls = sglang_decode.decode_manager_class()
    assert issubclass(cls, DecodeKVCacheOffloadManager)
    assert cls is sglang_decode.KVLifeDecodeOffloadManager
    before = scheduler.DecodeKVCacheOffloadManager
    assert before is DecodeKVCacheOffloadManager
    try:
        assert sglang_decode.install() is cls
        assert scheduler.DecodeKVCacheOffloadManager is cls
    finally:
        sglang_decode.uninstall()
    assert scheduler.DecodeKVCacheOffloadManager is DecodeKVCacheOffloadManager


def test_keys_are_sglangs_own_page_keys() -> None:
    """The stored keys are what SGLang's own manager computes for the same request."""
    keys = []
    for kvlife in (True, False):
        sched = DecodeScheduler(kvlife=kvlife, stride=2)
        req = sched.start("r", [1, 2, 3, 4, 5])
        for t in range(6, 14):
            sched.step(req, [t])
        sched.finish(req)
        sched.close()
        keys.append(sorted(sched.cc.store.keys()))
        assert stored_ok(sched) > 2
    assert keys[0] == keys[1]


def test_37026_a_late_ack_of_the_old_request_leaves_the_new_one_alone() -> None:
    """Two requests on one rid; the old one finishes with its copy in flight, the new one
    starts and offloads; the old one's late ack releases only the old one."""
    sched = DecodeScheduler()
    old = sched.start("r", [1, 2, 3])
    gate = sched.engine.hold_next()
    assert sched.step(old, [4, 5, 6, 7])  # one chunk (4 tokens), held in flight
    sched.finish(old)
    assert sched.device.releases == []  # released after its ack, not now
    new = sched.start("r", [1, 2, 3])
    assert sched.step(new, [8, 9, 10, 11])  # True after the old request finished
    new_life = life_of(sched, new)
    assert new_life.inflight == 1 and new_life.state is State.OFFLOADING
    new_key = new.kit_keys[-1]
    gate.open()
    sched.poll()  # SGLang's progress check waits for both copies; each ack moves its own life
    assert [r.request for r in sched.device.releases] == [old]
    assert new_life.snapshot()[:4] == (State.IDLE, 0, 4, new_key)  # its own chunk, acked once
    assert new.kit_pages and sched.mgr._lives[new].lifecycle is new_life
    assert sched.step(new, [12, 13, 14, 15])  # the new life goes on from its own chain
    sched.finish(new)
    sched.close()
    assert [r.request for r in sched.device.releases] == [old, new]
    assert sched.device.allocated() == 0 and sched.host.num_used == 0
    assert stored_ok(sched) == 6 and sched.mgr.refusals.total == 0


def test_retraction_with_a_copy_in_flight_is_safe_not_refused() -> None:
    """The copy is still reading when the scheduler retracts: nothing waits, nothing is
    refused; the retraction's free of the row is held back until the copy's ack, while the
    same Req object resumes with new pages and a new life."""
    sched = DecodeScheduler(copy_delay=0.05)
    req = sched.start("r", [1, 2, 3])
    gate = sched.engine.hold_next()
    assert sched.step(req, [4, 5, 6, 7])
    old_life = life_of(sched, req)
    old_pages = list(req.kit_pages)
    sched.retract(req)  # drain_before_retraction, then the scheduler frees the row
    assert sched.device.releases == [] and sched.mgr.deferred_frees == 1
    assert sched.mgr.has_inflight_device_transfer() and sched.mgr.retractions_drained == 1
    sched.resume(req, sched.tokens(req))  # the same Req object, new pages...
    assert not set(req.kit_pages) & set(old_pages)  # ...none of them the held ones
    assert sched.step(req, [8, 9, 10, 11])  # ...and its next offload starts a new life
    new_life = life_of(sched, req)
    assert new_life is not old_life and old_life.finish_reason is FinishReason.RETRACTED
    assert old_life.state is State.FINISHED  # waiting for its copy
    gate.open()
    sched.poll()
    assert old_life.state is State.RELEASED
    assert [r.device_pages for r in sched.device.releases] == [tuple(old_pages)]
    assert stored_ok(sched) == 4  # the held pages were never reused under the copy
    sched.finish(req)
    sched.close()
    assert [r.request for r in sched.device.releases] == [req, req]
    assert sched.device.allocated() == 0 and sched.host.num_used == 0
    assert sched.mgr.refusals.total == 0


def test_sglangs_own_drain_refuses_while_it_tracks_a_copy() -> None:
    """SGLang's own manager, for contrast: while it still tracks a copy after its drain
    (here one that only another rank's MIN-reduced queue count would leave), it raises into
    the scheduler instead of retracting."""
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import (
        DecodeKVCacheOffloadManager,
    )

    sched = DecodeScheduler(kvlife=False, copy_delay=0.05)
    assert type(sched.mgr) is DecodeKVCacheOffloadManager
    req = sched.start("r", [1, 2, 3])
    assert sched.step(req, [4, 5, 6, 7])
    sched.mgr.ongoing_offload[999] = sched.mgr.ongoing_offload[1]  # another rank's copy
    with pytest.raises(RuntimeError, match="refusing to retract"):
        sched.mgr.drain_before_retraction()
    del sched.mgr.ongoing_offload[999]
    sched.close()


def test_a_refusal_is_counted_not_raised_unless_strict() -> None:
    sched = DecodeScheduler(strict=False)
    req = sched.start("r", [1, 2, 3])
    life = life_of(sched, req) if req in sched.mgr._lives else None
    assert life is None
    assert sched.step(req, [4, 5, 6, 7])
    sched.finish(req)
    # The finished life's release waits for its ack; one more offload of it is refused.
    req.finished_reason = None
    assert sched.mgr.offload_kv_cache(req) is False
    assert sched.mgr.refusals.count("offload") == 1
    strict = DecodeScheduler(strict=True)
    other = strict.start("r", [1, 2, 3])
    assert strict.step(other, [4, 5, 6, 7])
    strict.finish(other)
    other.finished_reason = None
    with pytest.raises(KVLifeError):
        strict.mgr.offload_kv_cache(other)
    for s in (sched, strict):
        s.close()
        assert s.device.allocated() == 0


def test_defect36_3_a_refused_write_leaves_the_chunk_to_be_offered_again() -> None:
    """Scenario: a request (one prompt page, stored by the prefill side) decodes 7 pages, one
    token a step, offloaded in chunks of 2 pages (page 2, stride 4). The cache controller
    refuses the write of the first chunk (``write`` returns ``None``: no host pages). SGLang's
    own manager submits nothing and offers that chunk again, grown, at the next step. kvlife's
    acked the refused chunk as copied and moved past it, so every later page chained onto a
    page that was never stored: a prefix lookup found none of them. Now the refused write
    changes nothing (the life, the copies, the host and device pages as before) and both
    managers, on the same calls, store the same pages, all reachable by prefix."""
    from sglang_stubs import reachable_pages, refuse_writes

    stored, reachable = [], []
    for kvlife in (False, True):
        sched = DecodeScheduler(kvlife=kvlife, page_size=2, stride=4, host_pages=8, strict=False)
        refused = refuse_writes(sched.cc, {1})
        req = sched.start("r", [1, 2, 3])  # KV of [1, 2]: one prompt page
        for t in (4, 5, 6):
            assert not sched.step(req, [t])  # nothing due; kvlife's life exists from here
        if kvlife:
            mgr, life = sched.mgr, life_of(sched, req)
            before = life.snapshot()
        assert not sched.step(req, [7])  # 4 tokens due: the write is refused
        assert refused == [1]
        if kvlife:
            assert life_of(sched, req) is life and life.snapshot() == before
            assert not mgr.ongoing_offload and not mgr._tickets and not mgr._pins
            assert sched.host.num_used == 0 and sched.device.releases == []
            assert mgr.writes_refused == 1 and mgr.refusals.total == 0
        assert sched.step(req, [8])  # due again: 4 tokens of 5, the same first page
        for t in range(9, 18):
            sched.step(req, [t])
            sched.poll()
        sched.finish(req)
        sched.close()
        assert sched.device.allocated() == 0 and sched.host.num_used == 0
        decoded = req.kit_keys[1:]  # the pages after the prompt's, in page order
        assert len(decoded) == 7
        stored.append(sorted(sched.cc.store.keys()))
        reachable.append(reachable_pages(sched.cc, decoded))
        assert stored_ok(sched) == len(stored[-1])
    assert reachable == [6, 6]  # SGLang's, kvlife's: every stored page by prefix
    assert stored[0] == stored[1]


def test_a_chunk_refused_after_its_write_started_leaks_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scenario: the cache controller takes a chunk's write, then the life refuses the chunk
    (its page hasher fails). The copy runs already: its device pages stay guarded and its host
    pages come back unwritten at the next progress check; the refusal is counted, nothing is
    stored for it, and the request goes on."""
    from kvlife.errors import HashingError

    calls = [0]

    def failing_once(tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
        calls[0] += 1
        if calls[0] == 1:
            raise HashingError("injected")
        return sglang_page_hashes(tokens, page_size, prior)

    monkeypatch.setattr(sglang_decode, "sglang_page_hashes", failing_once)
    sched = DecodeScheduler(strict=False)
    req = sched.start("r", [1, 2, 3])
    assert not sched.step(req, [4, 5, 6, 7])  # written by the controller, refused by the life
    mgr = sched.mgr
    assert mgr.refusals.count("offload") == 1 and sched.cc.writes == 1
    assert life_of(sched, req).snapshot()[:3] == (State.IDLE, 0, 0)
    assert mgr.has_inflight_device_transfer() and sched.host.num_used == 2
    sched.poll()
    assert not mgr.has_inflight_device_transfer() and sched.host.num_used == 0
    assert not list(sched.cc.store.keys())
    assert sched.step(req, [8])  # the same chunk, offered again
    sched.finish(req)
    sched.close()
    assert stored_ok(sched) == 2 and sched.device.allocated() == 0 and sched.host.num_used == 0


# ----------------------------------------------------------------------------- the kit


class _Copy:
    def __init__(self, ack_id: int, req: Any) -> None:
        self.ack_id, self.req = ack_id, req

    def __repr__(self) -> str:
        return f"<copy ack={self.ack_id} rid={self.req.rid!r}>"


class DecodeAdapter:
    """The kit's adapter: SGLang's scheduler calls around either manager, nothing else."""

    namespace = None
    progress = "drain"

    def __init__(self, kvlife: bool = True) -> None:
        self.sched = DecodeScheduler(kvlife=kvlife, page_size=2, stride=4, host_pages=6)
        self.page_size = 2
        self._handles: dict[int, _Copy] = {}
        self._closed = False

    def start(self, rid: str, prompt: Sequence[int]) -> Any:
        return self.sched.start(rid, prompt)

    def resume(self, request: Any, tokens: Sequence[int]) -> Any:
        return self.sched.resume(request, tokens)

    def step(self, request: Any, tokens: Sequence[int]) -> None:
        self.sched.step(request, tokens)

    def finish(self, request: Any, reason: FinishReason) -> None:
        if reason is FinishReason.RETRACTED:
            self.sched.retract(request)
        else:
            self.sched.finish(request, abort=reason is FinishReason.ABORTED)

    def copies_in_flight(self) -> list[_Copy]:
        ongoing = self.sched.mgr.ongoing_offload
        handles = self._handles
        for gone in [i for i in handles if i not in ongoing]:
            del handles[gone]
        for i, entry in ongoing.items():  # one handle per copy, the same at every call
            if i not in handles:
                handles[i] = _Copy(i, entry[0])
        return list(handles.values())

    def copy_request(self, copy: object) -> Any:
        assert isinstance(copy, _Copy)
        return copy.req

    def complete(self, copy: object, ok: bool = True) -> None:
        raise AdapterError("copies complete in SGLang's progress check (drain)")

    def poll(self) -> None:
        self.sched.poll()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sched.close()

    def releases(self) -> list[Release]:
        return self.sched.device.releases

    def stored_keys(self) -> Iterable[str]:
        return self.sched.cc.store.keys()

    def stored_page(self, key: str) -> bytes | None:
        return self.sched.cc.store.get(key)

    def page_bytes(self, key: str) -> bytes:
        return page_bytes_of(key, self.sched.layout.page_nbytes)

    def host_pages_allocated(self) -> int:
        return self.sched.host.num_used

    def host_pages_free(self) -> int:
        return self.sched.host.num_free

    def device_pages_allocated(self) -> int:
        return self.sched.device.allocated()


#: SGLang's faithful configuration: no per-copy failure path; retractions ON.
FAITHFUL = KitOptions(failures=False)
SMALL = settings(KIT_SETTINGS, max_examples=40, stateful_step_count=25, derandomize=True)


def test_the_kit_with_retractions_passes_kvlifes_manager() -> None:
    assert FAITHFUL.retractions and FAITHFUL.resumes
    run_kit(DecodeAdapter, SMALL, options=FAITHFUL)


class DrainingOracle(Oracle):
    """The kit's oracle, told what SGLang's ``drain_before_retraction()`` is at one rank: its
    progress check, which waits for every copy queued (the kit's draining poll), before the
    retraction frees the row. The kit's own model counts no completion in a finish, so it
    takes the row's free after that wait for a free under copies in flight."""

    def apply(self, event: KitEvent) -> None:
        if isinstance(event, Finish) and event.reason is FinishReason.RETRACTED:
            self._poll()  # the drain's own check_offload_progress(), as the kit's poll
        super().apply(event)


class DrainingMachine(RuntimeMachine):
    def __init__(self, adapter_factory: Callable[[], Any], **options: Any) -> None:
        super().__init__(adapter_factory, **options)
        self.oracle = DrainingOracle(self.adapter, self.options)


#: The 3-event run the kit reports for SGLang's own manager (``release-in-flight``).
RETRACT_IN_FLIGHT = [Start("r0", (0,)), Step(0, (0, 0, 0, 0)), Finish(0, FinishReason.RETRACTED)]


def test_the_kits_release_in_flight_for_sglangs_manager_at_one_rank_is_a_false_alarm() -> None:
    """The kit flags SGLang's own manager: retraction frees a row under a copy in flight. But
    SGLang's drain waited for that copy (its progress check synchronizes every queued copy)
    before the free: the copy was applied and backed up first, nothing is tracked after."""
    with pytest.raises(InvariantViolation, match="release-in-flight"):
        replay_trace(lambda: DecodeAdapter(kvlife=False), RETRACT_IN_FLIGHT, FAITHFUL)
    sched = DecodeScheduler(kvlife=False)
    order: list[str] = []
    write_storage, free = sched.cc.write_storage, sched.allocator.free
    sched.cc.write_storage = lambda *a, **k: order.append("backup") or write_storage(*a, **k)
    sched.allocator.free = lambda indices: order.append("free") or free(indices)
    req = sched.start("r0", [0])
    gate = sched.engine.hold_next()
    assert sched.step(req, [0, 0, 0, 0])
    threading.Timer(0.1, gate.open).start()  # the drain waits for it
    sched.retract(req)
    assert order == ["backup", "free"] and not sched.mgr.ongoing_offload
    assert stored_ok(sched) == 2  # the copy read the pages before they went back
    sched.close()


def test_with_sglangs_drain_modelled_both_managers_retract_safely_at_one_rank() -> None:
    """The honest comparison at one rank: with the drain modelled as the completion it is,
    SGLang's own manager passes the kit with retractions on (resumes off: the stand-in's
    resume rewrites the request's prompt, which SGLang's decode side does not, so SGLang's
    stale per-Req state meets it on a path SGLang never takes); kvlife's passes with resumes
    too. Where SGLang's drain refuses (skewed host pools at TP=2) is in
    tests/test_sglang_decode_tp.py."""
    no_resumes = KitOptions(failures=False, resumes=False)
    for kvlife, options in ((False, no_resumes), (True, FAITHFUL)):
        run_state_machine_as_test(
            lambda kv=kvlife, o=options: DrainingMachine(
                lambda: DecodeAdapter(kvlife=kv), options=o
            ),
            settings=SMALL,
        )


def test_every_import_stand_in_is_listed_in_the_docs() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "sglang.md").read_text()
    for name in sglang_stubs.STAND_INS:
        assert f"`{name}`" in page, name
    assert set(sglang_stubs.installed) <= set(sglang_stubs.STAND_INS)
