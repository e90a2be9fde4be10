"""kvlife.testing: check a decode runtime's offload bookkeeping against the lifecycle rules.

A :class:`RuntimeAdapter` drives the runtime, the :class:`Oracle` checks every rule after each
event; :func:`run_kit` (hypothesis, imported on first use) and :func:`check_exhaustively`
(every interleaving, ``kvlife check``) drive it. Guide: docs/testing-kit.md.
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
from kvlife.testing.exhaustive import CheckConfig, CheckReport, Violation, check_exhaustively
from kvlife.testing.options import KitOptions, Progress
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
