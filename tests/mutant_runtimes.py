"""Seeded buggy runtimes: each one bug class of DESIGN.md, behind the kit's adapter protocol.

Not part of kvlife's API. Each mutant is kvlife's OffloadManager with one small
patch that puts back a bug the real runtimes had; ``MUTANTS`` maps a name to an
adapter factory. The testing kit and the exhaustive checker must catch every one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from kvlife import FinishReason, State
from kvlife.engine.base import Ack
from kvlife.manager import ManagedLifecycle, OffloadManager, ReleaseHandler
from kvlife.store.base import Store
from kvlife.testing import ManagerAdapter


class RidKeyedProgress(OffloadManager):
    """State keyed by rid: a new life inherits the progress of an unreleased one with its rid.

    The hand-written runtime keeps ``progress[rid]`` and deletes it at release;
    a rid reused while the old life still drains continues the old chain.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._by_rid: dict[object, ManagedLifecycle] = {}

    def start(
        self,
        rid: object,
        prompt: Sequence[int],
        on_release: ReleaseHandler | None = None,
        *,
        prior_hash: str | None = None,
    ) -> ManagedLifecycle:
        lc = super().start(rid, prompt, on_release, prior_hash=prior_hash)
        old = self._by_rid.get(rid)
        if old is not None and old.state is not State.RELEASED:
            lc._pages_submitted = old._pages_submitted  # the bug: progress found by rid
            lc.next_page = old.next_page
            lc._tail = old.chain_tail
        self._by_rid[rid] = lc
        return lc


class EarlyRelease(OffloadManager):
    """Release while a copy is in flight: an abort or a retraction frees device pages at once."""

    def finish(self, lc: ManagedLifecycle, reason: FinishReason = FinishReason.FINISHED) -> None:
        handler = lc.release_handler
        if reason is not FinishReason.FINISHED and handler is not None:
            lc.release_handler = None  # released now, so not again at the last ack
            handler(lc, lc.device_pages)
        super().finish(lc, reason)


class DoubleHostFree(OffloadManager):
    """Host pages freed twice: a release-time cleanup frees what the pending store write frees."""

    def _on_release(self, lc: Any) -> None:
        pages = self.host.owned_by(lc)
        if pages:
            self.host.free(pages, owner=lc)  # the bug: the store result frees them again
        super()._on_release(lc)


class _AckOrderKeys:
    """A store front that rehashes each chunk from the chain head as acks arrive."""

    def __init__(self, inner: Store, manager: AckOrderChain) -> None:
        self.inner = inner
        self.manager = manager

    def put(self, token: object, keys: Sequence[str], pages: torch.Tensor) -> None:
        lc: ManagedLifecycle = token[0]  # type: ignore[index]
        tokens = self.manager.chunk_tokens[tuple(keys)]
        head = self.manager.head.get(lc, self.manager.prior[lc])
        rehashed = self.manager.hasher(tokens, self.manager.page_size, head)
        self.manager.head[lc] = rehashed[-1]  # the bug: the chain advances in ack order
        self.inner.put(token, rehashed, pages)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class AckOrderChain(OffloadManager):
    """Hash chain advanced in ack order: each acked chunk is keyed from the last acked chunk."""

    def __init__(self, engine: Any, host: Any, store: Store, **kwargs: Any) -> None:
        super().__init__(engine, host, store, **kwargs)
        self.store = _AckOrderKeys(store, self)
        self.chunk_tokens: dict[tuple[str, ...], list[int]] = {}
        self.head: dict[ManagedLifecycle, str | None] = {}
        self.prior: dict[ManagedLifecycle, str | None] = {}

    def start(self, *args: Any, **kwargs: Any) -> ManagedLifecycle:
        lc = super().start(*args, **kwargs)
        self.prior[lc] = lc.chain_tail
        return lc

    def offload(
        self, lc: ManagedLifecycle, tokens: Sequence[int], device_pages: Sequence[int]
    ) -> Any:
        ticket = super().offload(lc, tokens, device_pages)
        if ticket is not None:
            first = lc.prefill_len + ticket.first_page * self.page_size
            end = first + self.page_size * ticket.n_pages
            self.chunk_tokens[ticket.keys] = list(tokens[first:end])
        return ticket


class NewestByRid(OffloadManager):
    """A late ack applied to the newest life with the same rid (the ack is looked up by rid)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._newest: dict[object, ManagedLifecycle] = {}

    def start(self, rid: object, *args: Any, **kwargs: Any) -> ManagedLifecycle:
        lc = super().start(rid, *args, **kwargs)
        self._newest[rid] = lc
        return lc

    def _apply_ack(self, ack: Ack) -> None:
        newest = self._newest[ack.ticket.lifecycle.rid]
        if newest is not ack.ticket.lifecycle and newest.chunks_in_flight():
            ack = replace(ack, ticket=newest.chunks_in_flight()[0])  # the bug
        super()._apply_ack(ack)


def _adapter(manager: Callable[..., OffloadManager]) -> Callable[[], ManagerAdapter]:
    def factory() -> ManagerAdapter:
        return ManagerAdapter(manager_factory=manager)

    factory.__name__ = f"adapter_of_{manager.__name__}"
    return factory


#: Every seeded bug: name -> adapter factory.
MUTANTS: dict[str, Callable[[], ManagerAdapter]] = {
    "state-keyed-by-rid": _adapter(RidKeyedProgress),
    "release-in-flight": _adapter(EarlyRelease),
    "host-double-free": _adapter(DoubleHostFree),
    "ack-order-chain": _adapter(AckOrderChain),
    "late-ack-to-newest": _adapter(NewestByRid),
}
