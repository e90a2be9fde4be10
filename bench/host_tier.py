"""kvlife's vLLM host tier against vLLM's own CPUOffloadingManager (LRU), side by side.

Runs in the vLLM venv (vLLM's manager is plain Python on vLLM's CPU build).

Two figures:

* **cost per call** -- one recorded trace of scheduler calls (on_new_request, lookup,
  prepare_load / complete_load, prepare_store / complete_store, on_request_finished)
  from a workload of returning prompts, replayed through each manager; the variants
  are interleaved (A, B, A, B, ...) and the median over the rounds is the figure,
  with its range. Ratio kvlife / vLLM: lower is better.
* **hit rate** -- each manager runs the same workload closed loop (a returning prompt
  loads what its lookup reaches, stores the rest); blocks loaded / blocks asked, with a
  host tier smaller than the working set.

    python bench/host_tier.py             # 7 rounds
    python bench/host_tier.py --quick     # 3 rounds, smaller trace

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvlife.integrations.vllm import KVLifeOffloadingManager
from kvlife.pool import HostPagePool


def key(conv: int, block: int) -> bytes:
    return conv.to_bytes(4, "big") + block.to_bytes(28, "big") + (0).to_bytes(4, "big")


def workload(requests: int, conversations: int, seed: int) -> list[tuple[int, int]]:
    """(conversation, prefix blocks) per request: a few hot conversations return often,
    each return a little longer."""
    rng = random.Random(seed)
    length = [rng.randint(2, 6) for _ in range(conversations)]
    out = []
    for _ in range(requests):
        conv = min(int(rng.paretovariate(1.2)) - 1, conversations - 1)
        length[conv] += rng.randint(0, 2)
        out.append((conv, length[conv]))
    return out


def run_closed_loop(manager: Any, work: list[tuple[int, int]]) -> tuple[int, int, list[Any]]:
    """Drive ``manager`` as vLLM's connector does; return (blocks hit, blocks asked, calls)."""
    calls: list[Any] = []
    hit = asked = 0
    for n, (conv, blocks) in enumerate(work):
        ctx = ReqContext(f"req-{conv}")  # rids of a conversation repeat
        keys = [key(conv, b) for b in range(blocks)]
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * 16)
        calls.append(("new", ctx, None))
        manager.on_new_request(ctx)
        reached = 0
        for k in keys:
            calls.append(("lookup", ctx, k))
            if manager.lookup(k, ctx) is not LookupResult.HIT:
                break
            reached += 1
        hit += reached
        asked += blocks
        if reached:
            calls.append(("load", ctx, keys[:reached]))
            manager.prepare_load(keys[:reached], ctx)
            calls.append(("load_done", ctx, set(keys[:reached])))
            manager.complete_load(set(keys[:reached]), ctx)
        rest = keys[reached:]
        if rest:
            calls.append(("store", ctx, rest))
            out = manager.prepare_store(rest, ctx)
            if out is not None and out.keys_to_store:
                calls.append(("store_done", ctx, set(out.keys_to_store)))
                manager.complete_store(set(out.keys_to_store), ctx)
        calls.append(("finished", ctx, None))
        manager.on_request_finished(ctx)
        del n
    return hit, asked, calls


def replay(manager: Any, calls: list[Any]) -> float:
    """Seconds to run the recorded ``calls`` through ``manager`` (fresh contexts)."""
    contexts: dict[int, ReqContext] = {}
    ops: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
    for op, ctx, arg in calls:
        fresh = contexts.get(id(ctx))
        if fresh is None or op == "new":
            fresh = contexts[id(ctx)] = ReqContext(ctx.req_id)
            fresh._offload_key_positions = dict(ctx._offload_key_positions)
        method = {
            "new": manager.on_new_request,
            "lookup": manager.lookup,
            "load": manager.prepare_load,
            "load_done": manager.complete_load,
            "store": manager.prepare_store,
            "store_done": manager.complete_store,
            "finished": manager.on_request_finished,
        }[op]
        ops.append((method, (fresh,) if arg is None else (arg, fresh)))
    start = time.perf_counter()
    for method, args in ops:
        method(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--capacity", type=int, default=256, help="host-tier blocks")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests = 3, 1000
    torch.set_num_threads(1)
    work = workload(args.requests, conversations=400, seed=0)

    def kvlife_manager() -> Any:
        return KVLifeOffloadingManager(HostPagePool(args.capacity, 1, torch.int8, pin_memory=False))

    def vllm_manager() -> Any:
        return CPUOffloadingManager(num_chunks=args.capacity, cache_policy="lru")

    k_hit, asked, _ = run_closed_loop(kvlife_manager(), work)
    v_hit, asked_v, calls = run_closed_loop(vllm_manager(), work)
    assert asked == asked_v
    times: dict[str, list[float]] = {"kvlife": [], "vllm": []}
    for _ in range(args.rounds):
        for name, make in (("kvlife", kvlife_manager), ("vllm", vllm_manager)):
            times[name].append(replay(make(), calls))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    per_call = {name: med[name] / len(calls) * 1e6 for name in med}
    ratios = [k / v for k, v in zip(times["kvlife"], times["vllm"], strict=True)]
    print(f"trace: {len(calls)} calls, {len(work)} requests, host tier {args.capacity} blocks")
    for name in ("kvlife", "vllm"):
        ts = times[name]
        print(
            f"{name:7s} {per_call[name]:.2f} us/call (median of {args.rounds}; "
            f"{min(ts) / len(calls) * 1e6:.2f} to {max(ts) / len(calls) * 1e6:.2f})"
        )
    ratio = med["kvlife"] / med["vllm"]
    print(f"cost ratio kvlife/vllm: {ratio:.3f} (per-round {min(ratios):.3f} to {max(ratios):.3f})")
    print(f"hit rate: kvlife {k_hit / asked:.3f}, vllm {v_hit / asked:.3f} ({asked} blocks asked)")
    print(
        json.dumps(
            {
                "ratio_vs_vllm_lru": round(ratio, 3),
                "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "kvlife_us_per_call": round(per_call["kvlife"], 3),
                "vllm_us_per_call": round(per_call["vllm"], 3),
                "hit_rate_kvlife": round(k_hit / asked, 4),
                "hit_rate_vllm": round(v_hit / asked, 4),
                "calls": len(calls),
                "rounds": args.rounds,
            }
        )
    )


if __name__ == "__main__":
    main()
