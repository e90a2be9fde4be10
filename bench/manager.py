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
    python bench/manager.py --loads    # the load half in the loop too (both variants)

With ``--loads`` every request that finishes comes back as a returning conversation: its
first four pages are its prompt, looked up and loaded back from the host tier (kvlife:
``keep_on_host``, ``lookup`` and ``load``; the dict baseline: a key -> host page dict
with pin counts, the hand-written host cache), and prompts start under a page so that
every page is offloaded.

The last line is one JSON object: ratio_vs_dict_baseline (at 4k),
scaling_16k_over_1k (kvlife per-step time at 16k / at 1k; linear is 16), and
the same for the dict baseline, and the per-round ratio at 4k (each round's kvlife
over its adjacent dict run: median, min, max). The heap is frozen after warm-up
(gc.freeze), as serving engines do, so that full collections do not dominate at 16k.
``--clock cpu`` times this process's CPU (``time.process_time``) instead of the wall
clock: on a machine shared with other work it leaves out the time another process
held the core (one intra-op thread, so CPU time is the loop's own).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rid_keyed_manager import RidKeyedManager

from kvlife.engine.base import Ack
from kvlife.hashing import sglang_page_hashes
from kvlife.manager import OffloadManager
from kvlife.pool import HostPagePool
from kvlife.store.base import StoreResult

PAGE = 16
MAX_LEN = 160  # a request finishes at this many tokens and a new one takes its place


class NullEngine:
    """Completes every chunk at the next poll; copies nothing."""

    def __init__(self) -> None:
        self.submitted: list[Ack] = []

    def check(self, device_pages: Sequence[int], host_pages: Sequence[int], **_: Any) -> None:
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
    """Completes every put at the next poll; keeps nothing (a host tier serves the loads)."""

    def contains(self, key: str) -> bool:
        return False

    def get(self, key: str) -> bytes | None:
        return None

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


class DictLoadManager(RidKeyedManager):
    """The dict baseline with a load half: written pages kept in a key -> host page dict
    (least recently used first, evicted for room), a pin count per key while a load reads
    it, loads of the leading cached pages of a prompt."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache: OrderedDict[str, int] = OrderedDict()
        self.pins: dict[str, int] = {}
        self.loading: dict[int, list[str]] = {}

    def offload(self, rid: object, tokens: Sequence[int], device_pages: Sequence[int]) -> object:
        if not self.host.num_free:  # room for a chunk: evict the oldest unpinned cached page
            for key in self.cache:
                if not self.pins.get(key):
                    self.host.free([self.cache.pop(key)], owner=self)
                    break
        return super().offload(rid, tokens, device_pages)

    def load(self, prompt: Sequence[int], device_pages: Sequence[int]) -> object:
        full = len(prompt) // self.page_size * self.page_size
        keys = sglang_page_hashes(prompt[:full], self.page_size, None) if full else []
        ready: list[str] = []
        for key in keys:
            if key not in self.cache:
                break
            self.cache.move_to_end(key)
            self.pins[key] = self.pins.get(key, 0) + 1
            ready.append(key)
        if not ready:
            return None
        job = self.next_job
        self.next_job += 1
        self.loading[job] = ready
        pages = [self.cache[k] for k in ready]
        self.engine.submit((_LOAD, job, tuple(ready), 0), device_pages[: len(ready)], pages)
        return job

    def poll(self) -> None:
        for ack in self.engine.poll():
            ready = self.loading.pop(ack.seq, None) if ack.ticket[0] is _LOAD else None
            if ready is None:
                self._apply(ack)
                continue
            for key in ready:
                left = self.pins[key] - 1
                if left:
                    self.pins[key] = left
                else:
                    del self.pins[key]
        for result in self.store.poll():
            pages = result.token
            for key, page in zip(result.keys, pages, strict=True):
                if key in self.cache:
                    self.host.free([page], owner=self)
                else:
                    self.cache[key] = page


_LOAD = object()  # the dict baseline's load tickets carry this instead of a Lifecycle


#: The clock the runs read: ``time.perf_counter`` (wall) or ``time.process_time`` (CPU).
CLOCK = time.perf_counter


def run(kind: str, n_requests: int, steps: int, loads: bool = False) -> float:
    """Seconds per decode step (median-free: one measured run of ``steps``)."""
    # With loads the host tier holds every request's pages, so a conversation's prefix is
    # still there when it returns (the loads are the point); else a small pool.
    pages = n_requests * (MAX_LEN // PAGE + 2) if loads else max(64, n_requests // 4)
    host = HostPagePool(pages, 8, torch.float32, pin_memory=False)
    engine, store = NullEngine(), NullStore()
    released = [0]

    def on_release(*_: object) -> None:
        released[0] += 1

    mgr: Any
    if kind == "kvlife":
        mgr = OffloadManager(engine, host, store, page_size=PAGE, keep_on_host=loads)  # type: ignore[arg-type]
    else:
        mgr = (DictLoadManager if loads else RidKeyedManager)(engine, host, store, page_size=PAGE)
    device_pages = list(range(MAX_LEN // PAGE + 1))
    handles: list[Any] = []
    tokens: list[list[int]] = []
    for i in range(n_requests):
        rid = f"rid{i % 97}" if kind == "kvlife" else f"rid{i}"  # the dict baseline cannot reuse
        length = 1 + i % (PAGE - 1) if loads else PAGE + (i % PAGE)  # loads: all offloaded
        prompt = [(i + j) % 30_000 for j in range(length)]
        lc = mgr.start(rid, prompt, on_release)
        handles.append(lc if kind == "kvlife" else rid)
        # With loads, lives start at staggered lengths, so that some finish (and return) at
        # every step of the measured window, not only after MAX_LEN steps.
        decoded = [1] * (i * 7 % (MAX_LEN - 4 * PAGE)) if loads else []
        tokens.append([*prompt, *decoded, 1])
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
            t0 = CLOCK()
        token = step % 30_000  # one int object per step: the loop measures bookkeeping,
        for i in range(n_requests):  # not the allocation of 16k fresh ints
            toks = tokens[i]
            toks.append(token)
            mgr.offload(handles[i], toks, device_pages)
            if len(toks) >= MAX_LEN:
                mgr.finish(handles[i])
                rid = f"rid{next_rid}"
                next_rid += 1
                prompt = toks[: 4 * PAGE] if loads else toks[:PAGE]  # loads: a returning one
                lc = mgr.start(rid, prompt, on_release)
                handles[i] = lc if kind == "kvlife" else rid
                tokens[i] = [*prompt, 1]
                if loads:
                    if kind == "kvlife":
                        mgr.lookup(prompt)
                        mgr.load(lc, device_pages)
                    else:
                        mgr.load(prompt, device_pages)
        mgr.poll()
    elapsed = CLOCK() - t0
    gc.unfreeze()
    return elapsed / steps


def measure(n_requests: int, steps: int, rounds: int, loads: bool) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"kvlife": [], "dict": []}
    for _ in range(rounds):
        for kind in ("kvlife", "dict"):
            times[kind].append(run(kind, n_requests, steps, loads))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes for a smoke run")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--loads", action="store_true", help="returning conversations loaded")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    sizes = (256, 1024, 4096) if args.quick else (1024, 4096, 16384)
    steps = 16 if args.quick else 48
    medians: dict[int, dict[str, float]] = {}
    per_round: dict[int, list[float]] = {}
    print(f"{'requests':>9} {'variant':>8} {'median us/step':>15} {'min':>10} {'max':>10}")
    for n in sizes:
        times = measure(n, steps, args.rounds, args.loads)
        medians[n] = {}
        for kind, ts in times.items():
            med = statistics.median(ts)
            medians[n][kind] = med
            print(
                f"{n:>9} {kind:>8} {med * 1e6:>15.1f} {min(ts) * 1e6:>10.1f} {max(ts) * 1e6:>10.1f}"
            )
        per_round[n] = [k / d for k, d in zip(times["kvlife"], times["dict"], strict=True)]
        print(
            f"{n:>9} {'ratio':>8} {medians[n]['kvlife'] / medians[n]['dict']:>15.3f}"
            f"  per round: median {statistics.median(per_round[n]):.3f}, "
            f"min {min(per_round[n]):.3f}, max {max(per_round[n]):.3f}"
        )
    mid, small, large = sizes[1], sizes[0], sizes[2]
    print(
        json.dumps(
            {
                "ratio_vs_dict_baseline": round(medians[mid]["kvlife"] / medians[mid]["dict"], 3),
                "ratio_at": mid,
                "ratio_per_round": round(statistics.median(per_round[mid]), 3),
                "ratio_per_round_min": round(min(per_round[mid]), 3),
                "ratio_per_round_max": round(max(per_round[mid]), 3),
                "clock": args.clock,
                "scaling_16k_over_1k": round(
                    medians[large]["kvlife"] / medians[small]["kvlife"], 2
                ),
                "dict_scaling_16k_over_1k": round(
                    medians[large]["dict"] / medians[small]["dict"], 2
                ),
                "scaling_sizes": [small, large],
                "us_per_step": {str(n): round(m["kvlife"] * 1e6, 1) for n, m in medians.items()},
                "rounds": args.rounds,
                "loads": args.loads,
            }
        )
    )


if __name__ == "__main__":
    main()
