"""The table's validation, the one shared ``transitions`` machine, and the differential test.

The differential test drives the fast :class:`kvlife.Lifecycle` and the
``transitions``-driven :class:`ReferenceLifecycle` (``tests/reference_lifecycle.py``) with the same
random event sequences and requires the same refusals and the same fields.

CI runs a moderate number of examples. The full run (thousands of examples):

    KVLIFE_HYPOTHESIS_PROFILE=full python -m pytest tests/test_spec.py -m slow -p no:randomly

or just ``python -m pytest tests/test_spec.py -m slow`` (the slow variant always
uses the full profile).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import transitions
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from kvlife import (
    TABLE,
    Event,
    FinishReason,
    Lifecycle,
    LifecycleError,
    LoadTicket,
    State,
    Ticket,
    Transition,
)
from kvlife._lifecycle import compile_table
from kvlife.diagrams import lifecycle_mermaid
from kvlife.hashing import sglang_page_hashes

sys.path.insert(0, str(Path(__file__).parent))
import reference_lifecycle as _spec
from reference_lifecycle import ReferenceLifecycle, build_machine, validate

settings.register_profile(
    "kvlife-lifecycle-ci",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "kvlife-lifecycle-full",
    max_examples=5000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
_PROFILE = "kvlife-lifecycle-" + os.environ.get("KVLIFE_HYPOTHESIS_PROFILE", "ci")

PAGE = 2
PRIOR = sglang_page_hashes([7, 7], PAGE, None)[0]


# ------------------------------------------------------------------ validation


def _replace(table: tuple[Transition, ...], index: int, **changes: Any) -> tuple[Transition, ...]:
    rows = list(table)
    rows[index] = dataclasses.replace(rows[index], **changes)
    return tuple(rows)


def _row_index(source: State, event: Event, guard: str | None = None) -> int:
    for i, row in enumerate(TABLE):
        if row.source is source and row.event is event and row.guard == guard:
            return i
    raise LookupError((source, event, guard))


def test_validate_passes_on_the_table() -> None:
    validate(TABLE)
    validate()


def test_validate_refuses_an_unreachable_state() -> None:
    # Without the two finish rows nothing leads to FINISHED (nor on to RELEASED).
    table = tuple(row for row in TABLE if row.event is not Event.FINISH)
    with pytest.raises(ValueError, match=r"unreachable.*FINISHED"):
        validate(table)


def test_validate_refuses_a_dead_end() -> None:
    # FINISHED can no longer release: a finished Lifecycle would wait forever.
    table = tuple(row for row in TABLE if row.source is not State.FINISHED)
    # Keep RELEASED reachable through another path so only the dead end is wrong.
    table += (Transition(State.OFFLOADING, Event.RELEASE, State.RELEASED, "drained", "x"),)
    with pytest.raises(ValueError, match="FINISHED is a dead end"):
        validate(table)


def test_validate_refuses_a_non_deterministic_pair_of_rows() -> None:
    # An ack with one chunk in flight would lead both to IDLE and to OFFLOADING.
    i = _row_index(State.OFFLOADING, Event.ACK, "more_stores")
    table = _replace(TABLE, i, guard=None)
    with pytest.raises(ValueError, match="not deterministic"):
        validate(table)
    # Also refused: two unguarded rows for the same (state, event).
    twin = Transition(State.IDLE, Event.SUBMIT, State.FINISHED, None, "twin")
    with pytest.raises(ValueError, match="not deterministic"):
        validate((*TABLE, twin))


def test_validate_refuses_a_row_leaving_released() -> None:
    row = Transition(State.RELEASED, Event.SUBMIT, State.OFFLOADING, None, "resurrect")
    with pytest.raises(ValueError, match="RELEASED must be terminal"):
        validate((*TABLE, row))


def test_validate_refuses_an_unknown_guard() -> None:
    i = _row_index(State.FINISHED, Event.RELEASE, "drained")
    with pytest.raises(ValueError, match="unknown guard"):
        validate(_replace(TABLE, i, guard="nearly_drained"))


def test_compiled_table_matches_the_rows() -> None:
    compiled = compile_table(TABLE)
    assert compiled[(State.IDLE, Event.SUBMIT, (0, 0))] is State.OFFLOADING
    assert compiled[(State.OFFLOADING, Event.ACK, (1, 0))] is State.IDLE
    assert compiled[(State.OFFLOADING, Event.ACK, (2, 0))] is State.OFFLOADING
    # The last store acked with a load still in flight: what is left is a load.
    assert compiled[(State.OFFLOADING, Event.ACK, (1, 1))] is State.LOADING
    assert compiled[(State.LOADING, Event.LOAD_ACK, (0, 1))] is State.IDLE
    assert compiled[(State.FINISHED, Event.RELEASE, (0, 0))] is State.RELEASED
    assert (State.FINISHED, Event.RELEASE, (1, 0)) not in compiled
    assert (State.FINISHED, Event.RELEASE, (0, 1)) not in compiled
    assert not any(key[0] is State.RELEASED for key in compiled)


def test_diagram_is_drawn_from_the_table() -> None:
    source = lifecycle_mermaid()
    assert "stateDiagram" in source
    for row in TABLE:
        arc = f"{row.source.name} --> {row.dest.name}:"
        lines = [line.strip() for line in source.splitlines()]
        assert any(line.startswith(arc) and row.event.value in line for line in lines), arc


# ------------------------------------------------------ the machine is built once


def test_reference_lifecycles_share_one_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[object] = []
    original = transitions.Machine.__init__

    def counting_init(self: transitions.Machine, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(transitions.Machine, "__init__", counting_init)
    refs = [ReferenceLifecycle(f"r{i}", page_size=PAGE) for i in range(100)]
    try:
        assert built == []
        assert all(ref.machine is _spec._MACHINE for ref in refs)
        assert all(ref._model in _spec._MACHINE.models for ref in refs)
        # ... and the counter does count: building a machine is seen.
        build_machine()
        assert len(built) == 1
    finally:
        for ref in refs:
            ref.close()
    assert not any(ref._model in _spec._MACHINE.models for ref in refs)


# ---------------------------------------------------------- differential test

_token = st.integers(min_value=-1, max_value=2**32)  # edges -1 and 2**32 are out of range
_whole_pages = st.integers(1, 3).flatmap(
    lambda k: st.lists(st.integers(0, 2**32 - 1), min_size=k * PAGE, max_size=k * PAGE)
)
_any_length = st.lists(_token, max_size=3 * PAGE + 1)
_reason = st.sampled_from([*FinishReason, "finished", None, 0])

# Weighted by share of draws: mostly well-formed submits and acks, some of everything else.
_OP_ARGS: list[tuple[str, st.SearchStrategy[Any]]] = [
    *[("submit", _whole_pages)] * 3,
    ("submit", _any_length),
    *[("ack", st.integers(0, 20))] * 5,
    ("foreign", st.none()),
    ("unknown", st.integers(-2, 2)),
    *[("finish", _reason)] * 2,
    *[("load", st.lists(st.sampled_from(["ab", "cd", "ef"]), max_size=3))] * 2,
    *[("ack_load", st.integers(0, 20))] * 2,
    ("unknown_load", st.integers(-2, 2)),
]
_op = st.integers(0, len(_OP_ARGS) - 1).flatmap(
    lambda i: st.tuples(st.just(_OP_ARGS[i][0]), _OP_ARGS[i][1])
)


def _ref_fields(ref: ReferenceLifecycle) -> tuple[object, ...]:
    in_flight = tuple(seq for seq, acked in enumerate(ref.acked) if not acked)
    return (
        ref.state,
        ref.inflight,
        ref.tokens_submitted,
        ref.last_hash,
        ref.chain_tail,
        in_flight,
        len(ref.submitted),
        ref.finish_reason,
        tuple(seq for seq, acked in enumerate(ref.loads_acked) if not acked),
    )


def _fast_fields(lc: Lifecycle) -> tuple[object, ...]:
    snap = lc.snapshot()
    return (
        snap.state,
        snap.inflight,
        snap.tokens_submitted,
        snap.last_hash,
        snap.chain_tail,
        snap.in_flight_seqs,
        snap.next_seq,
        snap.finish_reason,
        snap.loads_in_flight,
    )


def _outcome(call: Any) -> type[BaseException] | None:
    try:
        call()
    except LifecycleError as exc:
        return type(exc)
    return None


def _label(outcome: str) -> None:
    """Count ``outcome`` in hypothesis statistics (``--hypothesis-show-statistics``)."""
    if currently_in_test_context():
        event(outcome)


def run_differential(ops: list[tuple[str, Any]], prior: str | None) -> None:
    """Apply ``ops`` to a fast Lifecycle and a ReferenceLifecycle; they must agree each step."""
    rid = "same"
    released: list[Lifecycle] = []
    fast = Lifecycle(rid, page_size=PAGE, prior_hash=prior, on_release=released.append)
    ref = ReferenceLifecycle(rid, page_size=PAGE, prior_hash=prior)
    # A second life with the SAME rid, one chunk in flight: its ticket must never move `fast`.
    other = Lifecycle(rid, page_size=PAGE)
    other_ref = ReferenceLifecycle(rid, page_size=PAGE)
    try:
        other_ticket = other.submit([1, 2])
        other_seq = other_ref.submit([1, 2])
        tickets: list[Ticket] = []
        loads: list[LoadTicket] = []
        for step, (kind, arg) in enumerate(ops):
            if kind == "submit":
                got: list[Ticket] = []
                fast_err = _outcome(lambda: got.append(fast.submit(arg)))  # noqa: B023
                ref_seqs: list[int] = []
                ref_err = _outcome(lambda: ref_seqs.append(ref.submit(arg)))  # noqa: B023
                if got and ref_seqs:
                    assert got[0][1] == ref_seqs[0]
                    assert got[0][2] == ref.submitted[ref_seqs[0]]
                    tickets.append(got[0])
            elif kind == "ack" and tickets:
                ticket = tickets[arg % len(tickets)]
                fast_err = _outcome(lambda: fast.ack(ticket))  # noqa: B023
                ref_err = _outcome(lambda: ref.ack(ref, ticket[1]))  # noqa: B023
            elif kind == "foreign":
                fast_err = _outcome(lambda: fast.ack(other_ticket))
                ref_err = _outcome(lambda: ref.ack(other_ref, other_seq))
            elif kind in ("unknown", "ack"):  # an ack with no ticket yet is an unknown one too
                seq = fast.next_seq + (arg if kind == "unknown" else 0)
                if kind == "unknown" and arg < 0:
                    seq = arg
                forged: Ticket = (fast, seq, ("forged",), 0)
                fast_err = _outcome(lambda: fast.ack(forged))  # noqa: B023
                ref_err = _outcome(lambda: ref.ack(ref, seq))  # noqa: B023
            elif kind == "load":
                started: list[LoadTicket] = []
                fast_err = _outcome(lambda: started.append(fast.load(arg)))  # noqa: B023
                ref_loads: list[int] = []
                ref_err = _outcome(lambda: ref_loads.append(ref.load(arg)))  # noqa: B023
                if started and ref_loads:
                    assert started[0].seq == ref_loads[0]
                    loads.append(started[0])
            elif kind == "ack_load" and loads:
                load = loads[arg % len(loads)]
                fast_err = _outcome(lambda: fast.ack(load))  # noqa: B023
                ref_err = _outcome(lambda: ref.ack_load(ref, load.seq))  # noqa: B023
            elif kind in ("unknown_load", "ack_load"):
                seq = len(ref.loads) + (arg if kind == "unknown_load" else 0)
                if arg < 0:
                    seq = arg
                forged_load = LoadTicket(fast, seq, ("forged",))
                fast_err = _outcome(lambda: fast.ack(forged_load))  # noqa: B023
                ref_err = _outcome(lambda: ref.ack_load(ref, seq))  # noqa: B023
            else:
                fast_err = _outcome(lambda: fast.finish(arg))  # noqa: B023
                ref_err = _outcome(lambda: ref.finish(arg))  # noqa: B023
            _label(f"{kind} -> {fast_err.__name__ if fast_err else 'ok'}")
            where = f"step {step}: {kind} {arg!r}"
            assert fast_err is ref_err, where
            assert _fast_fields(fast) == _ref_fields(ref), where
            assert len(released) == ref.releases, where
            assert released in ([], [fast]), where
        _label(f"ends {fast.state.name}")
        # The other life was never touched by anything `fast` did.
        assert other.state is State.OFFLOADING
        assert other.inflight == 1
    finally:
        ref.close()
        other_ref.close()


@settings(settings.get_profile(_PROFILE))
@given(ops=st.lists(_op, max_size=40), prior=st.sampled_from([None, PRIOR]))
def test_fast_lifecycle_agrees_with_the_transitions_reference(
    ops: list[tuple[str, Any]], prior: str | None
) -> None:
    run_differential(ops, prior)


@pytest.mark.slow
@settings(settings.get_profile("kvlife-lifecycle-full"))
@given(ops=st.lists(_op, max_size=80), prior=st.sampled_from([None, PRIOR]))
def test_fast_lifecycle_agrees_with_the_transitions_reference_full(
    ops: list[tuple[str, Any]], prior: str | None
) -> None:
    run_differential(ops, prior)


def test_differential_catches_a_drained_finish_that_never_releases() -> None:
    """The oracle can fail: finish, then the last ack, must release in both engines."""
    run_differential([("submit", [1, 2]), ("finish", FinishReason.ABORTED), ("ack", 0)], None)
