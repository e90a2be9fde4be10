"""Per-step bookkeeping cost of kvlife's OffloadManager against a rid-keyed dict manager.

The dict manager is the one straw man, ``tests/rid_keyed_manager.py``.

Both run the same decode loop over the same null copy engine and null store
(every chunk completes at the next poll, every write at the one after), so the
figure is bookkeeping only: stride policy, hashing, host allocation, acks,
store hand-off, release. Stride = page size 16: about one request in 16
submits and one acks per step. Variants are interleaved (A, B, A, B, ...);
the median of the rounds is the figure.

    python bench/manager.py            # 1k, 4k, 16k concurrent requests
    python bench/manager.py --quick    # smaller, for a smoke run

The last line is one JSON object: ratio_vs_dict_baseline (at 4k),
scaling_16k_over_1k (kvlife per-step time at 16k / at 1k; linear is 16), and
the same for the dict baseline. The heap is frozen after warm-up (gc.freeze),
as serving engines do, so that full collections do not dominate at 16k.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rid_keyed_manager import RidKeyedManager

from kvlife.engine.base import Ack
from kvlife.manager import OffloadManager
from kvlife.pool import HostPagePool
from kvlife.store.base import StoreResult

PAGE = 16
MAX_LEN = 160  # a request finishes at this many tokens and a new one takes its place


class NullEngine:
    """Completes every chunk at the next poll; copies nothing."""

    def __init__(self) -> None:
        self.submitted: list[Ack] = []

    def check(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        pass

    def submit(self, ticket: Any, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        self.submitted.append(Ack(ticket, tuple(device_pages), tuple(host_pages)))

    def poll(self) -> list[Ack]:
        done, self.submitted = self.submitted, []
        return done

    def drain(self, timeout: float | None = None) -> list[Ack]:
        return self.poll()

    @property
    def inflight(self) -> int:
        return len(self.submitted)


class NullStore:
    """Completes every put at the next poll; keeps nothing."""

    def __init__(self) -> None:
        self.puts: list[StoreResult] = []

    def put(self, token: object, keys: Sequence[str], pages: torch.Tensor) -> None:
        self.puts.append(StoreResult(token, tuple(keys)))

    def poll(self) -> list[StoreResult]:
        done, self.puts = self.puts, []
        return done

    def drain(self, timeout: float | None = None) -> list[StoreResult]:
        return self.poll()

    @property
    def pending(self) -> int:
        return len(self.puts)


def run(kind: str, n_requests: int, steps: int) -> float:
    """Seconds per decode step (median-free: one measured run of ``steps``)."""
    host = HostPagePool(max(64, n_requests // 4), 8, torch.float32, pin_memory=False)
    engine, store = NullEngine(), NullStore()
    released = [0]

    def on_release(*_: object) -> None:
        released[0] += 1

    mgr: Any
    if kind == "kvlife":
        mgr = OffloadManager(engine, host, store, page_size=PAGE)  # type: ignore[arg-type]
    else:
        mgr = RidKeyedManager(engine, host, store, page_size=PAGE)
    device_pages = list(range(MAX_LEN // PAGE + 1))
    handles: list[Any] = []
    tokens: list[list[int]] = []
    for i in range(n_requests):
        rid = f"rid{i % 97}" if kind == "kvlife" else f"rid{i}"  # the dict baseline cannot reuse
        prompt = [(i + j) % 30_000 for j in range(PAGE + (i % PAGE))]
        lc = mgr.start(rid, prompt, on_release)
        handles.append(lc if kind == "kvlife" else rid)
        tokens.append([*prompt, 1])
    next_rid = n_requests
    # Warm up so every request is mid-life and submissions spread evenly over steps.
    t0 = 0.0
    for step in range(steps * 2):
        if step == steps:
            # Serving engines freeze the heap after warm-up (gc.freeze) so that
            # full collections do not rescan every live request each time: without
            # it, collection cost grows with the live heap and both variants scale
            # super-linearly for reasons that are not their bookkeeping.
            gc.collect()
            gc.freeze()
            t0 = time.perf_counter()
        token = step % 30_000  # one int object per step: the loop measures bookkeeping,
        for i in range(n_requests):  # not the allocation of 16k fresh ints
            toks = tokens[i]
            toks.append(token)
            mgr.offload(handles[i], toks, device_pages)
            if len(toks) >= MAX_LEN:
                mgr.finish(handles[i])
                rid = f"rid{next_rid}"
                next_rid += 1
                prompt = toks[:PAGE]
                lc = mgr.start(rid, prompt, on_release)
                handles[i] = lc if kind == "kvlife" else rid
                tokens[i] = [*prompt, 1]
        mgr.poll()
    elapsed = time.perf_counter() - t0
    gc.unfreeze()
    return elapsed / steps


def measure(n_requests: int, steps: int, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"kvlife": [], "dict": []}
    for _ in range(rounds):
        for kind in ("kvlife", "dict"):
            times[kind].append(run(kind, n_requests, steps))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes for a smoke run")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = (256, 1024, 4096) if args.quick else (1024, 4096, 16384)
    steps = 16 if args.quick else 48
    medians: dict[int, dict[str, float]] = {}
    print(f"{'requests':>9} {'variant':>8} {'median us/step':>15} {'min':>10} {'max':>10}")
    for n in sizes:
        times = measure(n, steps, args.rounds)
        medians[n] = {}
        for kind, ts in times.items():
            med = statistics.median(ts)
            medians[n][kind] = med
            print(
                f"{n:>9} {kind:>8} {med * 1e6:>15.1f} {min(ts) * 1e6:>10.1f} {max(ts) * 1e6:>10.1f}"
            )
        print(f"{n:>9} {'ratio':>8} {medians[n]['kvlife'] / medians[n]['dict']:>15.3f}")
    mid, small, large = sizes[1], sizes[0], sizes[2]
    print(
        json.dumps(
            {
                "ratio_vs_dict_baseline": round(medians[mid]["kvlife"] / medians[mid]["dict"], 3),
                "ratio_at": mid,
                "scaling_16k_over_1k": round(
                    medians[large]["kvlife"] / medians[small]["kvlife"], 2
                ),
                "dict_scaling_16k_over_1k": round(
                    medians[large]["dict"] / medians[small]["dict"], 2
                ),
                "scaling_sizes": [small, large],
                "us_per_step": {str(n): round(m["kvlife"] * 1e6, 1) for n, m in medians.items()},
                "rounds": args.rounds,
            }
        )
    )


if __name__ == "__main__":
    main()
