"""The kit's hypothesis state machine: each rule is one scheduler event the
:class:`~kvlife.testing.Oracle` runs on the adapter and checks (docs/testing-kit.md,
"Running it")."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvlife._lifecycle import FinishReason
from kvlife.testing.adapter import RuntimeAdapter
from kvlife.testing.events import Close, Finish, Poll, Resume, Return, Start, Step
from kvlife.testing.options import KitOptions
from kvlife.testing.oracle import Oracle
from kvlife.testing.report import KitFailure, rule_of
from kvlife.testing.strategies import RIDS, copy_outcomes, decode_tokens, prompts, sampled

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
        options: KitOptions | None = None,
        rids: tuple[str, ...] = RIDS,
        max_unreleased: int = 6,
        max_tokens: int = 24,
    ) -> None:
        super().__init__()
        self.options = options or KitOptions()
        self.adapter = adapter_factory()
        self.oracle = Oracle(self.adapter, self.options)
        self.rids = rids
        self.max_unreleased = max_unreleased
        self.max_tokens = max_tokens
        self._clean = True

    def _run(self, action: Callable[..., None], *args: Any) -> None:
        """Run one event; remember a failure so teardown does not mask it."""
        self._clean = False
        action(*args)
        self._clean = True

    @precondition(lambda self: self.oracle.unreleased() < self.max_unreleased)
    @rule(data=st.data(), prompt=prompts())
    def start(self, data: st.DataObject, prompt: tuple[int, ...]) -> None:
        """A request life begins, often with a rid a draining life still uses."""
        free = self.oracle.idle(self.rids)
        if free:
            rid = data.draw(sampled(free), label="rid")
            self._run(self.oracle.apply, Start(rid, prompt))

    @precondition(lambda self: bool(self.oracle.running()))
    @rule(data=st.data(), steps=st.lists(decode_tokens(), min_size=1, max_size=3))
    def step(self, data: st.DataObject, steps: list[tuple[int, ...]]) -> None:
        """A running life decodes a few steps; its runtime offloads what is due after each."""
        growing = self.oracle.growing(self.max_tokens)
        if growing:
            life = data.draw(sampled(growing), label="life")
            for tokens in steps:
                self._run(self.oracle.apply, Step(life.index, tokens))

    @precondition(lambda self: bool(self.oracle.running()))
    @rule(tokens=decode_tokens(2))
    def batch_step(self, tokens: tuple[int, ...]) -> None:
        """One scheduler step: every running life decodes the same number of tokens."""
        for life in self.oracle.growing(self.max_tokens):
            self._run(self.oracle.apply, Step(life.index, tokens))

    @precondition(lambda self: bool(self.oracle.running()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A running life finishes, is aborted, or is retracted (as the options allow)."""
        life = data.draw(sampled(self.oracle.running()), label="life")
        reason: FinishReason = data.draw(sampled(self.options.reasons), label="reason")
        self._run(self.oracle.apply, Finish(life.index, reason))

    @precondition(
        lambda self: (
            self.options.resumes
            and bool(self.oracle.resumable())
            and self.oracle.unreleased() < self.max_unreleased
        )
    )
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        """A retracted request resumes as a new life (same rid, its tokens as the prompt)."""
        life = data.draw(sampled(self.oracle.resumable()), label="retracted")
        self._run(self.oracle.apply, Resume(life.index))

    @precondition(
        lambda self: (
            self.options.returns
            and bool(self.oracle.returnable(self.max_tokens))
            and self.oracle.unreleased() < self.max_unreleased
        )
    )
    @rule(data=st.data())
    def return_(self, data: st.DataObject) -> None:
        """A conversation returns (often while its earlier life still drains): a new life on
        its rid whose prompt extends its tokens; the runtime loads what it holds of it."""
        life = data.draw(sampled(self.oracle.returnable(self.max_tokens)), label="life")
        self._run(self.oracle.apply, Return(life.index))

    @precondition(lambda self: self.oracle.progress == "poll" and bool(self.oracle.in_flight()))
    @rule(data=st.data(), poll=st.booleans())
    def complete(self, data: st.DataObject, poll: bool) -> None:
        """A copy completes (the oldest, the newest, a late one, or any), or fails."""
        ok = data.draw(copy_outcomes() if self.options.failures else st.just(True), label="ok")
        waiting = self.oracle.in_flight()
        late = [c for c in waiting if not self.oracle.owner(c).running]
        choices = [sampled(waiting[:1]), sampled(waiting[-1:]), sampled(waiting)]
        if late:
            choices.append(sampled(late))
        copy = data.draw(st.one_of(choices), label="copy")
        self._run(self.oracle.complete, copy, ok, poll)

    @rule()
    def poll(self) -> None:
        """The scheduler polls."""
        self._run(self.oracle.apply, Poll())

    def teardown(self) -> None:
        """Finish, drain and close; then every life released once and no host page left."""
        if self._clean:
            self.oracle.run([Close()])  # abandons the adapter if the close fails
        else:
            self.oracle.abandon()


def run_kit(
    adapter_factory: Callable[[], RuntimeAdapter],
    settings: settings | None = None,
    *,
    options: KitOptions | None = None,
    seed: int | None = None,
    runtime: str | None = None,
    replay_dir: str | os.PathLike[str] | None = None,
    **machine_options: Any,
) -> None:
    """Run :class:`RuntimeMachine` against ``adapter_factory`` as one test.

    ``settings`` default to :data:`KIT_SETTINGS` (derive yours from it). A failure is raised
    as one :class:`~kvlife.testing.KitFailure`: the broken rule, the shrunk run and the seed
    (docs/testing-kit.md, "Running it"). The failure is also written as a replay file
    (in ``replay_dir``, default :func:`kvlife.testing.replay.default_dir`; ``runtime``
    names the factory as ``module:factory`` where its own name does not import back),
    its path in ``failure.replay_path`` and the message.
    """
    chosen = settings or KIT_SETTINGS
    chosen = type(chosen)(chosen, report_multiple_bugs=False)
    kit_options = options or KitOptions()
    if seed is None and not chosen.derandomize:
        seed = random.getrandbits(32)
    last: list[RuntimeMachine] = []

    def machine() -> RuntimeMachine:
        made = RuntimeMachine(adapter_factory, options=kit_options, **machine_options)
        last[:] = [made]
        return made

    if seed is not None:
        machine._hypothesis_internal_use_seed = seed  # type: ignore[attr-defined]  # as @seed does
    try:
        # Any factory of machines works; the stub names the class form only.
        run_state_machine_as_test(machine, settings=chosen)  # type: ignore[arg-type]
    except HypothesisException:
        raise  # a health check or a flaky test: not a finding about the runtime
    except Exception as exc:
        events = last[0].oracle.trace if last else []
        rule = rule_of(exc)
        text = str(exc)
        detail = text[len(rule) + 3 :] if text.startswith(f"[{rule}] ") else f"{rule}: {text}"
        how = "replay: kvlife.testing.replay_trace(adapter_factory, failure.events)"
        if seed is not None:
            how += f"; rerun: run_kit(adapter_factory, ..., seed={seed})"
        else:
            how += "; derandomized: the same settings rerun the same search"
        path = _save_replay(
            adapter_factory, events, kit_options, rule, detail, seed, runtime, replay_dir
        )
        if path is not None:
            how += f"\nreplay file: {path} (kvlife check --replay {path})"
        failure = KitFailure(rule, detail, events, seed=seed, how=how)
        failure.replay_path = path
        raise failure from exc


def _save_replay(
    factory: Callable[[], RuntimeAdapter],
    events: list[Any],
    options: KitOptions,
    rule: str,
    detail: str,
    seed: int | None,
    runtime: str | None,
    directory: str | os.PathLike[str] | None,
) -> str | None:
    """The failure (shrunk by hypothesis) as a replay file; its path (None if it could not
    be written)."""
    from kvlife.testing import replay

    record = replay.Replay(
        [*events, Close()] if events and not isinstance(events[-1], Close) else list(events),
        options,
        rule,
        detail,
        runtime=runtime or replay.factory_spec(factory),
        seed=seed,
        source="kit",
    )
    try:  # hypothesis has shrunk the run already
        return str(replay.save(record, factory, directory=directory, shrunk=False))
    except OSError:
        return None
