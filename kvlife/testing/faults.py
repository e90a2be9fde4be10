"""Stores whose puts fail on purpose: kvlife's stores with fault injection, for tests and
the simulator (``kvlife simulate --store-fail-rate``).

:class:`FaultyMemoryStore`, :class:`FaultyDirectoryStore` and :class:`FaultyMooncakeStore`
are the product stores plus ``fail_rate=``/``seed=``, a settable ``fail_rate`` and
``fail_next(n)``. A failing put fails part way: at one of the store's internal steps
(its ``_step`` hook: before writing or linking a page, before the commit, ...), so every
rollback path runs, with a :class:`~kvlife.errors.StoreError` saying "injected".

Theory of operation: ``put`` decides on the caller's thread, under a lock, whether the put
fails, and with it draws a fraction that picks the step; the decision joins a FIFO the
writer thread takes from as it starts each put (one writer, puts in order, so the n-th
decision is the n-th put's). Deciding at ``put`` keeps ``fail_next`` and a changed
``fail_rate`` to the puts accepted after the call, whatever the writer is still doing; a
refused put (InvalidPut, StoreClosed) takes its decision back, so it draws nothing. Same
seed, same puts: the same puts fail at the same steps.
"""

from __future__ import annotations

import abc
import random
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from kvlife.errors import ConfigError, StoreError
from kvlife.store.base import Payload, QueuedStore, Written
from kvlife.store.directory import LocalDirectoryStore
from kvlife.store.memory import MemoryStore
from kvlife.store.mooncake import MooncakeStore

__all__ = [
    "FaultyDirectoryStore",
    "FaultyMemoryStore",
    "FaultyMooncakeStore",
    "FaultyStore",
    "check_rate",
]


def check_rate(rate: object) -> float:
    """``rate`` as a float if it is a probability (in [0, 1], not NaN), else ConfigError."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise ConfigError(f"fail_rate must be in [0, 1], got {rate!r}")
    return float(rate)


class FaultyStore(QueuedStore):
    """Fault injection over a :class:`~kvlife.store.base.QueuedStore`; list it before the
    store class (``class FaultyX(FaultyStore, X)``) and say how many steps a put has."""

    def __init__(self, *args: Any, fail_rate: float = 0.0, seed: int = 0, **kwargs: Any) -> None:
        self._fault_rate = check_rate(fail_rate)
        self._fault_rng = random.Random(seed)
        self._fault_next = 0
        self._fault_lock = threading.Lock()
        # One entry per accepted put the writer has not started: None, or the fraction
        # that picks its failing step.
        self._fault_plans: deque[float | None] = deque()
        self._fault_at: int | None = None  # the failing step of the put being written
        self._fault_pages = 0
        super().__init__(*args, **kwargs)  # starts the writer thread

    @abc.abstractmethod
    def _fault_steps(self, n_pages: int) -> int:
        """How many internal steps (``_step`` calls) one put of ``n_pages`` has."""

    @property
    def fail_rate(self) -> float:
        """Probability that an accepted put fails."""
        return self._fault_rate

    @fail_rate.setter
    def fail_rate(self, rate: float) -> None:
        checked = check_rate(rate)
        with self._fault_lock:
            self._fault_rate = checked

    def fail_next(self, n: int = 1) -> None:
        """Make the next ``n`` accepted puts fail."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"fail_next needs a count >= 0, got {n!r}")
        with self._fault_lock:
            self._fault_next += n

    def put(
        self,
        token: object,
        keys: Sequence[str],
        pages: torch.Tensor | Sequence[torch.Tensor],
        *,
        keep_first: bool = False,
    ) -> None:
        """The store's ``put``; an accepted put fails if ``fail_next`` or ``fail_rate`` says so."""
        with self._fault_lock:
            saved = self._fault_rng.getstate(), self._fault_next
            self._fault_plans.append(self._draw())
            try:
                super().put(token, keys, pages, keep_first=keep_first)
            except BaseException:  # refused: as if this put had never drawn
                self._fault_plans.pop()  # the last: the writer takes only queued puts'
                self._fault_rng.setstate(saved[0])
                self._fault_next = saved[1]
                raise

    def _draw(self) -> float | None:
        if self._fault_next > 0:
            self._fault_next -= 1
        elif not (self._fault_rate > 0.0 and self._fault_rng.random() < self._fault_rate):
            return None
        return self._fault_rng.random()

    def _store_pages(
        self,
        keys: tuple[str, ...],
        pages: Sequence[Payload],
        kept: list[str] | None = None,
    ) -> Written:
        fraction = self._fault_plans.popleft()
        n = len(keys)
        self._fault_at = None if fraction is None else int(fraction * self._fault_steps(n))
        self._fault_pages = n
        try:
            return super()._store_pages(keys, pages, kept)  # type: ignore[safe-super]
        finally:
            self._fault_at = None

    def _step(self, i: int, what: str) -> None:
        if i == self._fault_at:
            raise StoreError(f"injected failure {what} ({self._fault_pages} pages)")
        super()._step(i, what)


class FaultyMemoryStore(FaultyStore, MemoryStore):
    """:class:`~kvlife.store.MemoryStore` with fault injection."""

    def _fault_steps(self, n_pages: int) -> int:
        return n_pages + 1  # before framing each page, and before the commit


class FaultyDirectoryStore(FaultyStore, LocalDirectoryStore):
    """:class:`~kvlife.store.LocalDirectoryStore` with fault injection."""

    def _fault_steps(self, n_pages: int) -> int:
        return 2 * n_pages  # before writing each page's temporary file, and before each link


class FaultyMooncakeStore(FaultyStore, MooncakeStore):
    """:class:`~kvlife.store.mooncake.MooncakeStore` with fault injection."""

    def _fault_steps(self, n_pages: int) -> int:
        return 3  # before looking for stored pages, before writing, after writing
