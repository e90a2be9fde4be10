"""The testing kit itself: the scripted engine, the adapter, the oracle's rules, the kit on kvlife.

Each oracle rule is shown to fire on a run that breaks it (so the kit can
fail), and the whole kit is shown to pass on kvlife's own manager.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import kvlife.testing
from kvlife import FinishReason
from kvlife.errors import EngineError, PageBusy
from kvlife.layout import LayerFirstLayout
from kvlife.pool import HostPagePool
from kvlife.testing import (
    Complete,
    Finish,
    InvariantViolation,
    ManagerAdapter,
    Oracle,
    Poll,
    RuntimeAdapter,
    ScriptedEngine,
    Start,
    Step,
    run_kit,
)
from kvlife.testing.adapter import AdapterError
from kvlife.testing.strategies import events, replay

PAGE = 2


@pytest.fixture(autouse=True)
def _replays_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure's replay file goes to the test's own directory."""
    monkeypatch.setenv("KVLIFE_REPLAY_DIR", str(tmp_path / "replays"))


def _engine() -> tuple[LayerFirstLayout, HostPagePool, ScriptedEngine]:
    layout = LayerFirstLayout.zeros(1, 8, PAGE, 1, 2, dtype=torch.int32)
    host = HostPagePool(4, layout.page_numel, torch.int32, pin_memory=False)
    return layout, host, ScriptedEngine(layout, host)


def _ticket() -> object:
    from kvlife import Lifecycle

    life = Lifecycle("r", page_size=PAGE)
    return life.submit(list(range(PAGE)))


# ----------------------------------------------------------------------------- scripted engine


def test_scripted_copy_reads_device_pages_at_completion_not_at_submit() -> None:
    """Scenario: the device page changes between submit and completion; the host copy sees
    the new bytes, as a real engine that reads late would (the early-release hazard)."""
    layout, host, engine = _engine()
    ticket = _ticket()
    pages = host.alloc(1, owner="chunk")
    assert pages is not None
    layout.write_page(3, torch.full((layout.page_numel,), 7, dtype=torch.int32))
    engine.submit(ticket, [3], pages)  # type: ignore[arg-type]
    assert engine.inflight == 1 and engine.poll() == []
    layout.write_page(3, torch.full((layout.page_numel,), 9, dtype=torch.int32))  # reused early
    (copy,) = engine.in_flight()
    engine.complete(copy)
    (ack,) = engine.poll()
    assert ack.ok and ack.ticket is ticket and ack.host_pages == tuple(pages)
    assert torch.equal(
        host.tensor[pages[0]], torch.full((layout.page_numel,), 9, dtype=torch.int32)
    )
    assert engine.inflight == 0


def test_scripted_failure_and_refusals_change_nothing() -> None:
    _layout, host, engine = _engine()
    pages = host.alloc(1, owner="chunk")
    assert pages is not None
    engine.submit(_ticket(), [0], pages)  # type: ignore[arg-type]
    with pytest.raises(
        PageBusy, match="host page 0 is still being written"
    ):  # by a chunk in flight
        engine.check([1], pages)
    (copy,) = engine.in_flight()
    engine.complete(copy, ok=False)
    with pytest.raises(EngineError, match="is not in flight in this engine"):
        engine.complete(copy)
    assert engine.in_flight() == [] and engine.inflight == 1
    (ack,) = engine.poll()
    assert not ack.ok and engine.inflight == 0
    assert torch.count_nonzero(host.tensor) == 0  # a failed copy wrote nothing


def test_scripted_drain_completes_in_submit_order() -> None:
    _layout, host, engine = _engine()
    tickets = []
    for device_page in (5, 2, 7):
        pages = host.alloc(1, owner=device_page)
        assert pages is not None
        tickets.append(_ticket())
        engine.submit(tickets[-1], [device_page], pages)  # type: ignore[arg-type]
    assert [a.device_pages for a in engine.drain()] == [(5,), (2,), (7,)]
    assert engine.inflight == 0 and engine.in_flight() == []


# ----------------------------------------------------------------------------- adapter


def test_manager_adapter_is_a_runtime_adapter_and_refuses_foreign_requests() -> None:
    adapter = ManagerAdapter()
    try:
        assert isinstance(adapter, RuntimeAdapter)
        other = ManagerAdapter()
        theirs = other.start("r", [1, 2, 3])
        other.close()
        with pytest.raises(AdapterError, match="was not started by this adapter"):
            adapter.step(theirs, [4, 5])
        assert adapter.releases() == [] and adapter.copies_in_flight() == []
    finally:
        adapter.close()


def test_reused_rid_late_ack_scenario_passes_on_kvlife() -> None:
    """Scenario: life 0 (rid r) is aborted with two chunks in flight, life 1 reuses rid r and
    the same prompt, then life 0's chunks complete late and out of order."""
    adapter = ManagerAdapter()
    oracle = Oracle(adapter)
    oracle.apply(Start("r", (1, 2, 3)))
    oracle.apply(Step(0, (4, 5)))
    oracle.apply(Step(0, (6, 7)))
    oracle.apply(Finish(0, FinishReason.ABORTED))
    assert adapter.releases() == []  # two copies still read its device pages
    oracle.apply(Start("r", (1, 2, 3)))
    oracle.apply(Step(1, (8, 9)))
    oracle.apply(Complete(0, 1))
    oracle.apply(Complete(0, 0))
    (release,) = adapter.releases()
    assert release.request is oracle.lives[0].handle and release.copies_in_flight == 0
    oracle.close()
    assert [r.request for r in adapter.releases()] == [life.handle for life in oracle.lives]
    assert adapter.host_pages_allocated() == 0


# ----------------------------------------------------------------------------- the rules fire


def test_oracle_catches_a_page_stored_with_another_pages_bytes() -> None:
    adapter = ManagerAdapter()
    oracle = Oracle(adapter)
    oracle.apply(Start("r", (1, 2, 3)))
    oracle.apply(Step(0, (4, 5)))
    key = oracle.lives[0].keys[1]
    adapter.store.put(None, [key], torch.zeros((1, adapter.layout.page_numel), dtype=torch.int32))
    with pytest.raises(InvariantViolation) as err:
        oracle.check()
    assert err.value.rule == "misfiled-page"
    adapter.store.poll()  # the forged put's result is not the manager's
    adapter.close()


def test_oracle_catches_a_key_off_the_chain() -> None:
    adapter = ManagerAdapter()
    oracle = Oracle(adapter)
    oracle.apply(Start("r", (1, 2, 3)))
    adapter.store.put(None, ["ab" * 32], torch.zeros((1, 8), dtype=torch.int32))
    with pytest.raises(InvariantViolation) as err:
        oracle.check()
    assert err.value.rule == "hash-chain"
    adapter.store.poll()
    adapter.close()


def test_oracle_catches_a_release_with_a_copy_in_flight_and_a_leak() -> None:
    adapter = ManagerAdapter()
    oracle = Oracle(adapter)
    oracle.apply(Start("r", (1, 2, 3)))
    oracle.apply(Step(0, (4, 5)))
    life = oracle.lives[0]
    adapter.finish(life.handle, FinishReason.FINISHED)  # behind the oracle's back
    life.reason = FinishReason.FINISHED
    adapter._on_release(life.handle.handle, [])  # type: ignore[attr-defined]
    with pytest.raises(InvariantViolation) as err:
        oracle.check()
    assert err.value.rule == "release-in-flight"
    adapter.close()

    leaky = ManagerAdapter()
    oracle = Oracle(leaky)
    oracle.apply(Start("r", (1, 2, 3)))
    oracle.apply(Step(0, (4, 5)))
    leaky.host.alloc(1, owner="nobody")  # a page nobody will free
    with pytest.raises(InvariantViolation) as err:
        oracle.close()
    assert err.value.rule == "host-leak"


def test_oracle_refuses_a_completion_of_a_chunk_never_submitted() -> None:
    adapter = ManagerAdapter()
    oracle = Oracle(adapter)
    oracle.apply(Start("r", (1, 2, 3)))
    with pytest.raises(InvariantViolation):
        oracle.apply(Complete(0, 0))
    oracle.apply(Poll())
    adapter.close()


# ----------------------------------------------------------------------------- the kit on kvlife


def test_kit_passes_on_kvlifes_manager() -> None:
    run_kit(ManagerAdapter)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events())
def test_event_sequences_replay_cleanly_on_kvlife(sequence: list[object]) -> None:
    oracle = replay(ManagerAdapter, sequence)  # type: ignore[arg-type]
    assert all(life.released for life in oracle.lives)


def test_lazy_names_and_unknown_names() -> None:
    assert kvlife.testing.run_kit is run_kit
    with pytest.raises(AttributeError):
        kvlife.testing.no_such_name  # noqa: B018


def test_docs_page_shows_the_example_as_it_runs() -> None:
    """docs/testing-kit.md quotes examples/test_my_runtime.py verbatim (CI runs the example)."""
    root = Path(__file__).resolve().parents[1]
    example = (root / "examples" / "test_my_runtime.py").read_text(encoding="utf-8")
    page = (root / "docs" / "testing-kit.md").read_text(encoding="utf-8")
    assert f"```python\n{example}```" in page, (
        "docs/testing-kit.md's example differs from examples/test_my_runtime.py"
    )


@pytest.mark.slow
def test_kit_full_size_on_kvlifes_manager() -> None:
    """The full-size run (``python -m pytest -m slow``): 2,000 examples x 80 steps."""
    run_kit(
        ManagerAdapter,
        settings(
            max_examples=2_000,
            stateful_step_count=80,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_the_scripted_engine_copies_a_load_host_to_device() -> None:
    """A LoadTicket's copy goes host -> device, and its pages are busy as a load's until then."""
    import torch

    from kvlife import Lifecycle
    from kvlife.layout import PageFirstLayout
    from kvlife.pool import HostPagePool
    from kvlife.testing.scripted import ScriptedEngine

    layout = PageFirstLayout.zeros(1, 4, 2, 1, 2, dtype=torch.float32)
    host = HostPagePool(2, layout.page_numel, torch.float32)
    engine = ScriptedEngine(layout, host)
    lc = Lifecycle("r", page_size=1)
    load = lc.load(["k"])
    pages = host.alloc(1, owner=lc)
    assert pages is not None
    host.tensor[pages[0]] = torch.arange(layout.page_numel, dtype=torch.float32) + 7
    copy = engine.submit(load, [3], pages)
    with pytest.raises(PageBusy, match="device page 3 is still being written"):  # 2nd writer
        engine.check([3], pages, load=True)
    engine.complete(copy)
    (ack,) = engine.poll()
    assert ack.ok and ack.ticket is load
    assert torch.equal(layout.read_page(3), host.tensor[pages[0]])
    engine.check([3], pages, load=True)  # free again
