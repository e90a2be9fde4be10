"""One set of options for both drivers: :func:`~kvlife.testing.run_kit` and
:func:`~kvlife.testing.check_exhaustively` (and ``kvlife check``), same defaults in both."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from kvlife._lifecycle import FinishReason
from kvlife.errors import ConfigError

__all__ = ["PROGRESS_MODELS", "ConfigError", "KitOptions", "Progress", "progress_of"]

#: How a runtime's progress check (its poll) treats copies still queued:
#: ``"poll"``: non-blocking, it applies only the copies that already completed (the kit
#: completes copies one by one, in any order); ``"drain"``: it waits for every queued copy
#: (SGLang's ``check_offload_progress``), so every copy in flight completes during the poll.
Progress = Literal["poll", "drain"]
PROGRESS_MODELS: tuple[Progress, ...] = ("poll", "drain")


@dataclass(frozen=True)
class KitOptions:
    """What the kit may do to a runtime; the defaults are the adversarial ones. Turn off
    what your runtime does not have (docs/testing-kit.md, "Options")."""

    #: Copies may fail (only under the ``"poll"`` progress model).
    failures: bool = True
    #: Lives may be aborted.
    aborts: bool = True
    #: Lives may be retracted (preempted).
    retractions: bool = True
    #: A retracted life may be resumed (:meth:`RuntimeAdapter.resume`).
    resumes: bool = True
    #: Conversations may return: a new life whose prompt extends an earlier life's tokens,
    #: its prefix restored by a load (``RuntimeAdapter.restore``, where the adapter has it).
    returns: bool = True
    #: Seconds a runtime call may block, or a completed copy stay listed, before
    #: ``stuck-copy``; ``None``: wait forever.
    stuck_after: float | None = 10.0
    #: The liveness bound: after the last input (every life finished, every copy the kit
    #: completed), the kit polls up to this many times, no new work, then requires every
    #: life released, every pin dropped, every pending key settled or expired and every
    #: host page free or held by the host tier, before it closes the runtime.
    liveness_polls: int = 3

    def __post_init__(self) -> None:
        if self.stuck_after is not None and not 0 < self.stuck_after < 3600:
            raise ConfigError(f"stuck_after must be in (0, 3600) s, got {self.stuck_after}")
        if not 1 <= self.liveness_polls <= 100:
            raise ConfigError(f"liveness_polls must be in [1, 100], got {self.liveness_polls}")

    @property
    def reasons(self) -> tuple[FinishReason, ...]:
        """The finish reasons the kit uses."""
        off = {FinishReason.ABORTED: not self.aborts, FinishReason.RETRACTED: not self.retractions}
        return tuple(r for r in FinishReason if not off.get(r))

    def as_dict(self) -> dict[str, Any]:
        """Plain dict, for JSON."""
        return dataclasses.asdict(self)


def progress_of(adapter: object) -> Progress:
    """The adapter's declared progress model (``progress`` attribute; default ``"poll"``)."""
    model = getattr(adapter, "progress", "poll")
    if model not in PROGRESS_MODELS:
        raise ConfigError(f"adapter.progress must be 'poll' or 'drain', got {model!r}")
    return model
