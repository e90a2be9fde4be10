"""kvlife.testing: check a decode runtime's offload bookkeeping against the lifecycle rules.

Three parts, for engineers who test their own runtime:

* :class:`RuntimeAdapter` -- all the kit needs from a runtime; :class:`ManagerAdapter`
  is the one for runtimes built on kvlife's manager (with :class:`ScriptedEngine`);
* :func:`run_kit` / :class:`RuntimeMachine` -- the hypothesis state machine:
  reused rids, late and out-of-order completions, aborts, retractions, resumes;
* :func:`check_exhaustively` -- every interleaving of a small configuration
  (the ``kvlife check`` command).

The hypothesis parts are imported on first use, so ``kvlife check`` runs
without hypothesis installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlife.testing.adapter import (
    Complete,
    Finish,
    InlineStore,
    InvariantViolation,
    KitEvent,
    ManagerAdapter,
    Oracle,
    Poll,
    Release,
    Resume,
    RuntimeAdapter,
    Start,
    Step,
)
from kvlife.testing.exhaustive import CheckReport, check_exhaustively
from kvlife.testing.scripted import CopyNotInFlight, ScriptedCopy, ScriptedEngine

if TYPE_CHECKING:
    from kvlife.testing.stateful import RuntimeMachine, run_kit

__all__ = [
    "CheckReport",
    "Complete",
    "CopyNotInFlight",
    "Finish",
    "InlineStore",
    "InvariantViolation",
    "KitEvent",
    "ManagerAdapter",
    "Oracle",
    "Poll",
    "Release",
    "Resume",
    "RuntimeAdapter",
    "RuntimeMachine",
    "ScriptedCopy",
    "ScriptedEngine",
    "Start",
    "Step",
    "check_exhaustively",
    "run_kit",
]

_LAZY = {"RuntimeMachine", "run_kit"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvlife.testing import stateful

        return getattr(stateful, name)
    raise AttributeError(f"module 'kvlife.testing' has no attribute {name!r}")
