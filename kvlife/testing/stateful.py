"""The kit's hypothesis state machine: your runtime, through its adapter, against the oracle.

:class:`RuntimeMachine` takes an adapter factory (zarr's pattern: the thing
under test is passed in, the trusted model lives on ``self``). Each rule is
one scheduler event; the :class:`~kvlife.testing.Oracle` runs it on the
adapter and checks every rule of the lifecycle after it. Teardown finishes
every running life, completes every copy, closes, and checks that every life
was released exactly once and no host page is left.

Importing this module defines no test. Run it from a test with one line::

    def test_my_runtime():
        run_kit(MyAdapter)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvlife._lifecycle import FinishReason
from kvlife.testing.adapter import Finish, Oracle, Poll, Resume, RuntimeAdapter, Start, Step
from kvlife.testing.strategies import (
    RIDS,
    copy_outcomes,
    decode_tokens,
    finish_reasons,
    prompts,
)

__all__ = ["KIT_SETTINGS", "RuntimeMachine", "run_kit"]

#: The settings :func:`run_kit` uses unless given others: 100 runs of up to 40 rules.
KIT_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class RuntimeMachine(RuleBasedStateMachine):
    """Reused rids, late/out-of-order/failed completions, aborts, retractions, resumes."""

    def __init__(
        self,
        adapter_factory: Callable[[], RuntimeAdapter],
        *,
        rids: tuple[str, ...] = RIDS,
        max_unreleased: int = 6,
        max_tokens: int = 24,
    ) -> None:
        super().__init__()
        self.adapter = adapter_factory()
        self.oracle = Oracle(self.adapter)
        self.rids = rids
        self.max_unreleased = max_unreleased
        self.max_tokens = max_tokens
        self._clean = True

    def _run(self, action: Callable[[], None]) -> None:
        """Run one event; remember a failure so teardown does not mask it."""
        self._clean = False
        action()
        self._clean = True

    def _free_rids(self) -> list[str]:
        busy = {life.rid for life in self.oracle.running()}
        return [rid for rid in self.rids if rid not in busy]

    # ---------------------------------------------------------------- rules

    @precondition(lambda self: self.oracle.unreleased() < self.max_unreleased)
    @rule(data=st.data(), prompt=prompts())
    def start(self, data: st.DataObject, prompt: tuple[int, ...]) -> None:
        """A request life begins, often with a rid a draining life still uses."""
        free = self._free_rids()
        if free:
            rid = data.draw(st.sampled_from(free), label="rid")
            self._run(lambda: self.oracle.apply(Start(rid, prompt)))

    @precondition(lambda self: bool(self.oracle.running()))
    @rule(data=st.data(), steps=st.lists(decode_tokens(), min_size=1, max_size=3))
    def step(self, data: st.DataObject, steps: list[tuple[int, ...]]) -> None:
        """A running life decodes a few steps; its runtime offloads what is due after each."""
        growing = [lf for lf in self.oracle.running() if len(lf.tokens) < self.max_tokens]
        if growing:
            life = data.draw(st.sampled_from(growing), label="life")
            for tokens in steps:
                self._run(partial(self.oracle.apply, Step(life.index, tokens)))

    @precondition(lambda self: bool(self.oracle.running()))
    @rule(tokens=decode_tokens(2))
    def batch_step(self, tokens: tuple[int, ...]) -> None:
        """One scheduler step: every running life decodes the same number of tokens."""
        for life in self.oracle.running():
            if len(life.tokens) < self.max_tokens:
                self._run(partial(self.oracle.apply, Step(life.index, tokens)))

    @precondition(lambda self: bool(self.oracle.running()))
    @rule(data=st.data(), reason=finish_reasons())
    def finish(self, data: st.DataObject, reason: FinishReason) -> None:
        """A running life finishes, is aborted, or is retracted."""
        life = data.draw(st.sampled_from(self.oracle.running()), label="life")
        self._run(lambda: self.oracle.apply(Finish(life.index, reason)))

    @precondition(
        lambda self: (
            bool(self.oracle.resumable()) and self.oracle.unreleased() < self.max_unreleased
        )
    )
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        """A retracted request resumes as a new life (same rid, its tokens as the prompt)."""
        life = data.draw(st.sampled_from(self.oracle.resumable()), label="retracted")
        self._run(lambda: self.oracle.apply(Resume(life.index)))

    @precondition(lambda self: bool(self.oracle.in_flight()))
    @rule(data=st.data(), ok=copy_outcomes(), poll=st.booleans())
    def complete(self, data: st.DataObject, ok: bool, poll: bool) -> None:
        """A copy completes: the oldest, the newest, a finished life's (late), or any."""
        waiting = self.oracle.in_flight()
        late = [c for c in waiting if not self.oracle_owner(c).running]
        choices = [st.just(waiting[0]), st.just(waiting[-1]), st.sampled_from(waiting)]
        if late:
            choices.append(st.sampled_from(late))
        copy = data.draw(st.one_of(choices), label="copy")
        self._run(lambda: self.oracle.complete(copy, ok, poll))

    @rule()
    def poll(self) -> None:
        """The scheduler polls."""
        self._run(lambda: self.oracle.apply(Poll()))

    def oracle_owner(self, copy: object) -> Any:
        """The oracle's life that submitted ``copy``."""
        return next(lf for lf in self.oracle.lives if any(c is copy for c in lf.copies))

    def teardown(self) -> None:
        """Finish, drain and close; then every life released once and no host page left."""
        try:
            if self._clean:
                self.oracle.close()
        finally:
            self.adapter.close()


def run_kit(
    adapter_factory: Callable[[], RuntimeAdapter],
    settings: settings | None = None,
    **options: Any,
) -> None:
    """Run :class:`RuntimeMachine` against ``adapter_factory`` as one test (call it from pytest)."""
    run_state_machine_as_test(
        # Any factory of machines works; the stub names the class form only.
        lambda: RuntimeMachine(adapter_factory, **options),  # type: ignore[arg-type]
        settings=settings or KIT_SETTINGS,
    )
