"""One prepared check of the CUDA copy engine on a lent GPU: correctness, D2H/H2D GB/s, overlap.

Three parts, under five minutes in all (a deadline skips what is left), and a
shared-file host pool page-locked in chunks (``page_lock``) through a store and a load:

1. correctness: every layout x dtype, scattered host pages, small staging
   windows, and a copy submitted right behind a write on a busy compute
   stream; bit-exact against the device pages; then a load (``LoadTicket``,
   host -> device) of those host pages into other device pages, submitted
   behind a write into one of them on a busy compute stream, read back on the
   compute stream after the ack: bit-exact against the stored pages;
2. D2H and H2D throughput: random pages of a realistic model shape through the
   engine (submit + drain; stores and loads) against a pinned contiguous
   ``copy_`` of the same bytes in the same direction, interleaved, median of 9
   rounds;
3. overlap: a chunk copy alongside matmuls on the compute stream;
   ``overlap = (t_copy + t_compute - t_both) / min(t_copy, t_compute)``
   (1.0: fully hidden, 0.0: serialised).

Run: ``python bench/gpu_check.py``. Without CUDA it says so and exits 0.
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from kvlife import Lifecycle, LoadTicket, Ticket
from kvlife.engine import CudaCopyEngine
from kvlife.layout import KVLayout, LayerFirstLayout, MLALayout, PageFirstLayout
from kvlife.pool import HostPagePool, page_lock, page_unlock

DEADLINE_S = 270.0
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_START = time.perf_counter()


def left() -> float:
    """Seconds left before the deadline."""
    return DEADLINE_S - (time.perf_counter() - _START)


def fill_random_bits(layout: KVLayout, seed: int) -> None:
    """Every bit pattern, so the check proves bits move, not values."""
    g = torch.Generator(device=layout.device).manual_seed(seed)
    for buf in layout.buffers():
        view = buf.view(BITS[layout.dtype])
        info = torch.iinfo(view.dtype)
        view.copy_(
            torch.randint(
                info.min, info.max, view.shape, generator=g, dtype=view.dtype, device=view.device
            )
        )


def ticket_for(n_pages: int, page_size: int) -> Ticket:
    """A fresh Lifecycle's ticket for one chunk of ``n_pages``."""
    return Lifecycle("gpu-check", page_size=page_size).submit([0] * (n_pages * page_size))


def check_correctness() -> tuple[bool, list[str]]:
    """Bit-exact engine copies for every layout x dtype; returns (all ok, failures)."""
    failures: list[str] = []
    page = 8
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        makers: dict[str, Callable[[torch.dtype], KVLayout]] = {
            "layer_first": lambda d: LayerFirstLayout.zeros(4, 64, page, 4, 64, d, "cuda"),
            "page_first": lambda d: PageFirstLayout.zeros(4, 64, page, 4, 64, d, "cuda"),
            "mla": lambda d: MLALayout.zeros(4, 64, page, 576, d, "cuda"),
        }
        for kind, make in makers.items():
            layout = make(dtype)
            fill_random_bits(layout, seed=1)
            host = HostPagePool(32, layout.page_numel, dtype, pin_memory=True)
            engine = CudaCopyEngine(layout, host, max_staging_bytes=3 * layout.page_nbytes)
            owner = object()
            host.alloc(32, owner)
            host.free([9, 3, 4, 5, 20, 21, 0, 31], owner)  # runs: 9 | 3 4 5 | 20 21 | 0 | 31
            device_pages = [63, 2, 17, 5, 40, 41, 0, 33]
            ticket = ticket_for(8, page)
            host_pages = host.alloc(8, ticket)
            assert host_pages is not None
            engine.submit(ticket, device_pages, host_pages)
            (ack,) = engine.drain()
            ok = ack.ok and all(
                torch.equal(
                    host.page(h).view(BITS[dtype]), layout.read_page(d).cpu().view(BITS[dtype])
                )
                for d, h in zip(device_pages, host_pages, strict=True)
            )
            # A write enqueued on a busy compute stream right before submit must be copied.
            ticket = ticket_for(1, page)
            host.free([10], owner)  # the 8 pages freed above hold the store: one more
            extra = host.alloc(1, ticket)
            assert extra is not None
            new = torch.full((layout.page_numel,), 2.0, dtype=dtype, device="cuda")
            torch.cuda._sleep(100_000_000)  # type: ignore[no-untyped-call]
            layout.write_page(7, new)
            engine.submit(ticket, [7], extra)
            (ack,) = engine.drain()
            ok = ok and ack.ok and torch.equal(host.page(extra[0]), new.cpu())
            # A load of the stored host pages into other device pages, one of them
            # still being written on a busy compute stream at submit.
            stored = {d: layout.read_page(d).clone() for d in device_pages}
            targets = [1, 3, 4, 6, 50, 51, 52, 60]
            load = Lifecycle("gpu-check-load", page_size=page).load([f"k{i}" for i in range(8)])
            torch.cuda._sleep(100_000_000)  # type: ignore[no-untyped-call]
            layout.write_page(targets[0], new)
            engine.submit(load, targets, host_pages)
            (ack,) = engine.drain()
            ok = ok and ack.ok and ack.is_load
            ok = ok and all(
                torch.equal(layout.read_page(t).view(BITS[dtype]), stored[d].view(BITS[dtype]))
                for d, t in zip(device_pages, targets, strict=True)
            )
            if not ok:
                failures.append(f"{kind}/{dtype}")
    return not failures, failures


def check_shared_pool() -> bool:
    """A pool over a shared file (as the vLLM backend's worker shares its host tier with the
    scheduler process), page-locked in chunks by ``page_lock`` through torch's own
    ``cudaHostRegister``: the engine takes it as pinned, a store and a load through it are
    bit-exact, and it unlocks."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]

    def register(address: int, nbytes: int) -> bool:
        error = cudart.cudaHostRegister(address, nbytes, 0)
        if error != cudart.cudaError.success:
            print(f"  cudaHostRegister({nbytes} bytes): {error}")
        return bool(error == cudart.cudaError.success)

    def unregister(address: int) -> object:
        return cudart.cudaHostUnregister(address)

    page = 8
    layout = LayerFirstLayout.zeros(4, 64, page, 4, 64, torch.bfloat16, "cuda")
    fill_random_bits(layout, seed=3)
    pages = 16
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        nbytes = pages * layout.page_nbytes
        f.truncate(nbytes)
        raw = torch.from_file(f.name, shared=True, size=nbytes, dtype=torch.int8)
        host = HostPagePool.over(raw.view(torch.bfloat16).view(pages, -1))
        locked = page_lock(host, register, unregister, chunk_bytes=5 * layout.page_nbytes)
        if locked is None or len(locked) != 4:  # 16 pages in chunks of 5: 4 ranges
            print(f"  page_lock: {locked}, pinned after: {host.tensor.is_pinned()}")
            return False
        engine = CudaCopyEngine(layout, host)
        ticket = ticket_for(4, page)
        host_pages = host.alloc(4, ticket)
        assert host_pages is not None
        device_pages = [60, 2, 33, 17]
        engine.submit(ticket, device_pages, host_pages)
        (ack,) = engine.drain()
        ok = ack.ok and all(
            torch.equal(host.page(h).view(torch.int16), layout.read_page(d).cpu().view(torch.int16))
            for d, h in zip(device_pages, host_pages, strict=True)
        )
        load = Lifecycle("gpu-check-shared", page_size=page).load([f"s{i}" for i in range(4)])
        targets = [1, 5, 9, 40]
        engine.submit(load, targets, host_pages)
        (ack,) = engine.drain()
        ok = (
            ok
            and ack.ok
            and all(
                torch.equal(  # as bits: random bits hold NaNs, which equal nothing
                    layout.read_page(t).view(torch.int16), layout.read_page(d).view(torch.int16)
                )
                for d, t in zip(device_pages, targets, strict=True)
            )
        )
        engine.close()
        page_unlock(locked, unregister)
        print(f"  copies bit-exact: {ok}, pinned after page_unlock: {host.tensor.is_pinned()}")
        return bool(ok and not host.tensor.is_pinned())


def median_ms(ts: list[float]) -> str:
    return f"{statistics.median(ts) * 1e3:9.2f} {min(ts) * 1e3:9.2f} {max(ts) * 1e3:9.2f}"


def main() -> int:
    """Run the three checks; print a table and the JSON figures."""
    if not torch.cuda.is_available():
        print("CUDA is not available here: nothing to check (run this on a GPU machine).")
        print(json.dumps({"bench": "gpu_check", "cuda": False}))
        return 0
    torch.set_num_threads(1)
    figures: dict[str, object] = {
        "bench": "gpu_check",
        "cuda": True,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }

    # 1. correctness
    correct, failures = check_correctness()
    figures["correct"] = correct
    print(f"correctness: {'ok' if correct else 'FAILED ' + ', '.join(failures)}")
    shared = check_shared_pool()
    figures["shared_pool_page_locked"] = shared
    print(f"shared-file pool, page-locked: {'ok' if shared else 'FAILED'}")

    # 2. D2H throughput at a realistic shape
    layers, heads, head_dim, page, device_pages, n = 32, 8, 128, 16, 2048, 256
    shape = (layers, device_pages, page, heads, head_dim)
    layouts: dict[str, KVLayout] = {
        "layer_first": LayerFirstLayout.zeros(*shape, torch.bfloat16, "cuda"),
        "page_first": PageFirstLayout.zeros(*shape, torch.bfloat16, "cuda"),
    }
    for layout in layouts.values():
        for buf in layout.buffers():
            buf.fill_(1.0)
    numel = layouts["layer_first"].page_numel
    nbytes = n * numel * 2
    src = torch.ones(n * numel, dtype=torch.bfloat16, device="cuda")
    dst = torch.zeros(n * numel, dtype=torch.bfloat16, pin_memory=True)
    host = HostPagePool(n, numel, torch.bfloat16, pin_memory=True)
    engines = {name: CudaCopyEngine(layout, host) for name, layout in layouts.items()}
    pages = torch.randperm(device_pages)[:n].tolist()

    def contiguous() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    src_h2d = torch.ones(n * numel, dtype=torch.bfloat16, pin_memory=True)
    dst_h2d = torch.zeros(n * numel, dtype=torch.bfloat16, device="cuda")

    def contiguous_h2d() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst_h2d.copy_(src_h2d, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def timed_copy(name: str, ticket: Ticket | LoadTicket) -> float:
        """One chunk through engine ``name``, submit to ack (a store or a load by its ticket)."""
        engine = engines[name]
        host_pages = host.alloc(n, ticket)
        assert host_pages is not None
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.submit(ticket, pages, host_pages)
        (ack,) = engine.drain()
        elapsed = time.perf_counter() - start
        assert ack.ok
        host.free(host_pages, ticket)
        return elapsed

    def restore(name: str) -> float:
        keys = [f"k{i}" for i in range(n)]
        return timed_copy(name, Lifecycle("gpu-check-load", page_size=page).load(keys))

    def offload(name: str) -> float:
        return timed_copy(name, ticket_for(n, page))

    variants: dict[str, Callable[[], float]] = {
        "contiguous": contiguous,
        "layer_first": lambda: offload("layer_first"),
        "page_first": lambda: offload("page_first"),
        "contiguous_h2d": contiguous_h2d,
        "layer_first_load": lambda: restore("layer_first"),
        "page_first_load": lambda: restore("page_first"),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(10):  # round 0 warms up
        if left() < 120:
            break
        for name, run in variants.items():
            elapsed = run()
            if round_:
                times[name].append(elapsed)
    if all(times.values()):
        base = statistics.median(times["contiguous"])
        base_h2d = statistics.median(times["contiguous_h2d"])
        print(
            f"D2H (stores) and H2D (loads) of {n} random pages ({nbytes / 2**20:.0f} MiB), "
            "median/min/max ms, GB/s, ratio to a contiguous copy the same way"
        )
        for name, ts in times.items():
            med = statistics.median(ts)
            h2d = name.endswith(("_h2d", "_load"))
            ratio = (base_h2d if h2d else base) / med
            print(f"  {name:<18}{median_ms(ts)} {nbytes / med / 1e9:8.2f} {ratio:6.2f}")
            if h2d:
                key = name.removesuffix("_h2d").removesuffix("_load")
                figures[f"{key}_h2d_gbps"] = round(nbytes / med / 1e9, 2)
                if name != "contiguous_h2d":
                    figures[f"{key}_load_ratio"] = round(ratio, 3)
            else:
                figures[f"{name}_d2h_gbps"] = round(nbytes / med / 1e9, 2)
                if name != "contiguous":
                    figures[f"{name}_ratio"] = round(ratio, 3)

    # 3. overlap with a busy compute stream
    if left() > 60:
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

        def compute(k: int) -> None:
            for _ in range(k):
                torch.matmul(a, b)

        compute(3)  # warm up: the first product sets up cuBLAS
        torch.cuda.synchronize()
        start = time.perf_counter()
        compute(10)
        torch.cuda.synchronize()
        per_matmul = (time.perf_counter() - start) / 10
        copy_time = statistics.median(times["layer_first"]) if times["layer_first"] else 0.01
        k = max(1, round(copy_time / max(per_matmul, 1e-6)))

        def timed(run: Callable[[], None]) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            return time.perf_counter() - start

        def copy_only() -> None:
            offload("layer_first")

        def both() -> None:
            engine = engines["layer_first"]
            ticket = ticket_for(n, page)
            host_pages = host.alloc(n, ticket)
            assert host_pages is not None
            engine.submit(ticket, pages, host_pages)
            compute(k)  # enqueued after submit: the copy does not wait for it
            (ack,) = engine.drain()
            assert ack.ok
            host.free(host_pages, ticket)

        t_copy, t_compute, t_both = [], [], []
        for _ in range(7):
            if left() < 20:
                break
            t_copy.append(timed(copy_only))
            t_compute.append(timed(lambda: compute(k)))
            t_both.append(timed(both))
        if t_both:
            tc, tm, tb = (statistics.median(t) for t in (t_copy, t_compute, t_both))
            overlap = (tc + tm - tb) / min(tc, tm)
            print(
                f"overlap: copy {tc * 1e3:.2f} ms, compute ({k} matmuls) {tm * 1e3:.2f} ms, "
                f"both {tb * 1e3:.2f} ms -> overlap {overlap:.2f}"
            )
            figures.update(
                overlap=round(overlap, 3),
                overlap_copy_ms=round(tc * 1e3, 2),
                overlap_compute_ms=round(tm * 1e3, 2),
                overlap_both_ms=round(tb * 1e3, 2),
            )
    figures["seconds"] = round(time.perf_counter() - _START, 1)
    print(json.dumps(figures))
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
