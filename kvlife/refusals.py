"""One refusal policy for the core and every integration: count, log once per kind, or raise
(``docs/design.md``, rule 6). A refusal has changed nothing when it reaches
:meth:`Refusals.refuse`. Only the owning thread counts; a scrape from another thread reads
:meth:`Refusals.snapshot`, a copy made in one C call.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TypeVar

from kvlife.errors import KVLifeError

E = TypeVar("E", bound=BaseException)

__all__ = ["Refusals"]

_log = logging.getLogger("kvlife")


class Refusals:
    """Counted, logged-once-per-kind refusals; ``strict`` raises them instead."""

    __slots__ = ("_by_kind", "logger", "strict", "total")

    def __init__(self, *, strict: bool = False, logger: logging.Logger | None = None) -> None:
        self.strict = bool(strict)
        self.logger = logger or _log
        self._by_kind: Counter[str] = Counter()
        #: Every refusal counted so far (strict ones included).
        self.total = 0

    def refuse(self, kind: str, error: KVLifeError) -> None:
        """Count ``error`` under ``kind``; raise it when strict, else log the kind's first."""
        first = self._add(kind)
        if self.strict:
            raise error
        if first:
            self.logger.warning(
                "kvlife: %s refused (%s); counted, logged once per kind", kind, error
            )

    def note(self, kind: str, message: str) -> None:
        """Count a failure the host recovers from (a copy made again, a job reported failed,
        a write lost): logged the first time its kind occurs, never raised, strict or not."""
        if self._add(kind):
            self.logger.warning("kvlife: %s (%s); counted, logged once per kind", kind, message)

    def counted(self, error: E) -> E:
        """Count ``error`` under its type's name and hand it back for the caller to raise (a
        refusal whose contract is a typed error to the caller, as the manager's calls)."""
        self._add(type(error).__name__)
        return error

    def count(self, kind: str) -> int:
        """How many refusals of ``kind`` were counted."""
        return self._by_kind[kind]

    def snapshot(self) -> dict[str, int]:
        """Kind -> count, copied (safe to call from a scraping thread)."""
        return dict(self._by_kind)

    def _add(self, kind: str) -> bool:
        """Count one refusal of ``kind``; whether it is the kind's first."""
        self._by_kind[kind] += 1
        self.total += 1
        return self._by_kind[kind] == 1
