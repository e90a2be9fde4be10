"""Cost of one whole request life in kvlife's Lifecycle, rid-keyed dicts, and per-request machines.

One life: create, 8 x (submit one page of 16 tokens, ack it), finish, release
(the release callback runs once). Three variants do exactly that work, with the
same page hasher called with the same arguments per chunk:

* ``kvlife``   -- :class:`kvlife.Lifecycle`;
* ``dict``     -- :class:`RidKeyedBook` (``tests/rid_keyed_manager.py``), rid-keyed dicts;
* ``machine``  -- :class:`MachinePerRequest`, one ``transitions.Machine`` built per request;
* ``unchecked`` -- :class:`UncheckedPerRequest`, one object per request doing kvlife's
  bookkeeping with no checks: what the checks cost on top of the per-request
  object.

Two hashers: ``sglang`` (the real SHA-256 page chain) and ``trivial`` (returns a
constant key per page), so the second pair of figures is the bookkeeping alone.
Variants are interleaved within each round (order rotated per round); each
figure is the median over the rounds, with min and max; ratios are taken per
round (adjacent runs) and their median reported. Memory: tracemalloc over
10,000 live Lifecycles, each with one chunk in flight.

The lifecycle core imports no torch, and neither does this script, so there is
no intra-op thread pool to pin.

    python bench/lifecycle.py              # 9 rounds
    python bench/lifecycle.py --rounds 15
    python bench/lifecycle.py --clock cpu  # this process's CPU time, on a shared machine

The last line is one JSON object: ratio_vs_dict_baseline and
speedup_vs_transitions_machine (sglang hashing), the same two with suffix
``_no_hash`` (trivial hasher), ratio_unchecked_vs_dict_baseline(_no_hash), and
bytes_per_live_lifecycle.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(2, str(Path(__file__).resolve().parents[1]))

from baselines import MachinePerRequest, UncheckedPerRequest
from rid_keyed_manager import RidKeyedBook

from kvlife import Lifecycle
from kvlife.hashing import PageHasher, sglang_page_hashes

PAGE = 16
CHUNKS = 8
#: The tokens of each chunk: one page each, distinct, in range.
CHUNK_TOKENS: list[list[int]] = [list(range(c * PAGE, (c + 1) * PAGE)) for c in range(CHUNKS)]
_CONSTANT_KEY = "0" * 64
LIVE = 10_000


def trivial_hasher(tokens: Sequence[int], page_size: int, prior: str | None) -> list[str]:
    """A constant key per page: takes hashing out of the figure, keeps the call."""
    return [_CONSTANT_KEY] * (len(tokens) // page_size)


def _on_release(_: object) -> None:
    pass


#: The clock the runs read: ``time.perf_counter`` (wall) or ``time.process_time`` (CPU).
CLOCK = time.perf_counter


def _per_request(make: Callable[..., Any]) -> Callable[[int, PageHasher], float]:
    """A run of ``n`` lives of one object per request made by ``make`` (submit, ack, finish)."""

    def run(n: int, hasher: PageHasher) -> float:
        chunks, cb = CHUNK_TOKENS, _on_release
        start = CLOCK()
        for rid in range(n):
            lc = make(rid, page_size=PAGE, on_release=cb, hasher=hasher)
            for tokens in chunks:
                lc.ack(lc.submit(tokens))
            lc.finish()
        return (CLOCK() - start) / n

    return run


#: Seconds per life for ``n`` lives of :class:`kvlife.Lifecycle`.
run_kvlife = _per_request(Lifecycle)
#: Seconds per life for ``n`` lives of the unchecked per-request object.
run_unchecked = _per_request(UncheckedPerRequest)


def run_dict(n: int, hasher: PageHasher) -> float:
    """Seconds per life for ``n`` lives kept in rid-keyed dicts."""
    chunks, cb = CHUNK_TOKENS, _on_release
    book = RidKeyedBook(page_size=PAGE, hasher=hasher)
    start = CLOCK()
    for rid in range(n):
        book.begin(rid, on_release=cb)
        for tokens in chunks:
            book.ack(book.submit(rid, tokens))
        book.finish(rid)
    return (CLOCK() - start) / n


def run_machine(n: int, hasher: PageHasher) -> float:
    """Seconds per life for ``n`` lives, each with its own ``transitions.Machine``."""
    chunks, cb = CHUNK_TOKENS, _on_release
    start = CLOCK()
    for rid in range(n):
        req = MachinePerRequest(rid, page_size=PAGE, on_release=cb, hasher=hasher)
        for tokens in chunks:
            req.complete(req.offload(tokens))
        req.end()
    return (CLOCK() - start) / n


VARIANTS: dict[str, Callable[[int, PageHasher], float]] = {
    "kvlife": run_kvlife,
    "dict": run_dict,
    "machine": run_machine,
    "unchecked": run_unchecked,
}
HASHERS: dict[str, PageHasher] = {"sglang": sglang_page_hashes, "trivial": trivial_hasher}


def _lives_per_run(run: Callable[[int, PageHasher], float], hasher: PageHasher) -> int:
    """Enough lives for a run of about 40 ms."""
    per_life = min(run(20, hasher) for _ in range(3))
    return max(20, int(0.04 / per_life))


def measure(rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per life, per hasher, per variant, one entry per round (variants interleaved)."""
    results: dict[str, dict[str, list[float]]] = {}
    names = list(VARIANTS)
    for hname, hasher in HASHERS.items():
        sizes = {name: _lives_per_run(VARIANTS[name], hasher) for name in names}
        per: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                gc.collect()
                per[name].append(VARIANTS[name](sizes[name], hasher))
        results[hname] = per
    return results


def bytes_per_live(make: Callable[[int], object], n: int) -> float:
    """Traced bytes per live object made by ``make(rid)``, ``n`` alive at once."""
    rids = list(range(n))
    holder: list[object] = [None] * n
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in rids:
            holder[i] = make(i)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return (after - before) / n


def _live_lifecycle(rid: int) -> Lifecycle:
    lc = Lifecycle(rid, page_size=PAGE, on_release=_on_release)
    lc.submit(CHUNK_TOKENS[0])
    return lc


def _live_machine(rid: int) -> MachinePerRequest:
    req = MachinePerRequest(rid, page_size=PAGE, on_release=_on_release)
    req.offload(CHUNK_TOKENS[0])
    return req


def _dict_bytes_per_live(n: int) -> float:
    book = RidKeyedBook(page_size=PAGE)
    jobs: list[object] = [None] * n
    rids = list(range(n))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in rids:
            book.begin(i, on_release=_on_release)
            jobs[i] = book.submit(i, CHUNK_TOKENS[0])
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return (after - before) / n


def _row(label: str, values: list[float], scale: float, unit: str) -> str:
    med = statistics.median(values) * scale
    return (
        f"{label:<28} {med:>10.2f} {min(values) * scale:>10.2f} "
        f"{max(values) * scale:>10.2f}  {unit}"
    )


def main() -> None:
    """Run the rounds, print the table, then the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds (median over them; >= 7)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    rounds = max(7, args.rounds)

    results = measure(rounds)
    print(f"one life = create, {CHUNKS} x (submit 1 page of {PAGE} tokens, ack), finish, release")
    print(f"{rounds} rounds, variants interleaved; median / min / max")
    print(f"{'':<28} {'median':>10} {'min':>10} {'max':>10}")
    figures: dict[str, float] = {}
    for hname, per in results.items():
        for name, values in per.items():
            print(_row(f"{name} [{hname}]", values, 1e6, "us/life"))
        vs_dict = [k / d for k, d in zip(per["kvlife"], per["dict"], strict=True)]
        vs_machine = [m / k for k, m in zip(per["kvlife"], per["machine"], strict=True)]
        unchecked = [u / d for u, d in zip(per["unchecked"], per["dict"], strict=True)]
        print(_row(f"kvlife / dict [{hname}]", vs_dict, 1.0, "x (target <= 1.3)"))
        print(_row(f"machine / kvlife [{hname}]", vs_machine, 1.0, "x (target >= 20)"))
        print(_row(f"unchecked / dict [{hname}]", unchecked, 1.0, "x"))
        suffix = "" if hname == "sglang" else "_no_hash"
        figures[f"ratio_vs_dict_baseline{suffix}"] = round(statistics.median(vs_dict), 3)
        figures[f"ratio_unchecked_vs_dict_baseline{suffix}"] = round(
            statistics.median(unchecked), 3
        )
        figures[f"speedup_vs_transitions_machine{suffix}"] = round(statistics.median(vs_machine), 1)
        for name, values in per.items():
            figures[f"us_per_life_{name}{suffix}"] = round(statistics.median(values) * 1e6, 3)

    per_lifecycle = bytes_per_live(_live_lifecycle, LIVE)
    per_dict = _dict_bytes_per_live(LIVE)
    per_machine = bytes_per_live(_live_machine, LIVE // 10)
    print(
        f"live, one chunk in flight: kvlife {per_lifecycle:.0f} B (target <= 1024), "
        f"dict {per_dict:.0f} B, machine {per_machine:.0f} B per request"
    )
    figures["bytes_per_live_lifecycle"] = round(per_lifecycle)
    figures["bytes_per_live_dict_request"] = round(per_dict)
    figures["bytes_per_live_machine_request"] = round(per_machine)
    figures["rounds"] = rounds
    print(json.dumps({"bench": "lifecycle", **figures, "clock": args.clock}))


if __name__ == "__main__":
    main()
