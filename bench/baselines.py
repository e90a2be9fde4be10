"""Baselines the lifecycle bench races: rid-keyed dicts, and a per-request transitions machine.

:class:`DictLifecycleBaseline` is written the way serving engines keep this
bookkeeping today: one dict per field, keyed by rid (inflight counter, chain
tail, ``last_hash``, tokens submitted, finished flag, release callback). It
does the same work as :class:`kvlife.Lifecycle` on the happy path (hash each
chunk's pages, count, advance the hash chain, release once drained) and checks
nothing: a reused rid or a late ack corrupts it silently.

:class:`MachinePerRequest` is what a naive user of ``transitions`` writes: one
``Machine`` built per request, with the bookkeeping on the model.

Bench only; never import this from the library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transitions import Machine

from kvlife import TABLE, State
from kvlife.hashing import PageHasher, sglang_page_hashes

ReleaseCallback = Callable[[object], object]

#: A submitted chunk as the dict baseline hands it to the copy engine: (rid, its page keys).
DictJob = tuple[object, tuple[str, ...]]


class DictLifecycleBaseline:
    """Per-request offload bookkeeping in ``dict[rid, ...]``: fast, unchecked, reused-rid unsafe."""

    def __init__(self, *, page_size: int, hasher: PageHasher = sglang_page_hashes) -> None:
        self.page_size = page_size
        self.hasher = hasher
        self.inflight: dict[object, int] = {}
        self.tokens_submitted: dict[object, int] = {}
        self.chain_tail: dict[object, str | None] = {}
        self.last_hash: dict[object, str | None] = {}
        self.finished: dict[object, bool] = {}
        self.on_release: dict[object, ReleaseCallback | None] = {}

    def begin(
        self,
        rid: object,
        *,
        on_release: ReleaseCallback | None = None,
        prior_hash: str | None = None,
    ) -> None:
        """Start tracking ``rid`` (silently overwrites a live request with the same rid)."""
        self.inflight[rid] = 0
        self.tokens_submitted[rid] = 0
        self.chain_tail[rid] = prior_hash
        self.last_hash[rid] = prior_hash
        self.finished[rid] = False
        self.on_release[rid] = on_release

    def submit(self, rid: object, tokens: Sequence[int]) -> DictJob:
        """Hash the chunk's pages, count it in flight; return the job the copy engine carries."""
        keys = tuple(self.hasher(tokens, self.page_size, self.chain_tail[rid]))
        self.chain_tail[rid] = keys[-1]
        self.tokens_submitted[rid] += len(tokens)
        self.inflight[rid] += 1
        return (rid, keys)

    def ack(self, job: DictJob) -> None:
        """One copy completed: found by rid, so a stale ack moves whoever holds the rid now."""
        rid, keys = job
        self.last_hash[rid] = keys[-1]
        self.inflight[rid] -= 1
        if self.finished[rid] and self.inflight[rid] == 0:
            self._release(rid)

    def finish(self, rid: object) -> None:
        """Decoding ended; release now if nothing is in flight, else on the last ack."""
        self.finished[rid] = True
        if self.inflight[rid] == 0:
            self._release(rid)

    def _release(self, rid: object) -> None:
        callback = self.on_release[rid]
        del self.inflight[rid], self.tokens_submitted[rid], self.chain_tail[rid]
        del self.last_hash[rid], self.finished[rid], self.on_release[rid]
        if callback is not None:
            callback(rid)


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

    # guards, by the table's names
    def more_in_flight(self) -> bool:
        return self.inflight >= 2

    def last_in_flight(self) -> bool:
        return self.inflight == 1

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
