"""What the plain-tuple ``Ticket`` saves: kvlife's Lifecycle against the same Lifecycle
with a NamedTuple ticket, and against the rid-keyed dicts.

A chunk :data:`kvlife.Ticket` is a plain tuple ``(lifecycle, seq, keys, first_page)``.
Until this choice it was a NamedTuple with the same fields, and that cost most of
the gap between the Lifecycle and hand-written dicts: a plain tuple comes from
CPython's tuple free list and is freed without a subtype's deallocation; a
NamedTuple instance is neither. This script keeps the choice priced. It builds the
NamedTuple variant from the real :meth:`kvlife.Lifecycle.submit` source with one
change (the ticket is built as a NamedTuple, same fields, same order), so it
cannot drift from the product, and races the three interleaved, as the lifecycle
bench does (trivial hasher: bookkeeping alone).

    python bench/named_ticket.py [--rounds N]

The last line is one JSON object: ratio_vs_dict_baseline_no_hash for both.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import textwrap
from typing import NamedTuple

from lifecycle import _per_request, run_dict, run_kvlife, trivial_hasher

import kvlife._lifecycle as lifecycle_module
from kvlife import Lifecycle

_PLAIN = "ticket = (self, seq, keys, first_page)"


class NamedTicket(NamedTuple):
    """The ticket as it was: the same four fields, in the same order, with names."""

    lifecycle: Lifecycle
    seq: int
    keys: tuple[str, ...]
    first_page: int


def _named_ticket_lifecycle() -> type[Lifecycle]:
    source = textwrap.dedent(inspect.getsource(Lifecycle.submit))
    if source.count(_PLAIN) != 1:
        raise SystemExit(f"Lifecycle.submit no longer builds its ticket as {_PLAIN}")
    namespace = {**vars(lifecycle_module), "NamedTicket": NamedTicket}
    named = "ticket = _new_ticket(NamedTicket, (self, seq, keys, first_page))"
    exec(source.replace(_PLAIN, named), namespace)
    return type(
        "NamedTicketLifecycle", (Lifecycle,), {"__slots__": (), "submit": namespace["submit"]}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    rounds = max(7, parser.parse_args().rounds)
    runs = {
        "kvlife": run_kvlife,
        "named_ticket": _per_request(_named_ticket_lifecycle()),
        "dict": run_dict,
    }
    per: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        names = list(runs)[r % 3 :] + list(runs)[: r % 3]
        for name in names:
            gc.collect()
            per[name].append(runs[name](8000, trivial_hasher))
    figures: dict[str, float] = {"rounds": rounds}
    for name in ("kvlife", "named_ticket"):
        ratio = statistics.median(a / d for a, d in zip(per[name], per["dict"], strict=True))
        figures[f"{name}_ratio_vs_dict_baseline_no_hash"] = round(ratio, 3)
    for name, values in per.items():
        figures[f"us_per_life_{name}_no_hash"] = round(statistics.median(values) * 1e6, 3)
        print(f"{name:<14} {statistics.median(values) * 1e6:8.2f} us/life (trivial hasher)")
    print(json.dumps({"bench": "named_ticket", **figures}))


if __name__ == "__main__":
    main()
