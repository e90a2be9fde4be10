"""kvlife.testing: check a decode runtime's offload bookkeeping against the lifecycle rules.

Three parts, for engineers who test their own runtime:

* :class:`RuntimeAdapter` -- all the kit needs from a runtime; :class:`ManagerAdapter`
  is the one for runtimes built on kvlife's manager (with :class:`ScriptedEngine`
  and an :class:`~kvlife.store.InlineStore`) (``adapter``); the kit's events
  (``events``) and :class:`Oracle`, the model that checks every rule after each
  one (``oracle``);
* :func:`run_kit` / :class:`RuntimeMachine` -- the hypothesis state machine:
  reused rids, late and out-of-order completions, aborts, retractions, resumes;
* :func:`check_exhaustively` -- every interleaving of a small configuration
  (the ``kvlife check`` command, ``--runtime module:factory`` for yours).

Both take one :class:`KitOptions` (same defaults) and report a failure as one
readable trace (:class:`KitFailure`, :class:`Violation`), replayable with
:func:`replay_trace`.

The hypothesis parts are imported on first use, so ``kvlife check`` runs
without hypothesis installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlife.store.memory import InlineStore
from kvlife.testing.adapter import (
    DevicePages,
    ManagerAdapter,
    Release,
    RuntimeAdapter,
    page_bytes_of,
)
from kvlife.testing.events import Close, Complete, Finish, KitEvent, Poll, Resume, Start, Step
from kvlife.testing.exhaustive import (
    CheckConfig,
    CheckReport,
    Violation,
    check_exhaustively,
)
from kvlife.testing.options import (
    KitOptions,
    Progress,
)
from kvlife.testing.oracle import InvariantViolation, Oracle
from kvlife.testing.report import KitFailure, format_trace, replay_trace
from kvlife.testing.scripted import ScriptedCopy, ScriptedEngine

if TYPE_CHECKING:
    from kvlife.testing.stateful import KIT_SETTINGS, RuntimeMachine, run_kit

__all__ = [
    "KIT_SETTINGS",
    "CheckConfig",
    "CheckReport",
    "Close",
    "Complete",
    "DevicePages",
    "Finish",
    "InlineStore",
    "InvariantViolation",
    "KitEvent",
    "KitFailure",
    "KitOptions",
    "ManagerAdapter",
    "Oracle",
    "Poll",
    "Progress",
    "Release",
    "Resume",
    "RuntimeAdapter",
    "RuntimeMachine",
    "ScriptedCopy",
    "ScriptedEngine",
    "Start",
    "Step",
    "Violation",
    "check_exhaustively",
    "format_trace",
    "page_bytes_of",
    "replay_trace",
    "run_kit",
]

_LAZY = {"KIT_SETTINGS", "RuntimeMachine", "run_kit"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvlife.testing import stateful

        return getattr(stateful, name)
    raise AttributeError(f"module 'kvlife.testing' has no attribute {name!r}")
