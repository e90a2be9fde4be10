"""Cost per poll of TorchAgreement against a bare all_reduce of one small tensor (the floor).

N ranks (real processes, one gloo group on 127.0.0.1) run, in the same run,
interleaved (A, B, C, A, B, C, ...), three loops of the same number of polls:

- ``bare``: ``all_reduce(MIN)`` of one int64 tensor of 7 words, nothing else;
- ``idle``: ``TorchAgreement.agree([])`` with nothing submitted (a poll with nothing to do);
- ``busy``: each poll records 2 submissions (real tickets of real Lifecycles)
  and hands in 2 acks of the previous poll's chunks, out of order, then agrees.

A sample is one loop's time per poll on the slowest rank (the group's time),
after a barrier. The figure is the median of the rounds; min and max are shown.

    python bench/distributed.py                 # 2 and 4 ranks
    python bench/distributed.py --worlds 2 --rounds 9

The last line is one JSON object: ratio_vs_bare_allreduce (busy / bare, the
worst over the world sizes), the ratios per world size, and us per poll.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kvlife._lifecycle import Lifecycle, Ticket
from kvlife.distributed import TorchAgreement
from kvlife.engine.base import Ack
from kvlife.pool import HostPagePool
from kvlife.sim.distributed import init_rank, spawn_ranks

PAGE = 16
VARIANTS = ("bare", "idle", "busy")


def _tickets(n: int) -> list[Ticket]:
    """``n`` one-page chunks of real Lifecycles (hashed now, outside the timed loops)."""
    out: list[Ticket] = []
    lc = Lifecycle("bench", page_size=PAGE)
    for i in range(n):
        if i % 64 == 0:
            lc = Lifecycle(f"bench-{i}", page_size=PAGE)
        out.append(lc.submit([(i * 31 + j) % 50_000 for j in range(PAGE)]))
    return out


def _bench_rank(rank: int, world: int, port: int, out_dir: str, polls: int, rounds: int) -> None:
    """One rank: warm up, then ``rounds`` interleaved samples of each variant."""
    torch.set_num_threads(1)
    init_rank(rank, world, port, 120.0)
    host = HostPagePool(64, 8, torch.float32, pin_memory=False)
    idle = TorchAgreement(timeout=120.0, host=host)
    busy = TorchAgreement(timeout=120.0, host=host)
    bare = torch.zeros(7, dtype=torch.int64)
    tickets = _tickets(2 * polls * (rounds + 1) + 2)
    acks = [Ack(t, (0,), (0,)) for t in tickets]
    cursor = 0  # busy: next ticket to submit

    def loop(variant: str) -> float:
        nonlocal cursor
        dist.barrier()
        t0 = time.perf_counter()
        if variant == "bare":
            for _ in range(polls):
                dist.all_reduce(bare, op=dist.ReduceOp.MIN)
        elif variant == "idle":
            for _ in range(polls):
                idle.agree([])
        else:
            for _ in range(polls):
                c = cursor
                busy.submitted(tickets[c])
                busy.submitted(tickets[c + 1])
                busy.agree([acks[c - 1], acks[c - 2]] if c >= 2 else [])
                cursor = c + 2
        return (time.perf_counter() - t0) / polls

    for variant in VARIANTS:  # warm-up round, not recorded
        loop(variant)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]  # rotate: no variant always first
        for variant in order:
            samples[variant].append(loop(variant))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, samples)
    if rank == 0:
        slowest = {v: [max(g[v][i] for g in gathered) for i in range(rounds)] for v in VARIANTS}
        Path(out_dir, "samples.json").write_text(json.dumps(slowest))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def measure(world: int, polls: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per poll of each variant, one sample per round, at ``world`` ranks."""
    with tempfile.TemporaryDirectory(prefix="kvlife-bench-dist-") as out_dir:
        codes = spawn_ranks(_bench_rank, world, out_dir, polls, rounds, join_timeout=600)
        path = Path(out_dir, "samples.json")
        if codes != [0] * world or not path.exists():
            sys.exit(f"{world} ranks failed: exit codes {codes}")
        samples: dict[str, list[float]] = json.loads(path.read_text())
        return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--polls", type=int, default=200, help="polls per sample")
    parser.add_argument("--rounds", type=int, default=9, help="samples per variant (>= 7)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    medians: dict[int, dict[str, float]] = {}
    print(f"{'ranks':>5} {'variant':>8} {'median us/poll':>15} {'min':>10} {'max':>10}")
    for world in args.worlds:
        samples = measure(world, args.polls, args.rounds)
        medians[world] = {}
        for variant in VARIANTS:
            ts = samples[variant]
            med = statistics.median(ts)
            medians[world][variant] = med
            print(
                f"{world:>5} {variant:>8} {med * 1e6:>15.1f} "
                f"{min(ts) * 1e6:>10.1f} {max(ts) * 1e6:>10.1f}"
            )
        m = medians[world]
        print(f"{world:>5} {'ratio':>8} {m['busy'] / m['bare']:>15.3f}  (busy / bare)")
        print(f"{world:>5} {'ratio':>8} {m['idle'] / m['bare']:>15.3f}  (idle / bare)")
    ratios = {str(w): round(m["busy"] / m["bare"], 3) for w, m in medians.items()}
    print(
        json.dumps(
            {
                "ratio_vs_bare_allreduce": max(ratios.values()),
                "ratio_by_world": ratios,
                "idle_ratio_by_world": {
                    str(w): round(m["idle"] / m["bare"], 3) for w, m in medians.items()
                },
                "us_per_poll": {
                    str(w): {v: round(t * 1e6, 1) for v, t in m.items()} for w, m in medians.items()
                },
                "polls_per_sample": args.polls,
                "rounds": args.rounds,
            }
        )
    )


if __name__ == "__main__":
    main()
