"""Scheduler-side cost per vLLM step: KVLifeOffloadingSpec's manager vs the simplest dict spec.

Runs vLLM's CPU build once (single process, tiny random Llama, a store round
and a load round), recording every call vLLM makes to kvlife's manager, with
its real keys. Then replays that same call trace against a fresh kvlife
manager and a fresh dict-based manager (the simplest one a user would write:
a dict key -> host slot, a free list, LRU by an OrderedDict, with the same
features: pending and pinned entries, eviction of ready unpinned slots only,
``None`` when full, and the same counters reported by ``get_stats``),
interleaved, ``--reps`` times each, and reports the median cost per engine
step. The worker side (the copies) is not part of that figure.

Then the worker's bandwidth: a fresh ``KVLifeWorker`` over vLLM's real KV
cache views stores one job of ``--bw-blocks`` scattered blocks to its host
pool and loads it back into other blocks, through its copy engine, against a
contiguous copy of the same bytes (each round the faster of torch's ``copy_`` and a
one-thread memcpy, each between buffers of its own; ``*_vs_copy_*``: against ``copy_``
alone); interleaved rounds, each in another order, medians.

    python bench/vllm_offload.py [--reps 30] [--prompts 32] [--bw-blocks 512] [--bw-rounds 9]
    python bench/vllm_offload.py --real-only --bw-rounds 11   # the realistic shape alone

Needs vLLM (see docs/vllm.md). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from kvlife.integrations.vllm import (
    BlockViewsLayout,
    HostBlocksSpec,
    KVLifeOffloadingManager,
    KVLifeWorker,
    live_managers,
    live_workers,
    transfer_config,
)
from kvlife.layout import _rowcopy
from kvlife.pool import HostPagePool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from vllm_offload import build_tiny_llama

COUNTERS = ("stored", "loaded", "evicted", "dropped_host_full")
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
    """The simplest dict-based manager with the backend's features, as a user would write it.

    A dict key -> ``[slot, ready, pins]`` in LRU order and a free list: pending
    entries (``HIT_PENDING``), loads pin their slots, LRU eviction of ready,
    unpinned slots only (never the offered keys), ``None`` when full, failed
    stores dropped, and the same counters and gauges reported through
    ``get_stats`` (deltas; ``None`` when nothing changed). No per-request state:
    nothing checks that a completion belongs to a job, nor that a job ends once.
    """

    def __init__(self, slots: int) -> None:
        self.entries: OrderedDict[OffloadKey, list[Any]] = OrderedDict()  # [slot, ready, pins]
        self.free = list(range(slots))
        self.slots = slots
        self.pending = 0
        self.counts = {name: 0 for name in COUNTERS}
        self.reported = dict(self.counts)
        self.gauges: tuple[int, int] | None = None

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        e = self.entries.get(key)
        if e is None:
            return LookupResult.MISS
        return LookupResult.HIT if e[1] else LookupResult.HIT_PENDING

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        slots = []
        for key in keys:
            e = self.entries.get(key)
            if e is None:  # the trace follows kvlife's eviction order (prefix tail first), not
                slots.append(-1)  # this plain LRU's: a key it evicted is read elsewhere
                continue
            e[2] += 1
            self.entries.move_to_end(key)
            slots.append(e[0])
        return _Slots(slots)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            e = self.entries.get(key)
            if e is not None and e[2]:
                e[2] -= 1
        self.counts["loaded"] += len(keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        new = []
        for k in keys:
            if k in self.entries:
                self.entries.move_to_end(k)
            else:
                new.append(k)
        new = new[: self.slots]
        need = len(new) - len(self.free)
        evicted: list[OffloadKey] = []
        if need > 0:
            protected = set(keys)
            for k, e in self.entries.items():
                if e[1] and not e[2] and k not in protected:
                    evicted.append(k)
                    if len(evicted) == need:
                        break
            if len(evicted) < need:
                self.counts["dropped_host_full"] += 1
                return None
            for k in evicted:
                self.free.append(self.entries.pop(k)[0])
            self.counts["evicted"] += len(evicted)
        slots = []
        for k in new:
            slot = self.free.pop()
            self.entries[k] = [slot, False, 0]
            slots.append(slot)
        self.pending += len(new)
        return PrepareStoreOutput(keys_to_store=new, store_spec=_Slots(slots), evicted_keys=evicted)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        for k in keys:
            e = self.entries.get(k)
            if e is None or e[1]:
                continue
            self.pending -= 1
            if success:
                e[1] = True
                self.counts["stored"] += 1
            else:
                self.free.append(self.entries.pop(k)[0])

    def on_new_request(self, req_context: ReqContext) -> Any:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        self.entries.clear()
        self.free = list(range(self.slots))
        self.pending = 0

    def get_stats(self) -> Any:
        gauges = (self.pending, self.slots - len(self.free))
        if gauges == self.gauges and self.counts == self.reported:
            return None
        stats = OffloadingConnectorStats()
        for name, value in self.counts.items():
            if value != self.reported[name]:
                stats.increase_counter(f"vllm:kvlife_{name}", value - self.reported[name])
        stats.set_gauge("vllm:kvlife_pending_blocks", gauges[0])
        stats.set_gauge("vllm:kvlife_host_usage_perc", gauges[1] / self.slots)
        self.gauges, self.reported = gauges, dict(self.counts)
        return stats


def record_trace(
    n_prompts: int, host_bytes: int
) -> tuple[list[tuple[str, str | None, Any]], int, tuple[torch.Tensor, ...]]:
    """Run vLLM; return the manager calls (name, request id, other args), the page count
    and vLLM's KV cache block views (the worker's layout, for the bandwidth figure)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = tempfile.mkdtemp(prefix="tinyllama-")
    build_tiny_llama(model)
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=32,
        max_model_len=512,
        enforce_eager=True,
        distributed_executor_backend="uni",
        kv_transfer_config=transfer_config(host_bytes),
    )
    (manager,) = live_managers()
    (worker,) = live_workers()
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
    return trace, manager.pool.capacity, worker.layout.views


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


def worker_bandwidth(views: tuple[torch.Tensor, ...], blocks: int, rounds: int) -> dict[str, float]:
    """The worker's store and load bandwidth against a contiguous copy of the same bytes.

    A fresh :class:`KVLifeWorker` (its own host pool) over vLLM's real KV cache
    views: one job of ``blocks`` scattered device blocks into consecutive host
    pages (a store), then back into other scattered blocks (a load), each timed
    from ``submit_*`` through ``wait`` to its ``get_finished`` result; and a
    ``copy_`` and a memcpy of the same size, each between two contiguous buffers of
    its own. Rounds are interleaved, each in another order; medians.
    """
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(v, int(v.shape[1])) for v in views],
        group_data_refs=[[CanonicalKVCacheRef(i, int(v.shape[1])) for i, v in enumerate(views)]],
    )
    row = sum(int(v.shape[1]) for v in views)
    worker = KVLifeWorker(caches, HostPagePool(blocks, row, torch.int8))
    rng = random.Random(1)
    picked = rng.sample(range(1, int(views[0].shape[0])), 2 * blocks)  # block 0: vLLM's null
    src, dst = picked[:blocks], picked[blocks:]
    host = list(range(blocks))
    keys = [i.to_bytes(8, "big") for i in range(blocks)]
    flat_src = torch.randint(-128, 127, (blocks * row,), dtype=torch.int8)
    flat_dst = torch.empty_like(flat_src)
    times: dict[str, list[float]] = {"store": [], "load": [], "contiguous": [], "memcpy": []}
    perf = time.perf_counter
    # Each job's copy as the engine runs it, timed inside the engine thread: a job's time
    # less its copy is its fixed cost (submit, checks, hand-offs, the ack, the result).
    copies: dict[str, list[float]] = {"store": [], "load": []}
    layout = worker.layout

    def timed_copy(name: str, copy: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any, **kwargs: Any) -> None:
            start = perf()
            copy(*args, **kwargs)
            copies[name].append(perf() - start)

        return run

    layout.gather_runs = timed_copy("store", layout.gather_runs)  # type: ignore[method-assign]
    layout.scatter_runs = timed_copy("load", layout.scatter_runs)  # type: ignore[method-assign]

    def job(job_id: int, load: bool) -> float:
        # The specs as vLLM's scheduler hands them over (made there, before the worker's
        # submit_*: not the worker's time).
        on_host, on_device = (
            HostBlocksSpec(host, keys),
            GPULoadStoreSpec(dst if load else src, [blocks], [0]),
        )
        start = perf()
        if load:
            worker.submit_load(job_id, on_host, on_device)
        else:
            worker.submit_store(job_id, on_device, on_host)
        worker.wait({job_id})
        (result,) = worker.get_finished()
        elapsed = perf() - start
        assert result.job_id == job_id and result.success
        return elapsed

    def contiguous() -> float:
        start = perf()
        flat_dst.copy_(flat_src)
        return perf() - start

    # memcpy on buffers of its own: on copy_'s, whichever of the two ran second found its
    # source in the cache, and the faster of them, the baseline, was a warm copy.
    np_src = torch.randint(-128, 127, (blocks * row,), dtype=torch.int8).numpy()
    np_dst = np.empty_like(np_src)

    def memcpy() -> float:  # one thread, no OpenMP: torch's copy_ is not always the faster
        start = perf()
        np.copyto(np_dst, np_src)
        return perf() - start

    # Each round runs the four in another order (the rotation: store, load, contiguous,
    # memcpy; load, contiguous, memcpy, store; ...): on these machines whichever copy runs
    # right after another runs faster, and a fixed order would favour one of them.
    timed: dict[str, Callable[[int], float]] = {
        "store": lambda r: job(2 * r, False),
        "load": lambda r: job(2 * r + 1, True),
        "contiguous": lambda r: contiguous(),
        "memcpy": lambda r: memcpy(),
    }
    names = list(timed)
    for r in range(rounds + 1):  # round 0 warms up
        for name in names[r % len(names) :] + names[: r % len(names)]:
            spent = timed[name](r)
            if r:
                times[name].append(spent)
    for view in views:  # the load wrote what the store read
        assert torch.equal(view[dst], view[src])
    assert worker.refusals.count("copy_failures") == worker.refusals.count("copy_refused") == 0
    worker.shutdown()
    gb = blocks * row / 1e9
    # The contiguous copy a job is held to, each round: the faster of torch's copy_ and a
    # plain memcpy. copy_'s OpenMP threads spin between copies (libgomp's default), and on
    # a machine this busy a copy_ after a spin can run at a third of its speed: a ratio to
    # it alone would credit a job with the baseline's loss.
    best = [min(c, m) for c, m in zip(times["contiguous"], times["memcpy"], strict=True)]
    med = {k: statistics.median(v) for k, v in times.items()}
    fixed = {  # per round: the job's time less its copy's (round 0, the warm-up, left out)
        k: [t - c for t, c in zip(times[k], copies[k][1:], strict=True)] for k in copies
    }
    shares = {
        f"{k}_fixed_share_of_copy": round(
            statistics.median(f / c for f, c in zip(fixed[k], copies[k][1:], strict=True)), 3
        )
        for k in copies
    }
    shares.update({f"{k}_fixed_ms": round(statistics.median(v) * 1e3, 3) for k, v in fixed.items()})
    spread = {  # GB/s of the slowest and the fastest round
        f"{k}_gbps_range": [round(gb / max(v), 2), round(gb / min(v), 2)] for k, v in times.items()
    }
    # Each round's ratio, side by side (the contiguous copy of the same round): the machine's
    # load swings both alike, so their median says more than a ratio of medians.
    per_round = {
        f"{k}_vs_{base}_per_round": round(
            statistics.median(c / t for c, t in zip(against, times[k], strict=True)), 3
        )
        for k in ("store", "load")
        for base, against in (("contiguous", best), ("copy_", times["contiguous"]))
    }
    return {
        **spread,
        **per_round,
        **shares,
        "bw_blocks": blocks,
        "bw_mib": round(blocks * row / 2**20, 1),
        "bw_rounds": rounds,
        "store_gbps": round(gb / med["store"], 2),
        "load_gbps": round(gb / med["load"], 2),
        "contiguous_gbps": round(gb / statistics.median(best), 2),
        "copy__gbps": round(gb / med["contiguous"], 2),
        "memcpy_gbps": round(gb / med["memcpy"], 2),
        "store_vs_contiguous": round(statistics.median(best) / med["store"], 3),
        "load_vs_contiguous": round(statistics.median(best) / med["load"], 3),
        "store_vs_copy_": round(med["contiguous"] / med["store"], 3),
        "load_vs_copy_": round(med["contiguous"] / med["load"], 3),
    }


def copy_paths(views: tuple[torch.Tensor, ...], blocks: int, rounds: int) -> dict[str, float]:
    """The worker layout's CPU copy paths alone, no job around them, side by side, each
    round against a contiguous copy of the same bytes (the faster of ``copy_`` and a
    memcpy, as above; ``*_vs_copy_``: against ``copy_`` alone): what a job runs
    (``store_copy``/``load_copy``: by address through ``kvlife._rowcopy``, streamed from
    ``STREAM_BYTES`` up), torch's ``index_select`` / ``index_copy_`` per view (``*_torch``:
    the copy where the extension is not built), a layer block's rows as 16-byte words in
    order, nothing scattered (``rows_in_order``), and a contiguous copy streamed as the
    large jobs are (``contiguous_streamed``)."""
    layout = BlockViewsLayout(views)
    rng = random.Random(2)
    picked = rng.sample(range(1, int(views[0].shape[0])), 2 * blocks)
    src, dst = torch.tensor(picked[:blocks]), torch.tensor(picked[blocks:])
    host = torch.empty(blocks, layout.page_numel, dtype=torch.int8)
    flat_src = torch.randint(-128, 127, (host.numel(),), dtype=torch.int8)
    flat_dst = torch.empty_like(flat_src)
    np_src = torch.randint(-128, 127, (host.numel(),), dtype=torch.int8).numpy()
    np_dst = np.empty_like(np_src)  # memcpy's own buffers, as in worker_bandwidth
    src_rows = flat_src.view(-1, int(views[0].shape[1])).view(torch.complex128)
    dst_rows = flat_dst.view(-1, int(views[0].shape[1])).view(torch.complex128)
    in_order = torch.arange(src_rows.shape[0])
    whole = [(0, 0, blocks)]
    paths: dict[str, Any] = {
        "store_copy": lambda: layout.gather_runs(src, host, whole),
        "load_copy": lambda: layout.scatter_runs(dst, host, whole),
        "store_torch": lambda: layout._torch_copy(False, src, host),
        "load_torch": lambda: layout._torch_copy(True, dst, host),
        "contiguous": lambda: flat_dst.copy_(flat_src),
        "memcpy": lambda: np.copyto(np_dst, np_src),
        "rows_in_order": lambda: torch.index_select(src_rows, 0, in_order, out=dst_rows),
    }
    piece = 8 << 20
    if _rowcopy is not None and flat_src.numel() % piece == 0:
        starts = np.arange(0, flat_src.numel(), piece, dtype=np.uint64)
        pieces = (
            starts + np.uint64(flat_dst.data_ptr()),
            starts + np.uint64(flat_src.data_ptr()),
            np.array([piece], dtype=np.uint64),
        )
        paths["contiguous_streamed"] = lambda: _rowcopy.copy_rows(*pieces, torch.get_num_threads())
    times: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for r in range(rounds + 1):  # round 0 warms up; each round another order, as above
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            paths[name]()
            if r:
                times[name].append(time.perf_counter() - start)
    copy_, memcpy = times.pop("contiguous"), times.pop("memcpy")
    best = [min(c, m) for c, m in zip(copy_, memcpy, strict=True)]
    return {
        f"{name}_vs_{base}": round(
            statistics.median(c / t for c, t in zip(against, spent, strict=True)), 3
        )
        for name, spent in times.items()
        for base, against in (("contiguous", best), ("copy_", copy_))
    }


def paths_line(paths: dict[str, float]) -> str:
    """One line of :func:`copy_paths`' ratios: to a contiguous copy, and to ``copy_`` alone."""
    return "copy paths alone (per-round ratios to a contiguous copy; to copy_): " + ", ".join(
        f"{name} {v}x ({paths[name + '_vs_copy_']}x)"
        for k, v in paths.items()
        if (name := k.removesuffix("_vs_contiguous")) != k
    )


def realistic_views(layers: int, layer_block_bytes: int, blocks: int) -> tuple[torch.Tensor, ...]:
    """Block views of a realistic KV cache, one ``(num_blocks, layer_block_bytes)`` int8
    tensor per layer as vLLM hands them to a worker (e.g. 32 layers x 64 KiB: 16 tokens x
    8 KV heads x head dim 128 x K,V x bf16), with room for two scattered sets of blocks."""
    # Random bytes, not zeros: an untouched zero tensor's pages all map one zero page, and
    # a store reading them would read from the cache.
    return tuple(
        torch.randint(-128, 127, (2 * blocks + 1, layer_block_bytes), dtype=torch.int8)
        for _ in range(layers)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--host-bytes", type=int, default=64 * 32768)
    parser.add_argument("--bw-blocks", type=int, default=512, help="blocks per bandwidth job")
    parser.add_argument("--bw-rounds", type=int, default=9, help="bandwidth rounds (>= 7)")
    parser.add_argument(
        "--real-blocks",
        type=int,
        default=256,
        help="blocks per job of the realistic shape (32 layers x 64 KiB); 0: skip it",
    )
    parser.add_argument(
        "--real-only", action="store_true", help="the realistic shape alone (no vLLM engine)"
    )
    args = parser.parse_args()
    # The realistic shape first, before vLLM runs in this process (its engine's threads
    # and memory binding stay, and slow every copy measured after it alike).
    realistic: dict[str, float] = {}
    if args.real_blocks:
        views = realistic_views(32, 64 << 10, args.real_blocks)
        real = worker_bandwidth(views, args.real_blocks, max(7, args.bw_rounds))
        paths = copy_paths(views, args.real_blocks, max(7, args.bw_rounds))
        real.update(paths)
        del views
        realistic = {f"real_{k}": v for k, v in real.items()}
        print(
            f"worker, 32 layers x 64 KiB blocks: store {real['store_gbps']} GB/s "
            f"(range {real['store_gbps_range']}), load {real['load_gbps']} GB/s "
            f"(range {real['load_gbps_range']}), contiguous copy {real['contiguous_gbps']} GB/s "
            f"({real['bw_mib']} MiB per job, median of {real['bw_rounds']}): "
            f"store {real['store_vs_contiguous']}x, load {real['load_vs_contiguous']}x "
            f"(median of the rounds' ratios: store {real['store_vs_contiguous_per_round']}x, "
            f"load {real['load_vs_contiguous_per_round']}x; to torch's copy_ alone: store "
            f"{real['store_vs_copy__per_round']}x, load {real['load_vs_copy__per_round']}x)"
        )
        print(paths_line(paths))
    if args.real_only:
        print(json.dumps({**realistic, "torch_threads": torch.get_num_threads()}))
        return
    trace, pages, views = record_trace(args.prompts, args.host_bytes)
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
    bandwidth = worker_bandwidth(views, args.bw_blocks, max(7, args.bw_rounds))
    print(
        f"worker: store {bandwidth['store_gbps']} GB/s, load {bandwidth['load_gbps']} GB/s, "
        f"contiguous copy {bandwidth['contiguous_gbps']} GB/s (copy_ "
        f"{bandwidth['copy__gbps']}, memcpy {bandwidth['memcpy_gbps']}; "
        f"{bandwidth['bw_mib']} MiB per job, median of {bandwidth['bw_rounds']}): store "
        f"{bandwidth['store_vs_contiguous_per_round']}x, load "
        f"{bandwidth['load_vs_contiguous_per_round']}x; fixed cost "
        f"{bandwidth['store_fixed_ms']} / {bandwidth['load_fixed_ms']} ms a job"
    )
    tiny_paths = copy_paths(views, args.bw_blocks, max(7, args.bw_rounds))
    print(paths_line(tiny_paths))
    bandwidth.update({f"alone_{k}": v for k, v in tiny_paths.items()})
    threads = {"torch_threads": torch.get_num_threads()}  # the copies' (and the baseline's)
    print(json.dumps({**result, **bandwidth, **realistic, **threads}))


if __name__ == "__main__":
    main()
