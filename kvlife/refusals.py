"""One refusal policy for the core and every integration: count, log once per kind, or raise.

A refusal is an event kvlife will not apply (a completion of a key with nothing
in flight, a call for a request it never saw, a bad argument from a host
runtime). It has changed nothing when it reaches :meth:`Refusals.refuse`. Inside
a host runtime kvlife never crashes the host by default: the refusal is counted
under its kind and logged the first time that kind occurs. ``strict`` (for
tests, and for callers whose contract is a typed error, such as
:class:`~kvlife.OffloadManager`) raises the refusal's typed error instead.

The counts are plain ints and a dict that only the owning thread writes; a
scrape from another thread reads :meth:`Refusals.snapshot`, a copy made in one C
call (never iterating a dict that is being mutated).
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
        self._by_kind[kind] += 1
        self.total += 1
        if self.strict:
            raise error
        if self._by_kind[kind] == 1:
            self.logger.warning(
                "kvlife: %s refused (%s); counted, logged once per kind", kind, error
            )

    def note(self, kind: str, message: str) -> None:
        """Count a failure the host recovers from (a copy made again, a job reported failed,
        a write lost): logged the first time its kind occurs, never raised, strict or not."""
        self._by_kind[kind] += 1
        self.total += 1
        if self._by_kind[kind] == 1:
            self.logger.warning("kvlife: %s (%s); counted, logged once per kind", kind, message)

    def counted(self, error: E) -> E:
        """Count ``error`` under its type's name and hand it back for the caller to raise (a
        refusal whose contract is a typed error to the caller, as the manager's calls)."""
        self._by_kind[type(error).__name__] += 1
        self.total += 1
        return error

    def count(self, kind: str) -> int:
        """How many refusals of ``kind`` were counted."""
        return self._by_kind[kind]

    def snapshot(self) -> dict[str, int]:
        """Kind -> count, copied (safe to call from a scraping thread)."""
        return dict(self._by_kind)
