"""A hand-written, rid-keyed offload manager: the baseline ``bench/manager.py`` races.

Written the way serving engines keep this bookkeeping today: per-request state
in a dict keyed by rid, in-flight copies in a dict keyed by a job id. It does
the same work as kvlife's manager (stride policy, page hashing, host
allocation, store hand-off, release) but checks nothing: a reused rid or a late
ack corrupts it silently. Bench only; never import it from the library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvlife.hashing import sglang_page_hashes


class DictOffloadManager:
    """Per-request offload state in ``dict[rid, dict]``; acks found by job id, then by rid."""

    def __init__(self, engine: Any, host: Any, store: Any, *, page_size: int) -> None:
        self.engine, self.host, self.store = engine, host, store
        self.page_size = page_size
        self.stride = page_size
        self.reqs: dict[object, dict[str, Any]] = {}
        self.jobs: dict[int, tuple[object, tuple[int, ...], tuple[str, ...]]] = {}
        self.next_job = 0

    def start(self, rid: object, prompt: Sequence[int], on_release: Callable[..., object]) -> None:
        prefill = len(prompt) // self.page_size * self.page_size
        tail = sglang_page_hashes(prompt[:prefill], self.page_size, None)[-1] if prefill else None
        self.reqs[rid] = {
            "prefill_len": prefill,
            "submitted": 0,
            "inflight": 0,
            "tail": tail,
            "last_hash": tail,
            "finished": False,
            "pages": (),
            "on_release": on_release,
        }

    def offload(self, rid: object, tokens: Sequence[int], device_pages: Sequence[int]) -> object:
        st = self.reqs[rid]
        st["pages"] = device_pages
        if st["finished"]:
            return None
        start = st["prefill_len"] + st["submitted"]
        n = (len(tokens) - 1 - start) // self.stride * self.stride
        if n <= 0:
            return None
        first, end = start // self.page_size, (start + n) // self.page_size
        job = self.next_job
        host_pages = self.host.alloc(end - first, owner=st)
        if host_pages is None:
            return None
        self.next_job += 1
        keys = tuple(sglang_page_hashes(tokens[start : start + n], self.page_size, st["tail"]))
        st["tail"] = keys[-1]
        st["submitted"] += n
        st["inflight"] += 1
        self.jobs[job] = (rid, tuple(host_pages), keys)
        self.engine.submit(job, device_pages[first:end], host_pages)
        return job

    def finish(self, rid: object) -> None:
        st = self.reqs[rid]
        st["finished"] = True
        if st["inflight"] == 0:
            self._release(rid)

    def poll(self) -> None:
        for ack in self.engine.poll():
            job = ack.ticket
            rid, host_pages, keys = self.jobs.pop(job)
            st = self.reqs[rid]
            st["inflight"] -= 1
            st["last_hash"] = keys[-1]
            first = host_pages[0]
            rows = self.host.tensor[first : first + len(host_pages)]
            self.store.put((st, host_pages), keys, rows)
            if st["finished"] and st["inflight"] == 0:
                self._release(rid)
        for result in self.store.poll():
            owner, host_pages = result.token
            self.host.free(host_pages, owner=owner)

    def _release(self, rid: object) -> None:
        st = self.reqs.pop(rid)
        st["on_release"](rid, st["pages"])
