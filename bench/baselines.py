"""The per-request ``transitions`` machine the lifecycle bench races.

:class:`MachinePerRequest` is what a naive user of ``transitions`` writes: one
``Machine`` built per request, with the bookkeeping on the model. (The bench's
rid-keyed dict baseline is the one straw man, ``tests/rid_keyed_manager.py``.)

Bench only; never import this from the library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transitions import Machine

from kvlife import TABLE, State
from kvlife.hashing import PageHasher, sglang_page_hashes

ReleaseCallback = Callable[[object], object]


def _machine_transitions() -> list[dict[str, Any]]:
    return [
        {
            "trigger": row.event.value,
            "source": row.source.name,
            "dest": row.dest.name,
            "conditions": [row.guard] if row.guard else [],
        }
        for row in TABLE
    ]


_TRANSITIONS = _machine_transitions()
_STATES = [state.name for state in State]


class MachinePerRequest:
    """One request's offload with its own ``transitions.Machine``, built in ``__init__``."""

    state: str
    trigger: Callable[[str], bool]  # bound per instance by the machine

    def __init__(
        self,
        rid: object,
        *,
        page_size: int,
        on_release: ReleaseCallback | None = None,
        prior_hash: str | None = None,
        hasher: PageHasher = sglang_page_hashes,
    ) -> None:
        self.rid = rid
        self.page_size = page_size
        self.hasher = hasher
        self.on_release = on_release
        self.inflight = 0
        self.tokens_submitted = 0
        self.chain_tail = prior_hash
        self.last_hash = prior_hash
        self.machine = Machine(
            model=self,
            states=_STATES,
            transitions=_TRANSITIONS,
            initial="IDLE",
            auto_transitions=False,
        )

    # guards, by the table's names (this baseline has stores only: no load in flight)
    def more_stores(self) -> bool:
        return self.inflight >= 2

    def last_store(self) -> bool:
        return self.inflight == 1

    def last_store_loads_left(self) -> bool:
        return False

    def stores_in_flight(self) -> bool:
        return self.inflight >= 1

    def more_loads(self) -> bool:
        return False

    def last_load(self) -> bool:
        return False

    def loads_in_flight(self) -> bool:
        return False

    def drained(self) -> bool:
        return self.inflight == 0

    def offload(self, tokens: Sequence[int]) -> tuple[str, ...]:
        """Hash the chunk, fire ``submit``, count it; return the keys the copy carries."""
        keys = tuple(self.hasher(tokens, self.page_size, self.chain_tail))
        self.trigger("submit")
        self.chain_tail = keys[-1]
        self.tokens_submitted += len(tokens)
        self.inflight += 1
        return keys

    def complete(self, keys: tuple[str, ...]) -> None:
        """One copy completed: fire ``ack``, then ``release`` if it drained a finished request."""
        self.trigger("ack")
        self.inflight -= 1
        self.last_hash = keys[-1]
        if self.state == "FINISHED" and self.inflight == 0:
            self._release()

    def end(self) -> None:
        """Fire ``finish``; release at once when nothing is in flight."""
        self.trigger("finish")
        if self.inflight == 0:
            self._release()

    def _release(self) -> None:
        self.trigger("release")
        if self.on_release is not None:
            self.on_release(self)


class UncheckedPerRequest:
    """One object per request with kvlife's bookkeeping and none of its checks.

    The same work as :class:`kvlife.Lifecycle` on the happy path (hash the chunk,
    keep it in seq order until its ack, move ``last_hash``, release once when a
    finished request drains), but no argument checks and no table; its ticket is
    a plain tuple, like kvlife's. It prices the per-request object against the
    rid-keyed dicts, and so shows what kvlife's checks cost on top.
    """

    __slots__ = ("chain_tail", "chunks", "finished", "hasher", "inflight", "last_hash",
                 "on_release", "page_size", "rid", "tokens_submitted")  # fmt: skip

    def __init__(
        self,
        rid: object,
        *,
        page_size: int,
        on_release: ReleaseCallback | None = None,
        prior_hash: str | None = None,
        hasher: PageHasher = sglang_page_hashes,
    ) -> None:
        self.rid, self.page_size, self.on_release, self.hasher = rid, page_size, on_release, hasher
        self.chain_tail = self.last_hash = prior_hash
        self.chunks: list[tuple[UncheckedPerRequest, tuple[str, ...]]] = []
        self.inflight = self.tokens_submitted = 0
        self.finished = False

    def submit(self, tokens: Sequence[int]) -> tuple[UncheckedPerRequest, tuple[str, ...]]:
        keys = tuple(self.hasher(tokens, self.page_size, self.chain_tail))
        ticket = (self, keys)
        self.chunks.append(ticket)
        self.chain_tail = keys[-1]
        self.tokens_submitted += len(tokens)
        self.inflight += 1
        return ticket

    def ack(self, ticket: tuple[UncheckedPerRequest, tuple[str, ...]]) -> None:
        del self.chunks[0]  # acked in order: the head
        self.last_hash = ticket[1][-1]
        self.inflight -= 1
        if self.finished and not self.inflight:
            self._release()

    def finish(self) -> None:
        self.finished = True
        if not self.inflight:
            self._release()

    def _release(self) -> None:
        callback, self.on_release = self.on_release, None
        if callback is not None:
            callback(self)
