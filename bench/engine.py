"""Scattered-page offload throughput against a contiguous copy of the same bytes (CPU).

Gathers ``--pages`` random device pages of each KV layout into page-major host
rows and compares the time with one contiguous ``copy_`` of the same number of
bytes (the memory-bandwidth limit of this machine). Variants run interleaved,
one of each per round; the figure is the ratio of medians (contiguous time /
variant time: 1.0 means as fast as a plain copy). Buffers are filled before
timing, so no variant reads never-touched (zero-page) memory.

Variants: the layouts' ``gather`` (layer-first, page-first, MLA), a naive
layer-first copy (``index_select`` into a temporary, then ``index_copy_``),
the CPU copy engine end to end (submit + drain into host pool pages), and
layer-first ``scatter`` (restore) for reference.

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

from kvlife import Lifecycle
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

    layer_first = LayerFirstLayout(*shape, dtype=dtype)
    page_first = PageFirstLayout(*shape, dtype=dtype)
    mla = MLALayout(args.layers, device_pages, args.page_size, args.latent_dim, dtype=dtype)
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
    restored = LayerFirstLayout(*shape, dtype=dtype)
    fill(restored)

    host = HostPagePool(n, numel, dtype, pin_memory=False)
    host.tensor.fill_(1.0)
    engine = CpuCopyEngine(layer_first, host)
    page_list = pages.tolist()

    def engine_round() -> float:
        lc = Lifecycle("bench", page_size=args.page_size)
        ticket = lc.submit([0] * (n * args.page_size))
        host_pages = host.alloc(n, ticket)
        assert host_pages is not None
        start = time.perf_counter()
        engine.submit(ticket, page_list, host_pages)
        (ack,) = engine.drain()
        elapsed = time.perf_counter() - start
        assert ack.ok
        host.free(host_pages, ticket)
        return elapsed

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
        "layer_first_scatter": (n * numel, lambda: restored.scatter(pages, out)),
    }
    times: dict[str, list[float]] = {name: [] for name in timed}
    for round_ in range(args.rounds + 1):  # round 0 warms up and is not counted
        for name, (_, run) in timed.items():
            start = time.perf_counter()
            result = run()
            elapsed = result if isinstance(result, float) else time.perf_counter() - start
            if round_:
                times[name].append(elapsed)

    # The gathers must be right, or their speed means nothing.
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
    print(
        f"{args.layers} layers, {args.heads} KV heads, head dim {args.head_dim}, "
        f"page size {args.page_size}, {dtype}, {n} of {device_pages} pages "
        f"({n * numel * itemsize / 2**20:.0f} MiB), {args.threads} thread(s), "
        f"median of {args.rounds} interleaved rounds"
    )
    print(f"{'variant':<22}{'MiB':>7}{'median ms':>11}{'min':>9}{'max':>9}{'GB/s':>8}{'ratio':>8}")
    for name, ts in times.items():
        nbytes = timed[name][0] * itemsize
        print(
            f"{name:<22}{nbytes / 2**20:>7.0f}{median[name] * 1e3:>11.1f}{min(ts) * 1e3:>9.1f}"
            f"{max(ts) * 1e3:>9.1f}{nbytes / median[name] / 1e9:>8.2f}{ratio[name]:>8.2f}"
        )
    figures = {
        "bench": "engine",
        "layer_first_ratio": round(ratio["layer_first"], 3),
        "page_first_ratio": round(ratio["page_first"], 3),
        "mla_ratio": round(ratio["mla"], 3),
        "naive_layer_first_ratio": round(ratio["naive_layer_first"], 3),
        "engine_layer_first_ratio": round(ratio["engine_layer_first"], 3),
        "layer_first_scatter_ratio": round(ratio["layer_first_scatter"], 3),
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
