"""Where an SGLang-style scheduler calls kvlife: a runnable sketch with a toy model.

The scheduler has the shape of a continuous-batching event loop (SGLang's
decode scheduler is the model): each iteration receives new requests and
aborts, admits waiting requests (prefill), retracts requests when device
pages run short, runs one decode step of the running batch, processes its
result, and checks offload progress. Comments tagged ``[sglang: ...]`` name
the scheduler concept each kvlife call belongs to. Everything runs on the
scheduler thread: kvlife takes no lock, and its acks are found by polling.
On a disaggregated decode server, admission receives the prompt's KV from the
prefill side instead of computing it; the kvlife calls stay the same.

Run: python examples/sglang_style_scheduler.py  (CPU only, a couple of seconds)
"""

from __future__ import annotations

import collections
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvlife import FinishReason, Ticket
from kvlife.engine import CpuCopyEngine
from kvlife.layout import LayerFirstLayout
from kvlife.manager import OffloadManager, OffloadRequest
from kvlife.pool import HostPagePool
from kvlife.store import LocalDirectoryStore

PAGE = 4  # tokens per page


class PageAllocator:
    """[sglang: the token-to-KV pool allocator, paged] device pages, handed out and taken back."""

    def __init__(self, layout: LayerFirstLayout) -> None:
        self.layout = layout
        self.free = list(range(layout.num_pages))

    def alloc(self) -> int | None:
        """One free device page, or ``None`` when the pool is out of pages."""
        return self.free.pop() if self.free else None

    def release(self, life: OffloadRequest, device_pages: Sequence[int]) -> None:
        """The release callback: kvlife calls it once, when no copy reads these pages any more."""
        for page in device_pages:  # poisoned, as if another request reused them at once
            self.layout.write_page(page, torch.full((self.layout.page_numel,), -1.0))
        self.free.extend(device_pages)


@dataclass
class Req:
    """[sglang: a scheduler request] ids, its device pages, and its current offload life."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # [sglang: its row of the req-to-token table]
    life: OffloadRequest | None = None  # a retraction ends a life; resuming starts a new one

    def ids(self) -> list[int]:
        """Prompt and outputs; the newest output has no KV yet."""
        return self.input_ids + self.output_ids


class Scheduler:
    """A toy continuous-batching scheduler with kvlife's calls where SGLang's would be."""

    def __init__(self, layout: LayerFirstLayout, manager: OffloadManager) -> None:
        self.layout, self.manager = layout, manager
        self.allocator = PageAllocator(layout)
        self.inbox: list[Req] = []  # [sglang: requests from the tokenizer side]
        self.abort_inbox: list[str] = []  # [sglang: abort requests, by rid]
        self.waiting: collections.deque[Req] = collections.deque()  # [sglang: waiting queue]
        self.running: list[Req] = []  # [sglang: the running (decode) batch]
        self.expected: dict[str, torch.Tensor] = {}  # page key -> device bytes at submit
        self.client_aborts: dict[int, list[str]] = {}  # iteration -> rids a client aborts
        self.iteration = 0
        self.lives: list[OffloadRequest] = []  # every life started, to report at the end
        self.reused = False

    # -- the toy model: KV of a token is a function of the token and its position
    def forward(self, req: Req, positions: range) -> bool:
        """Write KV for ``positions`` and sample the next token; False when out of pages."""
        ids = req.ids()
        for pos in positions:
            if pos // PAGE == len(req.pages):
                page = self.allocator.alloc()
                if page is None:
                    return False
                req.pages.append(page)
            slot = req.pages[pos // PAGE] * PAGE + pos % PAGE
            for layer in range(self.layout.num_layers):
                self.layout.k_buffers[layer][slot] = ids[pos] + pos / 1000 + layer
                self.layout.v_buffers[layer][slot] = -(ids[pos] + pos / 1000 + layer)
        req.output_ids.append((ids[-1] * 31 + len(ids)) % 1000)
        return True

    def offload(self, req: Req) -> None:
        """[sglang: the decode-side offload manager's per-request offload] after a forward pass."""
        assert req.life is not None
        ticket = self.manager.offload(req.life, req.ids(), req.pages)  # the chunk due, if any
        if ticket is not None:
            self.remember(req, ticket)

    def end(self, req: Req, reason: FinishReason) -> None:
        """Decoding of this life ended; kvlife hands its pages back when its copies drained."""
        assert req.life is not None
        # [sglang: where a finished, aborted or retracted request's KV would be freed] kvlife
        # frees nothing here: the release callback frees the pages once no copy reads them.
        self.manager.finish(req.life, reason)
        req.life = None

    def event_loop(self) -> None:
        """[sglang: the scheduler's event loop] until every request is done."""
        while self.inbox or self.waiting or self.running:
            busy = self.recv_requests()
            busy |= self.admit()  # [sglang: a prefill (extend) batch from the waiting queue]
            busy |= self.decode()  # [sglang: a decode batch, then its result processing]
            self.manager.poll()  # [sglang: check offload progress, every iteration]
            if not busy:
                time.sleep(0.001)  # waiting for copies to drain so pages come back
            self.iteration += 1

    def recv_requests(self) -> bool:
        """[sglang: receive requests] new ones join the waiting queue; aborts end a life."""
        self.waiting.extend(self.inbox)
        self.abort_inbox += self.client_aborts.pop(self.iteration, [])
        for rid in self.abort_inbox:  # [sglang: abort request]
            for req in [r for r in self.running if r.rid == rid]:
                self.running.remove(req)
                self.end(req, FinishReason.ABORTED)
            self.waiting = collections.deque(r for r in self.waiting if r.rid != rid)
        busy = bool(self.inbox or self.abort_inbox)
        self.inbox, self.abort_inbox = [], []
        return busy

    def admit(self) -> bool:
        """Prefill waiting requests while pages last; a retracted one resumes with a new life."""
        admitted = False
        while self.waiting and len(self.allocator.free) >= len(self.waiting[0].ids()) // PAGE + 2:
            req = self.waiting.popleft()
            req.pages = []
            # A new Lifecycle per life. Its chain continues from the prefix's whole pages, which
            # kvlife takes as stored already (the prefill side's job under disaggregation).
            req.life = self.manager.start(req.rid, req.ids(), self.allocator.release)
            self.lives.append(req.life)
            self.forward(req, range(len(req.ids())))  # prefill: KV of every id, one new token
            self.offload(req)  # gives the manager the page table (nothing is due yet)
            self.running.append(req)
            admitted = True
        return admitted

    def decode(self) -> bool:
        """One decode step of the running batch, then [sglang: process the decode result]."""
        for req in list(self.running):
            if not self.forward(req, range(len(req.ids()) - 1, len(req.ids()))):
                # [sglang: retract decode] out of device pages: back to the waiting queue,
                # first in line; its pages return through the release callback.
                self.running.remove(req)
                self.end(req, FinishReason.RETRACTED)
                self.waiting.appendleft(req)
                continue
            self.offload(req)  # [sglang: after each decode step, offload what is due]
            if len(req.output_ids) >= req.max_new_tokens:  # [sglang: check finished]
                self.running.remove(req)
                self.end(req, FinishReason.FINISHED)
                if req.rid == "r0" and not self.reused:  # a client reuses the rid at once
                    self.reused = True
                    self.inbox.append(Req("r0", list(range(200, 206)), 12))
        return bool(self.running)

    def remember(self, req: Req, ticket: Ticket) -> None:
        """Record the device bytes of a submitted chunk, to check the store at the end."""
        assert req.life is not None
        _, _, keys, first_page = ticket  # a Ticket is (lifecycle, seq, keys, first_page)
        first = req.life.prefill_len // PAGE + first_page
        for i, key in enumerate(keys):
            self.expected[key] = self.layout.read_page(req.pages[first + i]).clone()


def main() -> None:
    """Run five requests through a device pool too small for all of them; verify the store."""
    layout = LayerFirstLayout.zeros(2, 24, PAGE, num_heads=2, head_dim=8, dtype=torch.float32)
    host = HostPagePool(32, layout.page_numel, layout.dtype)
    engine = CpuCopyEngine(layout, host, copy_delay=0.003, delay_jitter=0.004, workers=2)
    with tempfile.TemporaryDirectory() as root:
        store = LocalDirectoryStore(root, "toy-model/rank0")
        manager = OffloadManager(engine, host, store, page_size=PAGE)
        sched = Scheduler(layout, manager)
        reqs = [Req(f"r{i}", [i * 10 + j for j in range(6 + i)], 24 + i) for i in range(5)]
        sched.inbox = list(reqs)
        sched.client_aborts = {5: ["r2"]}  # the client of r2 gives up mid-decode
        sched.event_loop()
        manager.close()  # [sglang: shutdown] drain every copy and store write
        engine.close()
        store.close()

        ended = [life.snapshot().finish_reason for life in sched.lives]
        reasons = collections.Counter(reason.name for reason in ended if reason is not None)
        print(f"{len(sched.lives)} lives of {len(reqs) + 1} requests ended: {dict(reasons)}")
        print(
            f"metrics: {manager.metrics().lifecycles_by_state}, "
            f"{len(sched.expected)} pages offloaded"
        )
        for key, page in sched.expected.items():
            stored = torch.frombuffer(bytearray(store.get(key) or b""), dtype=layout.dtype)
            if not torch.equal(stored, page):
                raise SystemExit(f"page {key[:12]} in the store differs from the device's")
        if len(sched.allocator.free) != layout.num_pages or host.num_used:
            raise SystemExit("a device or host page leaked")
        if set(reasons) != {"FINISHED", "ABORTED", "RETRACTED"}:
            raise SystemExit(f"the sketch should finish, abort and retract: {dict(reasons)}")
        print("every offloaded page is stored with the device's bytes; every page is back")


if __name__ == "__main__":
    main()
