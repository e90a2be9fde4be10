"""What-if: kvlife's Lifecycle with every check kept but a plain-tuple ticket.

``bench/lifecycle.py`` puts kvlife's bookkeeping at about 1.6x the rid-keyed
dicts (trivial hasher). This script prices the one design choice behind most of
that: the ``Ticket`` NamedTuple. It builds the variant from the real
:meth:`kvlife.Lifecycle.submit` source with one change (the ticket is built as
a plain tuple, same fields, same order), so it cannot drift from the product,
and races it against the Lifecycle and the dicts, interleaved, as the lifecycle
bench does. A plain tuple comes from CPython's tuple free list and is freed
without a subtype's deallocation; a NamedTuple is neither. The variant is not
part of kvlife: engines and users read ``ticket.keys``, ``ticket.seq``, ...

    python bench/plain_ticket.py [--rounds N]

The last line is one JSON object: ratio_vs_dict_baseline_no_hash for both.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import textwrap

from lifecycle import _per_request, run_dict, run_kvlife, trivial_hasher

import kvlife._lifecycle as lifecycle_module
from kvlife import Lifecycle

_NAMED = "_new_ticket(Ticket, (self, seq, first_page, keys))"


def _plain_ticket_lifecycle() -> type[Lifecycle]:
    source = textwrap.dedent(inspect.getsource(Lifecycle.submit))
    if source.count(_NAMED) != 1:
        raise SystemExit(f"Lifecycle.submit no longer builds its ticket as {_NAMED}")
    namespace = dict(vars(lifecycle_module))
    exec(source.replace(_NAMED, "(self, seq, first_page, keys)"), namespace)
    return type(
        "PlainTicketLifecycle", (Lifecycle,), {"__slots__": (), "submit": namespace["submit"]}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    rounds = max(7, parser.parse_args().rounds)
    runs = {
        "kvlife": run_kvlife,
        "plain_ticket": _per_request(_plain_ticket_lifecycle()),
        "dict": run_dict,
    }
    per: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        names = list(runs)[r % 3 :] + list(runs)[: r % 3]
        for name in names:
            gc.collect()
            per[name].append(runs[name](8000, trivial_hasher))
    figures: dict[str, float] = {"rounds": rounds}
    for name in ("kvlife", "plain_ticket"):
        ratio = statistics.median(a / d for a, d in zip(per[name], per["dict"], strict=True))
        figures[f"{name}_ratio_vs_dict_baseline_no_hash"] = round(ratio, 3)
    for name, values in per.items():
        figures[f"us_per_life_{name}_no_hash"] = round(statistics.median(values) * 1e6, 3)
        print(f"{name:<14} {statistics.median(values) * 1e6:8.2f} us/life (trivial hasher)")
    print(json.dumps({"bench": "plain_ticket", **figures}))


if __name__ == "__main__":
    main()
