"""A real transformers model decodes through kvlife; a later turn restores its KV from the store.

A tiny Llama-style model (random weights, float32, CPU, nothing downloaded) keeps its KV in a
paged device pool; the loop calls the OffloadManager as a serving engine would. In turn 2
each conversation continues from its longest stored prefix, read back by page keys into fresh
device pages. Needs ``pip install 'kvlife[hf]'``. The checks (logits against a full recompute,
a prefill side, impostors, seeded bugs) are in tests/test_transformers_decode.py.
"""

# example-requires: transformers

from __future__ import annotations

import inspect
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model is built here
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import torch

from kvlife import FinishReason, Ticket
from kvlife.engine.cpu import CpuCopyEngine
from kvlife.hashing import page_hashes
from kvlife.layout import LayerFirstLayout
from kvlife.manager import OffloadManager, OffloadRequest
from kvlife.pool import HostPagePool
from kvlife.store.directory import LocalDirectoryStore

try:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except ImportError:  # pragma: no cover - the optional extra is missing
    sys.exit("this example needs transformers: pip install 'kvlife[hf]'")


def build_model(layers: int = 2, seed: int = 0) -> Any:
    """A Llama-style causal LM: 4 query heads, 2 KV heads (grouped query), head dim 64."""
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().eval()


@torch.no_grad()
def forward(model: Any, tokens: Sequence[int], start: int, cache: Any) -> torch.Tensor:
    """Logits of ``tokens`` at positions ``start...``; appends their KV to ``cache``."""
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=torch.tensor([list(tokens)]), use_cache=True, **{kw: cache},
                position_ids=torch.arange(start, start + len(tokens))[None])  # fmt: skip
    return out.logits[0]


def layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V ``[1, kv_heads, seq, head_dim]`` (transformers 4.x and 5.x)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new: int
    tokens: list[int] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)  # page i holds tokens [i*P, (i+1)*P)
    rid: str = ""
    record: OffloadRequest | None = None  # from manager.start; passed back at every call
    restored: int = 0  # leading pages read back from the store


class Runtime:
    """A continuous-batching decode loop; its paged device KV pool is the source of truth."""

    def __init__(self, model: Any, root: str, *, page_size: int = 8, stride: int = 16,
                 device_pages: int = 96, host_pages: int = 32, max_batch: int = 2,
                 seed: int = 0) -> None:  # fmt: skip
        cfg, self.model, self.page_size = model.config, model, page_size
        layout = self.layout = LayerFirstLayout.zeros(cfg.num_hidden_layers, device_pages,
            page_size, cfg.num_key_value_heads, cfg.head_dim, torch.float32)  # fmt: skip
        self.kv = list(zip(layout.k_buffers, layout.v_buffers, strict=True))  # [slot, heads, dim]
        self.free_pages = list(range(device_pages - 1, -1, -1))
        self.host = HostPagePool(host_pages, layout.page_numel, torch.float32, pin_memory=False)
        # Worker threads with jittered delays: acks arrive late and out of order.
        self.engine = CpuCopyEngine(layout, self.host, copy_delay=0.001, delay_jitter=0.004,
                                    seed=seed, workers=2)  # fmt: skip
        self.namespace = f"tiny-llama-s{seed}"  # seeds the key chain: no other model matches
        self.store = LocalDirectoryStore(root, self.namespace)
        self.manager = OffloadManager(self.engine, self.host, self.store, page_size=page_size,
                                      stride=stride, namespace=self.namespace)  # fmt: skip
        self.free_rids = [f"rid-{i}" for i in range(max_batch)]  # few: reused at once
        self.steps = 0

    def admit(self, req: Request) -> None:
        """Restore the longest stored prefix by page keys, prefill the rest, start the life."""
        p, prompt = self.page_size, req.prompt
        req.rid, req.tokens = self.free_rids.pop(), list(prompt)
        n = -(-(len(prompt) + req.max_new) // p)
        req.page_table = [self.free_pages.pop() for _ in range(n)]
        keys = page_hashes(prompt[: len(prompt) // p * p], p, namespace=self.namespace)
        rows = self.read_prefix(keys[: (len(prompt) - 1) // p])  # the last token is computed
        req.restored = len(rows)
        if rows.numel():
            self.layout.scatter(self.layout.page_index(req.page_table[: len(rows)]), rows)
        self.compute(req, len(rows) * p)  # RoPE: the rest runs at positions len(rows) * p...
        req.record = self.manager.start(req.rid, prompt, lambda _, pages: self.release(req, pages))

    def read_prefix(self, keys: Sequence[str]) -> torch.Tensor:
        """The stored pages of the longest leading run of ``keys`` (the chain stops at a miss)."""
        rows = []
        for key in keys:
            data = self.store.get(key)  # verified whole, or None
            if data is None or len(data) != self.layout.page_nbytes:
                break
            rows.append(torch.frombuffer(bytearray(data), dtype=torch.float32))
        return torch.stack(rows) if rows else torch.empty(0, self.layout.page_numel)

    def compute(self, req: Request, start: int) -> torch.Tensor:
        """Run ``tokens[start:]`` over the earlier tokens' KV read from the device pages, write
        their K and V back, append the next token (greedy); return the logits that chose it."""
        p, cache = self.page_size, DynamicCache()
        slots = torch.tensor([req.page_table[i // p] * p + i % p for i in range(len(req.tokens))])
        old, new = slots[:start], slots[start:]
        for layer, (k, v) in enumerate(self.kv if start else []):  # to the model's layout
            cache.update(k[old].transpose(0, 1)[None], v[old].transpose(0, 1)[None], layer)
        logits = forward(self.model, req.tokens[start:], start, cache)[-1]
        for layer, (k, v) in enumerate(self.kv):
            keys, values = layer_kv(cache, layer)
            k[new] = keys[0, :, start:].transpose(0, 1)
            v[new] = values[0, :, start:].transpose(0, 1)
        req.tokens.append(int(logits.argmax()))
        return logits

    def offload(self, req: Request) -> Ticket | None:
        assert req.record is not None  # submits the chunk the stride makes due, if any
        return self.manager.offload(req.record, req.tokens, req.page_table)

    def release(self, req: Request, device_pages: Sequence[int]) -> None:
        """The manager calls this once a life is finished and no copy reads its pages."""
        self.free_pages.extend(reversed(device_pages))

    def admissible(self, req: Request) -> bool:
        return len(self.free_pages) >= -(-(len(req.prompt) + req.max_new) // self.page_size)

    def run(self, requests: Sequence[Request]) -> None:
        """The scheduler loop: admit, decode, offload, poll, finish."""
        waiting, running = list(requests), list[Request]()
        while waiting or running:
            admitted: list[Request] = []
            for req in list(waiting):
                if self.free_rids and self.admissible(req):
                    waiting.remove(req)
                    self.admit(req)
                    admitted.append(req)
            for req in running:
                self.compute(req, len(req.tokens) - 1)  # decode one token
            running += admitted
            for req in running:
                self.offload(req)
            self.manager.poll()  # acks -> store writes; store results -> host pages freed
            for req in [r for r in running if len(r.tokens) - len(r.prompt) >= r.max_new]:
                assert req.record is not None
                running.remove(req)
                self.manager.finish(req.record, FinishReason.FINISHED)  # pages stay held
                self.free_rids.insert(0, req.rid)  # reused while the old life may still offload
            if admitted or running:
                self.steps += 1
            else:
                time.sleep(0.001)  # device pages come back at release, once copies complete

    def close(self) -> None:
        self.manager.close()  # every copy and store write done
        self.engine.close()
        self.store.close()


def main() -> int:
    """Three conversations, two turns: the second restores what kvlife stored in the first."""
    torch.set_num_threads(2)
    model, rng = build_model(), random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kvlife-hf-") as root:
        rt = Runtime(model, root)
        try:
            first = [Request(rng.sample(range(512), 5), n) for n in (30, 45, 60)]
            rt.run(first)
            rt.manager.close()  # drain: every copy and store write of turn 1 done
            m = rt.manager.metrics()
            later = [Request([*r.tokens, *rng.sample(range(512), 5)], 8) for r in first]
            rt.run(later)
        finally:
            rt.close()
    # Greedy outputs against one pass over each whole sequence, with no cache and no offload.
    same = all(
        forward(model, r.tokens[:-1], 0, DynamicCache())[len(r.prompt) - 1 :].argmax(-1).tolist()
        == r.tokens[len(r.prompt) :]
        for r in later
    )
    print(f"turn 1: 3 conversations on 2 rids; kvlife offloaded {m.pages_offloaded} decode pages"
          f" in {m.chunks_submitted} chunks, {m.pages_stored} stored")  # fmt: skip
    prefilled = [len(r.prompt) - r.restored * rt.page_size for r in later]
    print(f"turn 2: the follow-ups restored {[r.restored for r in later]} pages from the store "
          f"and prefilled {prefilled} tokens")  # fmt: skip
    print(f"device pages all free: {len(rt.free_pages) == 96}; host pages in use: "
          f"{rt.host.num_used}; greedy outputs equal a full recompute: {same}")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
