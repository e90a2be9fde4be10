"""A real transformers decoder runs through kvlife; KV restored from the store gives equal logits.

A Llama-style causal LM (random weights under a fixed seed, float32, grouped-query
heads, nothing downloaded) decodes requests token by token with continuous
batching: requests join and leave between steps and take their rids from a
small pool. The paged device KV pool (a :class:`~kvlife.layout.LayerFirstLayout`
on the CPU) is the source of truth: each forward pass builds its past KV from
the request's device pages and writes the new K and V back into them. After each
step the runtime calls the :class:`~kvlife.manager.OffloadManager` exactly as a
serving engine would (offload what is due, poll, finish, free device pages in
the release callback), and a prefill side stores each prompt's whole pages under
the same hash-chain keys.

Later requests continue an earlier conversation (prompt = earlier prompt and
output plus new tokens): they find their longest stored prefix by page keys,
read those pages from the local-directory store into fresh device pages, and
decode the rest. Every request's logits are compared with one forward pass over
its whole sequence that never saw a cache; every restored and every stored page
is compared with the KV of that pass. Impostors (the same tokens but a different
first page) must restore nothing.

Run: python examples/transformers_decode.py [--json]
(needs the ``hf`` extra: ``pip install 'kvlife[hf]'``; CPU only, about 5 s after import)
"""

# example-requires: transformers

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model is built here
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from kvlife import FinishReason
from kvlife.engine.cpu import CpuCopyEngine
from kvlife.hashing import page_hashes
from kvlife.layout import LayerFirstLayout
from kvlife.manager import ManagedLifecycle, OffloadManager
from kvlife.pool import HostPagePool
from kvlife.store.directory import LocalDirectoryStore

try:
    import transformers
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except ImportError:  # pragma: no cover - the optional extra is missing
    sys.exit("this example needs transformers: pip install 'kvlife[hf]'")

TOLERANCE = 1e-5  # float32: restored KV must give the logits of a full recompute


# ----------------------------------------------------------------------------- the model


def build_model(args: argparse.Namespace) -> Any:
    """A small Llama-style causal LM with random weights under ``args.seed`` (no download)."""
    sizes: dict[str, Any] = {
        "vocab_size": args.vocab,
        "hidden_size": args.heads * args.head_dim,
        "intermediate_size": 2 * args.heads * args.head_dim,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": 4096,
        "attn_implementation": "sdpa",
    }
    config = LlamaConfig(**sizes)
    torch.manual_seed(args.seed)
    model: Any = LlamaForCausalLM(config)
    model = model.float().eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model


def layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V ``[batch, kv_heads, seq, head_dim]`` (transformers 4.x and 5.x)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


class Decoder:
    """Runs the model on new tokens of one sequence given its past KV as a DynamicCache."""

    def __init__(self, model: Any) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def forward(self, tokens: Sequence[int], start: int, cache: Any) -> torch.Tensor:
        """Logits of ``tokens`` at positions ``start...``; appends their KV to ``cache``."""
        ids = torch.tensor([list(tokens)], dtype=torch.int64)
        positions = torch.arange(start, start + len(tokens)).unsqueeze(0)
        out = self.model(
            input_ids=ids, position_ids=positions, use_cache=True, **{self._cache_kw: cache}
        )
        logits: torch.Tensor = out.logits[0]
        return logits


# ----------------------------------------------------------------------------- the device pool


class DevicePool:
    """The paged device KV pool: a layer-first layout, a free list, poison on free."""

    def __init__(self, layout: LayerFirstLayout) -> None:
        self.layout = layout
        self.page_size = layout.page_size
        self._free = list(range(layout.num_pages - 1, -1, -1))
        self._used_before: set[int] = set()
        self.reuses = 0  # allocations of a page another request held before

    @property
    def num_free(self) -> int:
        """Device pages free now."""
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` free device pages (the caller checked there are enough)."""
        pages = [self._free.pop() for _ in range(n)]
        self.reuses += sum(p in self._used_before for p in pages)
        self._used_before.update(pages)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return pages, poisoned with NaN: a copy that read them after release would show."""
        slots = self._slots(pages, 0, len(pages) * self.page_size)
        for buffer in self.layout.buffers():
            buffer.index_fill_(0, slots, float("nan"))
        self._free.extend(reversed(pages))

    def _slots(self, page_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        p = self.page_size
        return torch.tensor([page_table[i // p] * p + i % p for i in range(start, end)])

    def to_cache(self, page_table: Sequence[int], length: int) -> Any:
        """A DynamicCache holding the first ``length`` tokens' KV, read from the device pages."""
        cache = DynamicCache()
        if length == 0:
            return cache
        slots = self._slots(page_table, 0, length)
        for layer, (k, v) in enumerate(
            zip(self.layout.k_buffers, self.layout.v_buffers, strict=True)
        ):
            # pool [slots, kv_heads, head_dim] -> model [1, kv_heads, seq, head_dim]
            keys = k.index_select(0, slots).permute(1, 0, 2).unsqueeze(0)
            values = v.index_select(0, slots).permute(1, 0, 2).unsqueeze(0)
            cache.update(keys, values, layer)
        return cache

    def write_from_cache(self, page_table: Sequence[int], cache: Any, start: int, end: int) -> None:
        """Copy tokens ``[start, end)`` of ``cache`` into their slots of the device pages."""
        slots = self._slots(page_table, start, end)
        for layer, (k, v) in enumerate(
            zip(self.layout.k_buffers, self.layout.v_buffers, strict=True)
        ):
            keys, values = layer_kv(cache, layer)
            k.index_copy_(0, slots, keys[0, :, start:end].permute(1, 0, 2))
            v.index_copy_(0, slots, values[0, :, start:end].permute(1, 0, 2))


def reference_page(cache: Any, layers: int, page: int, page_size: int) -> torch.Tensor:
    """Page ``page`` as a flat host page ``[layers, 2, page_size, kv_heads, head_dim]``."""
    lo, hi = page * page_size, (page + 1) * page_size
    parts = []
    for layer in range(layers):
        keys, values = layer_kv(cache, layer)
        parts.append(keys[0, :, lo:hi].permute(1, 0, 2).reshape(-1))
        parts.append(values[0, :, lo:hi].permute(1, 0, 2).reshape(-1))
    return torch.cat(parts)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference; NaN anywhere gives NaN (so it never passes a check)."""
    return float((a - b).abs().max())


def worst(a: float, b: float) -> float:
    """The larger of two differences; NaN wins (it never passes a check)."""
    return b if b != b or not a >= b else a


def within(value: float) -> bool:
    """True when ``value`` <= TOLERANCE (False for NaN)."""
    return value <= TOLERANCE


# ----------------------------------------------------------------------------- requests


@dataclass
class Request:
    """One request as the runtime holds it."""

    name: str
    kind: str  # fresh | followup | partial | impostor
    prompt: list[int]
    max_new: int
    arrival: int
    parent: Request | None = None
    rid: str = ""
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # one per output token
    page_table: list[int] = field(default_factory=list)
    lc: ManagedLifecycle | None = None
    restored_pages: int = 0
    expected_pages: int = 0  # leading prompt pages someone put before this request came
    restored_rows: torch.Tensor | None = None
    put_keys: dict[str, int] = field(default_factory=dict)  # key -> page index
    done: bool = False
    releases: int = 0
    released_pages: list[int] = field(default_factory=list)

    @property
    def outputs(self) -> int:
        """Tokens generated so far."""
        return len(self.tokens) - len(self.prompt)


def workload(args: argparse.Namespace) -> list[Request]:
    """Fresh requests, then follow-ups, partial follow-ups and impostors of some of them."""
    rng = random.Random(args.seed)
    p = args.page_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.vocab) for _ in range(n)]

    def new_tokens() -> int:
        return rng.randint(args.stride + p, args.stride + p + args.max_new_extra)

    fresh = [
        Request(f"q{i}", "fresh", tokens(rng.randint(2 * p, 4 * p + p // 2)), new_tokens(), i // 2)
        for i in range(args.requests)
    ]
    later: list[Request] = []
    for i, parent in enumerate(fresh[: args.followups]):
        # prompt = parent's prompt and output + new tokens; built when the parent is done.
        kind = ("followup", "partial", "impostor")[i % 3]
        later.append(Request(f"{parent.name}.{kind}", kind, [], new_tokens(), 0, parent))
    return fresh + later


def followup_prompt(req: Request, rng: random.Random, vocab: int, page_size: int) -> list[int]:
    """The prompt of a later request, from its parent's final tokens."""
    assert req.parent is not None
    history = list(req.parent.tokens)
    extra = [rng.randrange(vocab) for _ in range(rng.randint(1, page_size + 3))]
    if req.kind == "partial":  # shares whole pages, then diverges in the middle of a page
        cut = (len(history) // page_size - 1) * page_size + page_size // 2
        return history[:cut] + extra
    if req.kind == "impostor":  # every token but the first is shared
        return [(history[0] + 1) % vocab, *history[1:], *extra]
    return history + extra


# ----------------------------------------------------------------------------- the runtime


class Runtime:
    """A continuous-batching decode loop: KV in device pages, offloaded through kvlife."""

    def __init__(self, args: argparse.Namespace, model: Any, root: str) -> None:
        self.args = args
        self.decoder = Decoder(model)
        cfg = model.config
        self.layers: int = cfg.num_hidden_layers
        self.page_size: int = args.page_size
        layout = LayerFirstLayout.zeros(
            cfg.num_hidden_layers,
            args.device_pages,
            args.page_size,
            cfg.num_key_value_heads,
            args.head_dim,
            dtype=torch.float32,
        )
        self.pool = DevicePool(layout)
        self.host = HostPagePool(
            args.host_pages, layout.page_numel, torch.float32, pin_memory=False
        )
        self.engine = CpuCopyEngine(
            layout, self.host, copy_delay=0.001, delay_jitter=0.004, seed=args.seed, workers=2
        )
        # Keys are seeded by a model namespace, so another model's pages never match.
        self.namespace = f"tiny-llama-s{args.seed}"
        self.store = LocalDirectoryStore(root, self.namespace)
        # The prefill side is another writer on the same directory (its own results).
        self.prefill_store = LocalDirectoryStore(root, self.namespace)
        self.manager = OffloadManager(
            self.engine,
            self.host,
            self.store,
            page_size=args.page_size,
            stride=args.stride,
            namespace=self.namespace,
        )
        self.rng = random.Random(args.seed + 1)
        self.free_rids = [f"rid-{i}" for i in range(args.max_batch)]
        self.rid_uses: dict[str, int] = {}
        self.put_prefixes: set[tuple[int, ...]] = set()  # token prefixes anyone put in the store
        self.prefill_pages = 0
        self.prefill_store_failures = 0
        self.impostor_shared_pages = 0
        self.steps = 0

    # -- admission: restore the stored prefix, prefill the rest

    def ready(self, req: Request) -> bool:
        """A later request arrives once its parent is done and the parent's pages are stored."""
        if req.parent is None:
            return req.arrival <= self.steps
        parent = req.parent
        return parent.done and all(self.store.contains(k) for k in parent.put_keys)

    def admit(self, req: Request) -> None:
        """Restore the longest stored prefix, prefill the rest, start the request's Lifecycle."""
        p = self.page_size
        if req.parent is not None:
            req.prompt = followup_prompt(req, self.rng, self.args.vocab, p)
        prompt = req.prompt
        req.rid = self.free_rids.pop()
        self.rid_uses[req.rid] = self.rid_uses.get(req.rid, 0) + 1
        req.page_table = self.pool.alloc(-(-(len(prompt) + req.max_new) // p))
        req.tokens = list(prompt)

        # The longest stored prefix, by page keys in order (the last prompt token is
        # always computed: its logits pick the first output token).
        keys = page_hashes(prompt[: len(prompt) // p * p], p, namespace=self.namespace)
        rows: list[torch.Tensor] = []
        for key in keys[: (len(prompt) - 1) // p]:
            if not self.store.contains(key):
                break
            data = self.store.get(key)
            if data is None or len(data) != self.pool.layout.page_nbytes:
                break
            rows.append(torch.frombuffer(bytearray(data), dtype=torch.float32))
        restored = len(rows) * p
        layout = self.pool.layout
        if rows:
            host_rows = torch.stack(rows)
            if self.args.mutant == "layout":  # a page-layout mistake: K and V swapped
                host_rows = (
                    host_rows.view(len(rows), self.layers, 2, -1).flip(2).reshape(len(rows), -1)
                )
            layout.scatter(layout.page_index(req.page_table[: len(rows)]), host_rows)
            # What the model will read, for the check: the device pages after the restore.
            req.restored_rows = torch.stack(
                [layout.read_page(d) for d in req.page_table[: len(rows)]]
            )
        req.restored_pages = len(rows)
        req.expected_pages = expected_restore(prompt, self.put_prefixes, p)
        if req.kind == "impostor":  # pages with the parent's tokens whose keys are not stored
            assert req.parent is not None
            self.impostor_shared_pages += sum(
                prompt[i * p : (i + 1) * p] == req.parent.tokens[i * p : (i + 1) * p]
                and not self.store.contains(key)
                for i, key in enumerate(keys)
            )

        cache = self.pool.to_cache(req.page_table, restored)
        # RoPE: the restored KV carries its positions; the rest continues at position `restored`.
        start = 0 if self.args.mutant == "positions" else restored
        logits = self.decoder.forward(prompt[restored:], start, cache)
        self.pool.write_from_cache(req.page_table, cache, restored, len(prompt))
        self.emit(req, logits[-1])

        def on_release(lc: ManagedLifecycle, device_pages: Sequence[int]) -> None:
            # Called once nothing is in flight: only now may the device pages be reused.
            req.releases += 1
            req.released_pages = list(device_pages)
            self.pool.free(device_pages)

        req.lc = self.manager.start(req.rid, prompt, on_release)
        self.prefill_side_store(req, keys)

    def prefill_side_store(self, req: Request, keys: list[str]) -> None:
        """What a prefill server does: put the prompt's whole pages not yet stored."""
        p = self.page_size
        todo = [i for i, key in enumerate(keys) if not self.prefill_store.contains(key)]
        for i, key in enumerate(keys):
            req.put_keys[key] = i
            self.put_prefixes.add(tuple(req.prompt[: (i + 1) * p]))
        if not todo:
            return
        layout = self.pool.layout
        rows = torch.empty((len(todo), layout.page_numel), dtype=torch.float32)
        layout.gather(layout.page_index([req.page_table[i] for i in todo]), rows)
        self.prefill_store.put(req.name, [keys[i] for i in todo], rows)
        self.prefill_pages += len(todo)

    # -- decode

    def emit(self, req: Request, logits: torch.Tensor) -> None:
        """Record the logits that chose the next token; greedy decoding."""
        req.logits.append(logits.clone())
        req.tokens.append(int(logits.argmax()))

    def decode_step(self, req: Request) -> None:
        """One token: past KV from the device pages, new KV back into them."""
        kv_len = len(req.tokens) - 1
        cache = self.pool.to_cache(req.page_table, kv_len)
        logits = self.decoder.forward(req.tokens[-1:], kv_len, cache)
        self.pool.write_from_cache(req.page_table, cache, kv_len, kv_len + 1)
        self.emit(req, logits[-1])

    def offload(self, req: Request) -> None:
        """Submit what is due; remember which token prefixes went to the store."""
        assert req.lc is not None
        ticket = self.manager.offload(req.lc, req.tokens, req.page_table)
        if ticket is None:
            return
        p = self.page_size
        first = req.lc.prefill_len // p + ticket.first_page  # first_page counts after prefill
        for j, key in enumerate(ticket.keys):
            page = first + j
            req.put_keys[key] = page
            self.put_prefixes.add(tuple(req.tokens[: (page + 1) * p]))

    def run(self, requests: list[Request]) -> None:
        """The scheduler loop: admit, decode, offload, poll, finish."""
        waiting = list(requests)
        running: list[Request] = []
        deadline = time.monotonic() + self.args.time_limit
        while waiting or running:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no progress within {self.args.time_limit} s")
            admitted: list[Request] = []
            for req in list(waiting):
                if len(running) + len(admitted) >= self.args.max_batch or not self.free_rids:
                    break
                need = -(-(self._prompt_len(req) + req.max_new) // self.page_size)
                if not self.ready(req) or self.pool.num_free < need:
                    continue
                waiting.remove(req)
                self.admit(req)
                admitted.append(req)
            for req in running:
                self.decode_step(req)
            running += admitted
            for req in running:
                self.offload(req)
            self.manager.poll()
            self.poll_prefill_store()
            for req in [r for r in running if r.outputs >= r.max_new]:
                running.remove(req)
                assert req.lc is not None
                self.manager.finish(req.lc, FinishReason.FINISHED)
                req.done = True
                self.free_rids.insert(0, req.rid)  # reused while its old life may still offload
            if admitted or running:
                self.steps += 1
            else:
                time.sleep(0.001)  # waiting for a parent's pages to reach the store
        self.manager.close()
        self.prefill_store_failures += sum(not r.ok for r in self.prefill_store.drain())

    def poll_prefill_store(self) -> None:
        """Collect the prefill side's put results (a failed put leaves its pages unstored)."""
        self.prefill_store_failures += sum(not r.ok for r in self.prefill_store.poll())

    def _prompt_len(self, req: Request) -> int:
        if req.parent is None:
            return len(req.prompt)
        return len(req.parent.tokens) + self.page_size + 3  # an upper bound before it is built

    def close(self) -> None:
        """Stop the copy workers and the store writers."""
        self.engine.close()
        self.store.close()
        self.prefill_store.close()


# ----------------------------------------------------------------------------- checking


@dataclass
class Check:
    """Figures from comparing the served run with full recomputes."""

    max_abs_logit_diff: float = 0.0
    max_abs_logit_diff_restored: float = 0.0
    logits_compared: int = 0
    restored_pages: int = 0
    restored_decode_pages: int = 0
    expected_restored_pages: int = 0
    misrestored_pages: int = 0
    impostor_restored_pages: int = 0
    store_pages_checked: int = 0
    store_pages_wrong: int = 0
    max_abs_store_diff: float = 0.0
    releases_wrong: int = 0


def expected_restore(prompt: list[int], put_prefixes: set[tuple[int, ...]], page_size: int) -> int:
    """Leading whole pages whose token prefix was put (the last prompt token is computed)."""
    n = 0
    while n < (len(prompt) - 1) // page_size and (
        tuple(prompt[: (n + 1) * page_size]) in put_prefixes
    ):
        n += 1
    return n


def check(runtime: Runtime, requests: list[Request]) -> Check:
    """Recompute every request from scratch and compare logits, restored pages and stored pages."""
    c = Check()
    p = runtime.page_size
    for req in requests:
        c.releases_wrong += req.releases != 1 or req.released_pages != req.page_table
        cache = DynamicCache()
        ref = runtime.decoder.forward(req.tokens[:-1], 0, cache)  # no cache, no offload
        first = len(req.prompt) - 1
        for j, served in enumerate(req.logits):
            diff = max_diff(served, ref[first + j])
            c.max_abs_logit_diff = worst(c.max_abs_logit_diff, diff)
            if req.restored_pages:
                c.max_abs_logit_diff_restored = worst(c.max_abs_logit_diff_restored, diff)
            c.logits_compared += 1
        c.restored_pages += req.restored_pages
        c.expected_restored_pages += req.expected_pages
        if req.kind == "impostor":
            c.impostor_restored_pages += req.restored_pages
        for i in range(req.restored_pages):
            assert req.restored_rows is not None
            # Restored pages form a leading run, as do the expected ones: page i belongs
            # to this prompt only if every prefix up to it was put before the request came.
            right = i < req.expected_pages and within(
                max_diff(req.restored_rows[i], reference_page(cache, runtime.layers, i, p))
            )
            c.misrestored_pages += not right
            parent = req.parent
            if parent is not None and i >= len(parent.prompt) // p:
                c.restored_decode_pages += 1  # offloaded by the parent's decode
        for key, page in req.put_keys.items():
            if (page + 1) * p > len(req.tokens) - 1:
                continue
            data = runtime.store.get(key)
            c.store_pages_checked += 1
            if data is None:
                c.store_pages_wrong += 1
                continue
            stored = torch.frombuffer(bytearray(data), dtype=torch.float32)
            diff = max_diff(stored, reference_page(cache, runtime.layers, page, p))
            c.max_abs_store_diff = worst(c.max_abs_store_diff, diff)
            c.store_pages_wrong += not within(diff)
    return c


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Sizes and switches."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=6, help="fresh requests")
    ap.add_argument("--followups", type=int, default=4, help="later requests on earlier ones")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped query)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=8, help="tokens per page")
    ap.add_argument("--stride", type=int, default=16, help="decode offload stride in tokens")
    ap.add_argument("--max-new-extra", type=int, default=16, help="output length spread")
    ap.add_argument("--max-batch", type=int, default=3, help="running requests (= rid pool)")
    ap.add_argument("--device-pages", type=int, default=96)
    ap.add_argument("--host-pages", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store", default=None, help="store root (default: a temporary directory)")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds before giving up")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument(
        "--mutant",
        choices=["positions", "layout"],
        default=None,
        help="seed an integration bug the checks must catch: restored prefix decoded from "
        "position 0, or restored pages with K and V swapped (exit status 1 expected)",
    )
    args = ap.parse_args(argv)
    if args.followups > args.requests:
        ap.error("--followups must not exceed --requests")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Serve, recompute, compare; exit 1 when a page misrestored or logits differ."""
    args = parse_args(argv)
    torch.set_num_threads(2)
    began = time.perf_counter()
    model = build_model(args)
    requests = workload(args)
    with tempfile.TemporaryDirectory(prefix="kvlife-hf-") as tmp:
        runtime = Runtime(args, model, args.store or tmp)
        try:
            runtime.run(requests)
            served = time.perf_counter() - began
            c = check(runtime, requests)
            metrics = runtime.manager.metrics()
            stored_keys = len(list(runtime.store.keys()))
        finally:
            runtime.close()
    report: dict[str, Any] = {
        "requests": len(requests),
        "followups": sum(r.parent is not None and r.kind != "impostor" for r in requests),
        "impostors": sum(r.kind == "impostor" for r in requests),
        "steps": runtime.steps,
        "tokens_generated": sum(r.outputs for r in requests),
        "restored_pages": c.restored_pages,
        "restored_decode_pages": c.restored_decode_pages,
        "expected_restored_pages": c.expected_restored_pages,
        "missed_pages": c.expected_restored_pages - c.restored_pages,
        "misrestored_pages": c.misrestored_pages,
        "impostor_restored_pages": c.impostor_restored_pages,
        "impostor_shared_pages": runtime.impostor_shared_pages,
        "fresh_restored_pages": sum(r.restored_pages for r in requests if r.parent is None),
        "max_abs_logit_diff": c.max_abs_logit_diff,
        "max_abs_logit_diff_restored": c.max_abs_logit_diff_restored,
        "logits_compared": c.logits_compared,
        "store_pages_checked": c.store_pages_checked,
        "store_pages_wrong": c.store_pages_wrong,
        "max_abs_store_diff": c.max_abs_store_diff,
        "stored_keys": stored_keys,
        "prefill_pages_put": runtime.prefill_pages,
        "chunks_submitted": metrics.chunks_submitted,
        "pages_offloaded": metrics.pages_offloaded,
        "pages_stored": metrics.pages_stored,
        "copy_failures": metrics.copy_failures,
        "store_failures": metrics.store_failures,
        "prefill_store_failures": runtime.prefill_store_failures,
        "releases_wrong": c.releases_wrong,
        "rid_reuses": sum(n - 1 for n in runtime.rid_uses.values()),
        "device_page_reuses": runtime.pool.reuses,
        "host_pages_used_at_end": runtime.host.num_used,
        "device_pages_used_at_end": args.device_pages - runtime.pool.num_free,
        "transformers": transformers.__version__,
        "seconds_serving": round(served, 2),
    }
    failures = []
    if (
        report["misrestored_pages"]
        or report["impostor_restored_pages"]
        or report["fresh_restored_pages"]
    ):
        failures.append("pages restored that do not belong to the prompt")
    if not within(c.max_abs_logit_diff):
        failures.append(f"logits differ by {c.max_abs_logit_diff} > {TOLERANCE}")
    if report["store_pages_wrong"]:
        failures.append("stored pages missing or wrong")
    if (
        report["releases_wrong"]
        or report["host_pages_used_at_end"]
        or report["device_pages_used_at_end"]
    ):
        failures.append("device or host pages not given back exactly once")
    if report["followups"] and not report["restored_decode_pages"]:
        failures.append("no page offloaded by decode was ever restored")
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"transformers {report['transformers']}: {args.layers} layers, {args.heads} query "
            f"heads, {args.kv_heads} kv heads, head dim {args.head_dim}, float32, "
            f"seed {args.seed}"
        )
        print(
            f"served {report['requests']} requests ({report['followups']} continuing earlier "
            f"ones, {report['impostors']} impostors) in {report['steps']} steps, "
            f"{report['tokens_generated']} tokens, rids reused {report['rid_reuses']}x, "
            f"device pages reused {report['device_page_reuses']}x"
        )
        print(
            f"kvlife: {report['chunks_submitted']} chunks, {report['pages_offloaded']} pages "
            f"offloaded by decode, {report['prefill_pages_put']} put by prefill, "
            f"{report['stored_keys']} keys in the store"
        )
        print(
            f"restored {report['restored_pages']} pages ({report['restored_decode_pages']} from "
            f"decode offload; expected {report['expected_restored_pages']}), misrestored "
            f"{report['misrestored_pages']}, impostors restored "
            f"{report['impostor_restored_pages']}"
        )
        print(
            f"max |logit diff| vs full recompute: {c.max_abs_logit_diff:.3g} over "
            f"{c.logits_compared} steps (restored requests: "
            f"{c.max_abs_logit_diff_restored:.3g}); stored pages: {c.store_pages_checked} "
            f"checked, max diff {c.max_abs_store_diff:.3g}"
        )
        print("OK" if not failures else "FAILED: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
