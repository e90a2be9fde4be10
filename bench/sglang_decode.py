"""Per-step cost of kvlife's decode offload manager for SGLang against SGLang's own, on the
same recorded scheduler calls.

One seeded workload is recorded once: ``--running`` requests decode one token per step
(rids reused: a finished request's rid goes to the next one), each finishing at a seeded
length. Each run replays it on a fresh manager through the calls SGLang's scheduler makes:
``offload_kv_cache(req)`` for every running request, ``offload_kv_cache`` then
``finalize_release_on_finish`` at finish, ``check_offload_progress()`` once per step. Only
those calls are timed; the cache controller is a stand-in whose copies and backups complete
at once and cost the same for both, so the figure is the managers' bookkeeping. The two
managers run interleaved, median of ``--rounds`` runs each with min and max. SGLang's real
``Req`` and ``ReqToTokenPool``; needs .venv-sglang.

Run: python bench/sglang_decode.py   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import time
from array import array
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import sglang_stubs

sglang_stubs.install()

from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from kvlife.integrations.sglang_decode import decode_manager_class  # noqa: E402


class _Done:
    def synchronize(self) -> None:
        return None


class _Ack:
    __slots__ = ("finish_event", "node_ids")

    def __init__(self, node_id: int) -> None:
        self.finish_event, self.node_ids = _Done(), [node_id]


class _Op:
    __slots__ = ("id",)

    def __init__(self, op_id: int) -> None:
        self.id = op_id


class InstantController:
    """Copies and backups that complete at once: the same few operations for both managers."""

    def __init__(self) -> None:
        self.ack_write_queue: list[_Ack] = []
        self.ack_backup_queue: queue.Queue[_Op] = queue.Queue()
        self.get_hash_str = get_hash_str
        self._ops = 0

    writes = 0

    def write(
        self, device_indices: Any, priority: Any = None, node_id: int = -1, extra_pools: Any = None
    ) -> Any:
        self.writes += 1
        self.ack_write_queue.append(_Ack(node_id))
        return device_indices

    def write_storage(
        self,
        host_indices: Any,
        token_ids: Any,
        hash_value: Any = None,
        prefix_keys: Any = None,
        extra_pools: Any = None,
    ) -> int:
        self._ops += 1
        self.ack_backup_queue.put_nowait(_Op(self._ops))
        return self._ops


class HostPool:
    def available_size(self) -> int:
        return 1 << 30

    def free(self, indices: Any) -> None:
        return None

    def destroy(self) -> None:
        return None


class Allocator:
    def free(self, indices: Any) -> None:
        return None


class Tree:
    def free_kv_row(self, kv: Any, ranges: Any) -> None:
        return None

    def unlock(self, lock: Any) -> None:
        return None


def record(args: argparse.Namespace) -> list[list[tuple[str, int, int]]]:
    """Per step: ("start", slot, prompt_len) / ("finish", slot, 0) and the running slots."""
    rng = random.Random(args.seed)
    steps: list[list[tuple[str, int, int]]] = []
    left = [0] * args.running
    for _ in range(args.steps):
        events = []
        for slot in range(args.running):
            if left[slot] == 0:
                left[slot] = rng.randint(args.min_len, args.max_len)
                events.append(("start", slot, rng.randint(20, 200)))
            left[slot] -= 1
            events.append(("finish" if left[slot] == 0 else "step", slot, 0))
        steps.append(events)
    return steps


def run(
    kvlife: bool, steps: list[list[tuple[str, int, int]]], args: argparse.Namespace
) -> tuple[float, int]:
    """Replay ``steps`` on a fresh manager: the per-step cost of its calls (microseconds)
    and the number of chunks it submitted."""
    ps = args.page_size
    rows = ReqToTokenPool(
        size=args.running * 2, max_context_len=4096, device="cpu", enable_memory_saver=False
    )
    rows.req_to_token[:] = torch.arange(4096, dtype=torch.int32)
    parts: dict[str, Any] = dict(
        req_to_token_pool=rows,
        token_to_kv_pool_allocator=Allocator(),
        tree_cache=Tree(),
        cache_controller=InstantController(),
        host_pool=HostPool(),
        page_size=ps,
        stride=ps,
    )
    mgr: Any = sglang_stubs.sglang_own_manager(decode_manager_class() if kvlife else None, **parts)
    if kvlife:
        mgr._init_kvlife(strict=False)
    running: list[Any] = [None] * args.running
    rng = random.Random(args.seed + 1)
    elapsed = 0.0
    for events in steps:
        calls: list[tuple[Any, bool]] = []
        for kind, slot, n in events:  # the scheduler's own work, untimed
            if kind == "start":
                req = Req(
                    f"r{slot}",
                    "",
                    array("q", (rng.randrange(32000) for _ in range(n))),
                    SamplingParams(max_new_tokens=1 << 20),
                )
                req.kv.req_pool_idx = rows.alloc_rows(1)[0]  # type: ignore[index]
                req.output_ids.append(1)
                running[slot] = req
            req = running[slot]
            req.output_ids.append(rng.randrange(32000))
            if kind == "finish":
                req.finished_reason = FINISH_LENGTH(len(req.output_ids))
            calls.append((req, kind == "finish"))
        t0 = time.perf_counter()
        for req, done in calls:  # what SGLang's scheduler calls, timed
            if done:
                if not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
            else:
                mgr.offload_kv_cache(req)
        mgr.check_offload_progress()
        elapsed += time.perf_counter() - t0
        for req, done in calls:
            if done and req.kv.req_pool_idx:
                rows.free_rows([req.kv.req_pool_idx])
    return elapsed / len(steps) * 1e6, parts["cache_controller"].writes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=20)
    parser.add_argument("--max-len", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = record(args)
    times: dict[str, list[float]] = {"sglang": [], "kvlife": []}
    chunks: dict[str, set[int]] = {"sglang": set(), "kvlife": set()}
    run(True, steps[:20], args), run(False, steps[:20], args)  # warm up
    for _ in range(args.rounds):
        for name in ("sglang", "kvlife"):
            us, n = run(name == "kvlife", steps, args)
            times[name].append(us)
            chunks[name].add(n)
    if chunks["sglang"] != chunks["kvlife"] or len(chunks["kvlife"]) != 1:
        raise SystemExit(f"the managers submitted different chunks: {chunks}")
    out: dict[str, Any] = {
        "running": args.running,
        "steps": args.steps,
        "page_size": args.page_size,
        "chunks_per_run": next(iter(chunks["kvlife"])),
        "rounds": args.rounds,
    }
    for name, ts in times.items():
        med = statistics.median(ts)
        out[f"{name}_us_per_step"] = round(med, 2)
        out[f"{name}_range"] = [round(min(ts), 2), round(max(ts), 2)]
        print(f"{name:7s} {med:8.1f} us/step  (min {min(ts):.1f}, max {max(ts):.1f})")
    out["ratio"] = round(out["kvlife_us_per_step"] / out["sglang_us_per_step"], 3)
    print(f"kvlife / SGLang: {out['ratio']:.3f}x (target <= 1.1x)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
