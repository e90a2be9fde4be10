"""A rid-keyed offload manager: the bookkeeping kvlife replaces, kept to prove the checks can fail.

It does what hand-written runtimes do: per-request state in ``dict[rid, ...]``;
the next chunk's keys chained from ``state["last_hash"]`` when its ack comes;
a finished request released when its counter reaches zero. With reused rids and
late acks, the old request's ack lands on the new request's state. Not part of
kvlife's API: tests only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvlife import FinishReason, Lifecycle, Ticket
from kvlife.hashing import sglang_page_hashes

# The engine carries a Ticket; this manager ignores its Lifecycle and keys.
_NO_LIFECYCLE = Lifecycle("rid-keyed", page_size=1)


class RidKeyedManager:
    """Same calls as :class:`kvlife.manager.OffloadManager`; the handle is the rid."""

    def __init__(
        self, engine: Any, host: Any, store: Any, *, page_size: int, stride: int | None = None
    ) -> None:
        self.engine, self.host, self.store = engine, host, store
        self.page_size = page_size
        self.stride = (stride or page_size) // page_size * page_size
        self.reqs: dict[object, dict[str, Any]] = {}
        self.jobs: dict[int, tuple[object, Sequence[int], tuple[int, ...]]] = {}
        self.next_job = 0

    def start(
        self, rid: object, prompt: Sequence[int], on_release: Callable[..., object]
    ) -> object:
        prefill = len(prompt) // self.page_size * self.page_size
        prior = sglang_page_hashes(prompt[:prefill], self.page_size, None)[-1] if prefill else None
        # A reused rid overwrites whatever the previous request left here.
        self.reqs[rid] = {
            "prefill_len": prefill,
            "submitted": 0,
            "inflight": 0,
            "last_hash": prior,
            "finished": False,
            "pages": (),
            "on_release": on_release,
        }
        return rid

    def offload(self, rid: object, tokens: Sequence[int], device_pages: Sequence[int]) -> object:
        st = self.reqs.get(rid)
        if st is None:  # guarded, as such code is once it has crashed in production
            return None
        st["pages"] = device_pages
        if st["finished"]:
            return None
        start = st["prefill_len"] + st["submitted"]
        n = (len(tokens) - 1 - start) // self.stride * self.stride
        if n <= 0:
            return None
        first, end = start // self.page_size, (start + n) // self.page_size
        host_pages = self.host.alloc(end - first, owner=self)
        if host_pages is None:
            return None
        job = self.next_job
        self.next_job += 1
        ticket = Ticket(_NO_LIFECYCLE, job, first, ("0",) * (end - first))
        self.jobs[job] = (rid, list(tokens[start : start + n]), tuple(host_pages))
        st["submitted"] += n
        st["inflight"] += 1
        self.engine.submit(ticket, device_pages[first:end], host_pages)
        return job

    def finish(self, rid: object, reason: FinishReason = FinishReason.FINISHED) -> None:
        st = self.reqs.get(rid)
        if st is None:
            return
        st["finished"] = True
        if st["inflight"] == 0:
            self._release(rid)

    def poll(self) -> None:
        for ack in self.engine.poll():
            self._apply(ack)
        for result in self.store.poll():
            self.host.free(result.token, owner=self)

    def close(self, timeout: float | None = None) -> None:
        for ack in self.engine.drain(timeout):
            self._apply(ack)
        for result in self.store.drain(timeout):
            self.host.free(result.token, owner=self)

    def _apply(self, ack: Any) -> None:
        rid, tokens, host_pages = self.jobs.pop(ack.ticket.seq)
        st = self.reqs.get(rid)
        if st is None:  # the request was released and forgotten: drop the copy
            self.host.free(host_pages, owner=self)
            return
        keys = sglang_page_hashes(tokens, self.page_size, st["last_hash"])
        st["last_hash"] = keys[-1]
        st["inflight"] -= 1
        if ack.ok:
            rows = self.host.tensor[list(host_pages)]
            self.store.put(host_pages, keys, rows)
        else:
            self.host.free(host_pages, owner=self)
        if st["finished"] and st["inflight"] <= 0:
            self._release(rid)

    def _release(self, rid: object) -> None:
        st = self.reqs.pop(rid)
        st["on_release"](rid, st["pages"])
