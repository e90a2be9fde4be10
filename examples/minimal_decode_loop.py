"""A minimal decode loop that embeds kvlife: offload while decoding, back up, release once.

Run: python examples/minimal_decode_loop.py  (CPU only, about a second)
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlife import State
from kvlife.engine import CpuCopyEngine
from kvlife.layout import LayerFirstLayout
from kvlife.manager import OffloadManager, OffloadRequest
from kvlife.pool import HostPagePool
from kvlife.store import LocalDirectoryStore

# --8<-- [start:setup]
PAGE = 4  # tokens per page
# The device KV pool (on CPU here): per layer one K and one V buffer, 32 pages of 4 slots.
layout = LayerFirstLayout.zeros(2, 32, PAGE, num_heads=2, head_dim=8, dtype=torch.float32)
free_pages = list(range(layout.num_pages))  # the runtime's own device page allocator
host = HostPagePool(16, layout.page_numel, layout.dtype)  # host pages the copies land in
engine = CpuCopyEngine(layout, host, copy_delay=0.002)  # a real worker thread: asynchronous
root = tempfile.TemporaryDirectory()
store = LocalDirectoryStore(root.name, "toy-model/rank0")  # one file per page, atomic writes
manager = OffloadManager(engine, host, store, page_size=PAGE)  # stride: one page
# --8<-- [end:setup]


@dataclass
class Request:
    """What the runtime keeps per request; the Lifecycle rides along, the rid is a label."""

    rid: str
    tokens: list[int]
    max_len: int
    pages: list[int]
    life: OffloadRequest


# --8<-- [start:release]
def release(life: OffloadRequest, device_pages: Sequence[int]) -> None:
    """Called once, when nothing is in flight: the device pages are the runtime's again."""
    for page in device_pages:  # poisoned, as if another request reused them at once
        layout.write_page(page, torch.full((layout.page_numel,), -1.0))
    free_pages.extend(device_pages)


# --8<-- [end:release]


def check(ok: bool, why: str) -> None:
    """Exit non-zero when kvlife misbehaved (not an assert: it must survive python -O)."""
    if not ok:
        raise SystemExit(why)


def write_kv(req: Request, pos: int) -> None:
    """The toy model: the KV of token ``pos`` is a function of the token and its position."""
    if pos // PAGE == len(req.pages):  # this token starts a new page
        req.pages.append(free_pages.pop())
    slot = req.pages[pos // PAGE] * PAGE + pos % PAGE
    for layer in range(layout.num_layers):
        layout.k_buffers[layer][slot] = req.tokens[pos] + pos / 1000 + layer
        layout.v_buffers[layer][slot] = -(req.tokens[pos] + pos / 1000 + layer)


def admit(rid: str, prompt: list[int], max_len: int) -> Request:
    """Prefill: KV for every prompt token, sample the first output, start a new life."""
    req = Request(rid, list(prompt), max_len, [], manager.start(rid, prompt, release))
    for pos in range(len(prompt)):
        write_kv(req, pos)
    req.tokens.append(len(req.tokens) * 7 % 100)  # the first output token (no KV yet)
    return req


expected: dict[str, torch.Tensor] = {}  # page key -> the device bytes at submit
running = [admit("req-1", list(range(6)), max_len=13), admit("req-2", [9] * 9, max_len=24)]
gate, old = None, None  # req-1's held last copy, and its first life
# --8<-- [start:loop]
while running:
    for req in list(running):
        write_kv(req, len(req.tokens) - 1)  # decode step: KV of the newest token...
        req.tokens.append(len(req.tokens) * 7 % 100)  # ...and a new token without KV
        done = len(req.tokens) >= req.max_len
        if done and req.rid == "req-1" and old is None:
            gate = engine.hold_next()  # keep req-1's last copy in flight for a while
        ticket = manager.offload(req.life, req.tokens, req.pages)  # the chunk due, if any
        if ticket is not None:
            _, _, keys, first_page = ticket  # a Ticket is (lifecycle, seq, keys, first_page)
            first = req.life.prefill_len // PAGE + first_page
            for i, key in enumerate(keys):
                expected[key] = layout.read_page(req.pages[first + i]).clone()
        if done:
            manager.finish(req.life)  # release now, or at the last ack
            running.remove(req)
            if old is None and req.rid == "req-1":
                old = req.life  # the same rid comes back while the old copy flies
                running.append(admit("req-1", list(range(50, 57)), max_len=16))
    manager.poll()  # apply acks, hand host pages to the store, free stored host pages
    # --8<-- [end:loop]
    if old is not None and gate is not None and not gate.is_open:
        print(f"rid req-1 reused while its old life is {old.state.name}, {old.inflight} in flight")
        check(old.state is State.FINISHED, "the old life was released before its last ack")
        gate.open()
manager.close()  # drain every copy and every store write
engine.close()
store.close()

stored, m = sorted(store.keys()), manager.metrics()
print(f"{len(stored)} pages stored from {m.chunks_acked} chunks; {m.lifecycles_by_state}")
check(set(stored) == set(expected), "a submitted page is missing from the store")
for key in stored:
    page = torch.frombuffer(bytearray(store.get(key) or b""), dtype=layout.dtype)
    check(torch.equal(page, expected[key]), f"page {key[:12]} differs from the device's")
check(len(free_pages) == layout.num_pages and host.num_used == 0, "a page leaked")  # all released
root.cleanup()
print("every stored page has the bytes the device had; every page is back")
