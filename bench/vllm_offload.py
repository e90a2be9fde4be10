"""Scheduler-side cost per vLLM step: KVLifeOffloadingSpec's manager vs the simplest dict spec.

Runs vLLM's CPU build once (single process, tiny random Llama, a store round
and a load round), recording every call vLLM makes to kvlife's manager, with
its real keys. Then replays that same call trace against a fresh kvlife
manager and a fresh dict-based manager (the simplest one a user would write:
a dict key -> host slot, a free list, LRU by an OrderedDict), interleaved,
``--reps`` times each, and reports the median cost per engine step. The worker
side (the copies) is the same for both and not part of this figure.

    python bench/vllm_offload.py [--reps 30] [--prompts 32]

Needs vLLM (see docs/vllm.md). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections import OrderedDict
from collections.abc import Collection
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from kvlife.integrations.vllm import KVLifeOffloadingManager, live_managers
from kvlife.pool import HostPagePool

CALLS = (
    "on_new_request",
    "lookup",
    "prepare_load",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_request_finished",
    "on_schedule_end",
    "get_stats",
)


class _Slots(BlockIDsLoadStoreSpec):  # type: ignore[misc]
    pass


class DictManager(OffloadingManager):  # type: ignore[misc]
    """The simplest dict-based manager: key -> slot, free list, LRU, refs for loads."""

    def __init__(self, slots: int) -> None:
        self.entries: OrderedDict[OffloadKey, list[int]] = OrderedDict()  # [slot, ready, refs]
        self.free = list(range(slots))

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        e = self.entries.get(key)
        if e is None:
            return LookupResult.MISS
        return LookupResult.HIT if e[1] else LookupResult.HIT_PENDING

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        slots = []
        for key in keys:
            e = self.entries[key]
            e[2] += 1
            self.entries.move_to_end(key)
            slots.append(e[0])
        return _Slots(slots)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            self.entries[key][2] -= 1

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        new = [k for k in keys if k not in self.entries]
        need = len(new) - len(self.free)
        evicted: list[OffloadKey] = []
        if need > 0:
            protected = set(keys)
            evicted = [
                k for k, e in self.entries.items() if e[1] and not e[2] and k not in protected
            ]
            evicted = evicted[:need]
            if len(evicted) < need:
                return None
            for k in evicted:
                self.free.append(self.entries.pop(k)[0])
        slots = []
        for k in new:
            slot = self.free.pop()
            self.entries[k] = [slot, False, 0]
            slots.append(slot)
        return PrepareStoreOutput(keys_to_store=new, store_spec=_Slots(slots), evicted_keys=evicted)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        for k in keys:
            e = self.entries.get(k)
            if e is not None:
                e[1] = True

    def on_new_request(self, req_context: ReqContext) -> Any:
        return RequestOffloadingContext()


def build_model(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=1024,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def record_trace(n_prompts: int, host_bytes: int) -> tuple[list[tuple[str, str | None, Any]], int]:
    """Run vLLM; return the manager calls (name, request id, other args) and the page count."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model = tempfile.mkdtemp(prefix="tinyllama-")
    build_model(model)
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=32,
        max_model_len=512,
        enforce_eager=True,
        distributed_executor_backend="uni",
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "KVLifeOffloadingSpec",
                "spec_module_path": "kvlife.integrations.vllm",
                "host_bytes": host_bytes,
            },
        ),
    )
    (manager,) = live_managers()
    trace: list[tuple[str, str | None, Any]] = []
    for name in CALLS:
        method = getattr(manager, name)

        def recorder(*args: Any, _name: str = name, _method: Any = method, **kw: Any) -> Any:
            ctx = next((a for a in args if isinstance(a, ReqContext)), None)
            rest = tuple(list(a) if isinstance(a, (set, frozenset, list)) else a for a in args)
            trace.append((_name, None if ctx is None else ctx.req_id, rest))
            return _method(*args, **kw)

        setattr(manager, name, recorder)
    rng = random.Random(0)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randrange(3, 1024) for _ in range(rng.randint(90, 200))])
        for _ in range(n_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)
    llm.reset_prefix_cache()
    llm.generate(prompts, params, use_tqdm=False)
    return trace, manager.pool.capacity


def replay(manager: Any, trace: list[tuple[str, str | None, Any]]) -> float:
    """Run the trace against ``manager``; seconds spent inside its methods."""
    contexts: dict[str, ReqContext] = {}
    elapsed = 0.0
    perf = time.perf_counter
    for name, rid, args in trace:
        method = getattr(manager, name, None)
        if method is None:
            continue
        if rid is not None:
            ctx = contexts.get(rid)
            if ctx is None:
                ctx = contexts[rid] = ReqContext(req_id=rid)
            args = tuple(ctx if isinstance(a, ReqContext) else a for a in args)
        start = perf()
        method(*args)
        elapsed += perf() - start
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--host-bytes", type=int, default=64 * 32768)
    args = parser.parse_args()
    trace, pages = record_trace(args.prompts, args.host_bytes)
    steps = sum(1 for name, _, _ in trace if name == "on_schedule_end")
    counts = {name: sum(1 for n, _, _ in trace if n == name) for name in CALLS}
    print(f"trace: {len(trace)} manager calls over {steps} engine steps, {pages} host pages")
    print(f"calls: {counts}")
    kvlife_s: list[float] = []
    dict_s: list[float] = []
    for _ in range(args.reps):  # interleaved, fresh managers each time
        kv = KVLifeOffloadingManager(HostPagePool(pages, 1, torch.int8, pin_memory=False))
        kvlife_s.append(replay(kv, trace))
        dict_s.append(replay(DictManager(pages), trace))
        assert kv.accounting()["refused"] == 0, dict(kv.refusals)
    kv_us = statistics.median(kvlife_s) / steps * 1e6
    dict_us = statistics.median(dict_s) / steps * 1e6
    print(f"kvlife manager: {kv_us:.1f} us/step   dict manager: {dict_us:.1f} us/step")
    result = {
        "bench": "vllm_offload",
        "steps": steps,
        "manager_calls": len(trace),
        "reps": args.reps,
        "kvlife_us_per_step": round(kv_us, 2),
        "dict_us_per_step": round(dict_us, 2),
        "ratio": round(kv_us / dict_us, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
