"""The kit's events: one step of a run, as data; :meth:`kvlife.testing.Oracle.apply` runs
one and checks every rule after it. Lives are numbered in start order."""

from __future__ import annotations

from dataclasses import dataclass

from kvlife._lifecycle import FinishReason

__all__ = ["Close", "Complete", "Finish", "KitEvent", "Poll", "Resume", "Return", "Start", "Step"]


@dataclass(frozen=True)
class Start:
    """Start a new life with ``rid`` and ``prompt``."""

    rid: str
    prompt: tuple[int, ...]

    def __str__(self) -> str:
        return f"start rid={self.rid} prompt={len(self.prompt)} tokens"


@dataclass(frozen=True)
class Step:
    """Decode ``tokens`` for life number ``life``."""

    life: int
    tokens: tuple[int, ...]

    def __str__(self) -> str:
        return f"step life {self.life} +{len(self.tokens)} tokens"


@dataclass(frozen=True)
class Finish:
    """End life ``life`` with ``reason``."""

    life: int
    reason: FinishReason

    def __str__(self) -> str:
        return f"finish life {self.life} {self.reason.value}"


@dataclass(frozen=True)
class Resume:
    """Resume retracted life ``life`` as a new life: same rid, its tokens as the prompt."""

    life: int

    def __str__(self) -> str:
        return f"resume life {self.life}"


@dataclass(frozen=True)
class Return:
    """A conversation returns: a new life on life ``life``'s rid whose prompt is that life's
    tokens and one page more, and the runtime restores what it can of that prefix (a load)."""

    life: int

    def __str__(self) -> str:
        return f"return life {self.life} (a new life, its tokens as the prompt, restored)"


@dataclass(frozen=True)
class Complete:
    """Complete the ``chunk``-th copy life ``life`` submitted (``ok`` or failed), then poll."""

    life: int
    chunk: int
    ok: bool = True
    poll: bool = True

    def __str__(self) -> str:
        then = ", poll" if self.poll else ""
        return f"complete life {self.life} chunk {self.chunk} {'ok' if self.ok else 'FAIL'}{then}"


@dataclass(frozen=True)
class _Bare:
    def __str__(self) -> str:
        return type(self).__name__.lower()


@dataclass(frozen=True)
class Poll(_Bare):
    """One scheduler poll."""


@dataclass(frozen=True)
class Close(_Bare):
    """The end of a run: finish every running life, complete every copy, poll, close, check."""


#: One event of a run.
KitEvent = Start | Step | Finish | Resume | Return | Complete | Poll | Close
