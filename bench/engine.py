"""Scattered-page offload and restore throughput against a contiguous copy of the same bytes (CPU).

Gathers ``--pages`` random device pages of each KV layout into page-major host
rows (store direction), restores them (host -> device, ``scatter``), and
compares each time with one contiguous ``copy_`` of the same number of bytes
(the memory-bandwidth limit of this machine). Variants run interleaved, one of
each per round; the figure is the ratio of medians (contiguous time / variant
time: 1.0 means as fast as a plain copy), with the min and max of the per-round
ratios. Buffers are filled before timing, so no variant reads never-touched
(zero-page) memory. Restores write back the rows gathered from the same pages,
so every layout keeps its contents and is checked bit for bit at the end.

Variants: the layouts' ``gather`` and ``scatter`` (layer-first, page-first,
MLA), a naive layer-first copy (``index_select`` into a temporary, then
``index_copy_``), and the CPU copy engine end to end (submit + drain) for a
store into host pool pages and for a load back out of them.

Run: ``python bench/engine.py`` (about a minute); ``--help`` for the shape.
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kvlife import Lifecycle, LoadTicket, Ticket
from kvlife.engine import CpuCopyEngine
from kvlife.layout import KVLayout, LayerFirstLayout, MLALayout, PageFirstLayout
from kvlife.pool import HostPagePool


def fill(layout: KVLayout) -> None:
    """Touch every byte, each buffer with its own value, so gathers can be checked."""
    for i, buf in enumerate(layout.buffers()):
        buf.fill_(float(i % 97 + 1))


def main() -> None:
    """Run the interleaved benchmark and print a table, then the JSON figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--latent-dim", type=int, default=576, help="MLA latent width")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device-pages", type=int, default=1024)
    parser.add_argument("--pages", type=int, default=256, help="random pages per copy")
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds (>= 7)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.rounds < 7:
        parser.error("--rounds must be at least 7")
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16
    n, device_pages = args.pages, args.device_pages
    shape = (args.layers, device_pages, args.page_size, args.heads, args.head_dim)

    layer_first = LayerFirstLayout.zeros(*shape, dtype=dtype)
    page_first = PageFirstLayout.zeros(*shape, dtype=dtype)
    mla = MLALayout.zeros(args.layers, device_pages, args.page_size, args.latent_dim, dtype=dtype)
    for layout in (layer_first, page_first, mla):
        fill(layout)
    numel = layer_first.page_numel
    g = torch.Generator().manual_seed(args.seed)
    pages = torch.randperm(device_pages, generator=g)[:n]
    out = torch.ones((n, numel), dtype=dtype)
    mla_out = torch.ones((n, mla.page_numel), dtype=dtype)
    src = torch.ones(n * numel, dtype=dtype)
    dst = torch.zeros(n * numel, dtype=dtype)
    mla_numel = n * mla.page_numel
    # Rows to restore: what each layout's pages hold, so a restore changes nothing.
    lf_rows = torch.empty((n, numel), dtype=dtype)
    pf_rows = torch.empty((n, numel), dtype=dtype)
    mla_rows = torch.empty((n, mla.page_numel), dtype=dtype)
    layer_first.gather(pages, lf_rows)
    page_first.gather(pages, pf_rows)
    mla.gather(pages, mla_rows)

    host = HostPagePool(n, numel, dtype, pin_memory=False)
    host.tensor.copy_(lf_rows)  # the engine's store and load rounds move the same bytes
    engine = CpuCopyEngine(layer_first, host)
    page_list = pages.tolist()
    load_keys = [f"k{i}" for i in range(n)]

    def engine_copy(ticket: Ticket | LoadTicket) -> float:
        """One chunk through the CPU engine, submit to ack (a store or a load by its ticket)."""
        host_pages = host.alloc(n, ticket)
        assert host_pages is not None
        start = time.perf_counter()
        engine.submit(ticket, page_list, host_pages)
        (ack,) = engine.drain()
        elapsed = time.perf_counter() - start
        assert ack.ok
        ticket[0].ack(ticket)
        host.free(host_pages, ticket)
        return elapsed

    def engine_round() -> float:
        lc = Lifecycle("bench", page_size=args.page_size)
        return engine_copy(lc.submit([0] * (n * args.page_size)))

    def engine_load_round() -> float:
        return engine_copy(Lifecycle("bench-load", page_size=args.page_size).load(load_keys))

    tmp = torch.empty((n, layer_first.page_rows()[0].shape[1]), dtype=dtype)
    rows_index = torch.arange(n)

    def naive() -> None:
        start = 0
        for row in layer_first.page_rows():
            end = start + row.shape[1]
            torch.index_select(row, 0, pages, out=tmp)
            out[:, start:end].index_copy_(0, rows_index, tmp)
            start = end

    timed: dict[str, tuple[int, Callable[[], object]]] = {
        "contiguous": (n * numel, lambda: dst.copy_(src)),
        "layer_first": (n * numel, lambda: layer_first.gather(pages, out)),
        "page_first": (n * numel, lambda: page_first.gather(pages, out)),
        "contiguous_mla": (mla_numel, lambda: dst[:mla_numel].copy_(src[:mla_numel])),
        "mla": (mla_numel, lambda: mla.gather(pages, mla_out)),
        "naive_layer_first": (n * numel, naive),
        "engine_layer_first": (n * numel, engine_round),
        "layer_first_restore": (n * numel, lambda: layer_first.scatter(pages, lf_rows)),
        "page_first_restore": (n * numel, lambda: page_first.scatter(pages, pf_rows)),
        "mla_restore": (mla_numel, lambda: mla.scatter(pages, mla_rows)),
        "engine_layer_first_load": (n * numel, engine_load_round),
    }
    times: dict[str, list[float]] = {name: [] for name in timed}
    for round_ in range(args.rounds + 1):  # round 0 warms up and is not counted
        for name, (_, run) in timed.items():
            start = time.perf_counter()
            result = run()
            elapsed = result if isinstance(result, float) else time.perf_counter() - start
            if round_:
                times[name].append(elapsed)

    # The copies must be right, or their speed means nothing: every restore wrote
    # back what the pages held, and every gather reads what the pages hold.
    for layout, rows in ((layer_first, lf_rows), (page_first, pf_rows), (mla, mla_rows)):
        for i in range(n):
            assert torch.equal(rows[i], layout.read_page(page_list[i]))
    layer_first.gather(pages, out)
    for i in (0, n // 2, n - 1):
        assert torch.equal(out[i], layer_first.read_page(page_list[i]))
    page_first.gather(pages, out)
    for i in (0, n - 1):
        assert torch.equal(out[i], page_first.read_page(page_list[i]))
    engine.close()

    itemsize = dtype.itemsize
    median = {name: statistics.median(ts) for name, ts in times.items()}
    baseline = {name: "contiguous_mla" if "mla" in name else "contiguous" for name in timed}
    ratio = {name: median[baseline[name]] / median[name] for name in timed}
    per_round = {
        name: [b / t for b, t in zip(times[baseline[name]], ts, strict=True)]
        for name, ts in times.items()
    }
    print(
        f"{args.layers} layers, {args.heads} KV heads, head dim {args.head_dim}, "
        f"page size {args.page_size}, {dtype}, {n} of {device_pages} pages "
        f"({n * numel * itemsize / 2**20:.0f} MiB), {args.threads} thread(s), "
        f"median of {args.rounds} interleaved rounds"
    )
    print(
        f"{'variant':<25}{'MiB':>6}{'median ms':>11}{'min':>8}{'max':>8}{'GB/s':>7}"
        f"{'ratio':>7}{'ratio min..max':>16}"
    )
    for name, ts in times.items():
        nbytes = timed[name][0] * itemsize
        rs = per_round[name]
        print(
            f"{name:<25}{nbytes / 2**20:>6.0f}{median[name] * 1e3:>11.1f}{min(ts) * 1e3:>8.1f}"
            f"{max(ts) * 1e3:>8.1f}{nbytes / median[name] / 1e9:>7.2f}{ratio[name]:>7.2f}"
            f"{min(rs):>10.2f}..{max(rs):.2f}"
        )
    print("store (gather) and restore (scatter) ratios side by side:")
    for kind in ("layer_first", "page_first", "mla"):
        print(f"  {kind:<12} gather {ratio[kind]:.2f}   restore {ratio[kind + '_restore']:.2f}")
    figures = {
        "bench": "engine",
        "layer_first_ratio": round(ratio["layer_first"], 3),
        "page_first_ratio": round(ratio["page_first"], 3),
        "mla_ratio": round(ratio["mla"], 3),
        "naive_layer_first_ratio": round(ratio["naive_layer_first"], 3),
        "engine_layer_first_ratio": round(ratio["engine_layer_first"], 3),
        # Kept for earlier readers: the layer-first restore (``scatter``).
        "layer_first_scatter_ratio": round(ratio["layer_first_restore"], 3),
        **{
            f"restore_ratio_{kind}{suffix}": round(value, 3)
            for kind in ("layer_first", "page_first", "mla")
            for suffix, value in (
                ("", ratio[f"{kind}_restore"]),
                ("_min", min(per_round[f"{kind}_restore"])),
                ("_max", max(per_round[f"{kind}_restore"])),
            )
        },
        "engine_layer_first_load_ratio": round(ratio["engine_layer_first_load"], 3),
        "contiguous_gbps": round(n * numel * itemsize / median["contiguous"] / 1e9, 2),
        "rounds": args.rounds,
        "threads": args.threads,
        "shape": {
            "layers": args.layers,
            "kv_heads": args.heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "pages": n,
            "device_pages": device_pages,
            "dtype": str(dtype),
        },
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
