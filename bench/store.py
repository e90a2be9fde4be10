"""Store throughput against the raw calls each store wraps, and the scheduler thread's cost.

For each store, the same pages in the same run, interleaved round by round
(raw put, store put, raw get, store get, in alternating order), after one
warm-up round that is not counted (it registers and faults in every buffer on
both sides). Each ratio is the median over the rounds of that round's store
figure over its raw figure (each pair ran side by side, so a slow moment of
the shared machine mostly hits both); the ratio of the median figures is
reported too (``*_ratio_of_medians``), and each figure's median with its
slowest and fastest round:

- ``directory``: ``LocalDirectoryStore`` vs writing and reading one file per
  page with ``open``/``write``/``read`` in a temporary folder (no framing,
  no verification, no links);
- ``mooncake``: ``MooncakeStore`` vs the ``MooncakeDistributedStore`` calls
  it wraps, on the same client, against a real master and pool this script
  starts on loopback ports. Each side does the same job with the same pages:
  put = stage the pages in a registered buffer and ``batch_put_from`` (the
  store also asks ``batch_is_exist``, frames each page with its key, length
  and XXH3-64 checksum, 22 bytes plus the key more a page); get = ``batch_get_into`` a
  registered buffer and hand back each page as its own ``bytes`` (the
  buffer is reused by the next call; the store also verifies every page).
  ``raw_get_into`` is the transfer alone, without handing the pages back:
  the ceiling, not the same job.

Also the scheduler thread's time per ``put`` call (validation and queueing;
the writing is on the writer thread). The last line printed is one JSON object.

    python bench/store.py [--pages 512] [--page-kib 64] [--rounds 11] [--stores directory,mooncake]
"""

# The per-round closures run within their own round (B023 is about later calls).
# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlife.store.directory import LocalDirectoryStore


def _pages(n: int, page_bytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, (n, page_bytes), dtype=torch.uint8, generator=gen)


def _keys(n: int, round_: int, salt: int) -> list[str]:
    return [f"{salt:04x}{round_:04x}{i:08x}" for i in range(n)]


def _mib_s(nbytes: int, seconds: float) -> float:
    return nbytes / 2**20 / seconds


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _recorder(
    figures: dict[str, list[float]], nbytes: int, *, counted: bool
) -> Callable[[str, Callable[[], object]], None]:
    """``record(name, fn)``: run ``fn``, and (in a counted round) add its MiB/s to ``figures``."""

    def record(name: str, fn: Callable[[], object]) -> None:
        mib_s = _mib_s(nbytes, _timed(fn))
        if counted:
            figures[name].append(mib_s)

    return record


def _paired(figures: dict[str, list[float]], name: str, raw: str) -> float:
    """The median over the rounds of ``name``'s figure over ``raw``'s in the same round."""
    return statistics.median(a / b for a, b in zip(figures[name], figures[raw], strict=True))


def _put_and_drain(
    store: Any, token: object, keys: list[str], pages: torch.Tensor, call_us: list[float]
) -> None:
    """One batched put, its time on the caller's thread recorded (µs), then its result."""
    t0 = time.perf_counter()
    store.put(token, keys, pages)
    call_us.append((time.perf_counter() - t0) * 1e6)
    (result,) = store.drain()
    assert result.ok, result.error


def bench_directory(n: int, page_bytes: int, rounds: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kvlife-bench-store-"))
    raw_dir = root / "raw"
    raw_dir.mkdir()
    store = LocalDirectoryStore(root / "store", "bench")
    figures: dict[str, list[float]] = {k: [] for k in ("raw_put", "put", "raw_get", "get")}
    call_us: list[float] = []
    nbytes = n * page_bytes
    try:
        for r in range(rounds + 1):  # round 0 warms up and is not counted
            pages = _pages(n, page_bytes, r)
            keys = _keys(n, r, 1)
            record = _recorder(figures, nbytes, counted=r > 0)
            rows = [pages[i].numpy().data for i in range(n)]

            def raw_put() -> None:
                for k, row in zip(keys, rows, strict=True):
                    with open(raw_dir / f"{k}.page", "wb") as f:
                        f.write(row)

            def put() -> None:
                _put_and_drain(store, r, keys, pages, call_us)

            def raw_get() -> None:
                for k in keys:
                    (raw_dir / f"{k}.page").read_bytes()

            def get() -> None:
                for k in keys:
                    assert store.get(k) is not None

            order = [("raw_put", raw_put), ("put", put)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                record(name, fn)
            order = [("raw_get", raw_get), ("get", get)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                record(name, fn)
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    return _summary("directory", figures, call_us, n)


def bench_mooncake(n: int, page_bytes: int, rounds: int) -> dict[str, Any]:
    from kvlife.store.base import frame_size
    from kvlife.store.mooncake import MooncakeStore
    from kvlife.testing.mooncake_local import LocalMooncake

    pool = f"{max(256, 6 * n * page_bytes // 2**20)}MB"
    names = ("raw_put", "put", "raw_put_page", "raw_get", "get", "raw_get_page_into")
    figures: dict[str, list[float]] = {k: [] for k in names}
    call_us: list[float] = []
    nbytes = n * page_bytes  # MiB/s count the pages' bytes on every side
    with LocalMooncake(pool_size=pool) as cluster:
        store = MooncakeStore(cluster.master, cluster.metadata, "bench")
        client = store.client  # the same client: the same connection, the same pool
        # The store's objects are the page and a header (key, namespace, length, checksum):
        # the raw side moves objects of that same size, the page in the same place.
        stride = frame_size(_keys(1, 0, 2)[0], page_bytes, "bench")
        head = stride - page_bytes
        raw_buf = np.zeros(n * stride, dtype=np.uint8)
        raw_ptr = int(raw_buf.ctypes.data)
        slots = raw_buf.reshape(n, stride)
        assert client.register_buffer(raw_ptr, raw_buf.nbytes) == 0
        try:
            for r in range(rounds + 1):  # round 0 warms up and is not counted
                pages = _pages(n, page_bytes, r)
                keys = _keys(n, r, 2)
                record = _recorder(figures, nbytes, counted=r > 0)
                raw_keys = [f"raw/{k}" for k in keys]
                page_keys = [f"page/{k}" for k in keys]
                ptrs = [raw_ptr + i * stride for i in range(n)]
                sizes = [stride] * n
                page_ptrs = [raw_ptr + i * page_bytes for i in range(n)]
                page_sizes = [page_bytes] * n

                def raw_put() -> None:  # the same values, staged, the same bytes moved
                    slots[:, head:] = pages.numpy()
                    codes = client.batch_put_from(raw_keys, ptrs, sizes)
                    assert all(c == 0 for c in codes), set(codes)

                def raw_put_page() -> None:  # the pages alone, one 64 KiB object each
                    raw_buf[:nbytes] = pages.numpy().reshape(-1)
                    codes = client.batch_put_from(page_keys, page_ptrs, page_sizes)
                    assert all(c == 0 for c in codes), set(codes)

                def put() -> None:
                    _put_and_drain(store, r, keys, pages, call_us)

                def raw_get() -> None:  # the buffer is reused: each page handed back as bytes
                    codes = client.batch_get_into(raw_keys, ptrs, sizes)
                    assert all(c == stride for c in codes), set(codes)
                    got = [slots[i, head:].tobytes() for i in range(n)]
                    assert len(got) == n

                def raw_get_page_into() -> None:  # the transfer alone: a ceiling, not the job
                    codes = client.batch_get_into(page_keys, page_ptrs, page_sizes)
                    assert all(c == page_bytes for c in codes), set(codes)

                def get() -> None:
                    got = store.get_batch(keys)
                    assert all(g is not None for g in got)

                order = [("raw_put", raw_put), ("put", put), ("raw_put_page", raw_put_page)]
                for name, fn in order if r % 2 == 0 else order[::-1]:
                    record(name, fn)
                order = [
                    ("raw_get", raw_get),
                    ("get", get),
                    ("raw_get_page_into", raw_get_page_into),
                ]
                for name, fn in order if r % 2 == 0 else order[::-1]:
                    record(name, fn)
                client.batch_remove(
                    raw_keys + page_keys + [store.object_key(k) for k in keys], True
                )
        finally:
            client.unregister_buffer(raw_ptr)
            store.close()
    return _summary("mooncake", figures, call_us, n)


def _summary(
    name: str, figures: dict[str, list[float]], call_us: list[float], n: int
) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in figures.items()}
    out: dict[str, Any] = {"store": name, "rounds": len(figures["put"])}
    for k, v in figures.items():
        out[f"{k}_mib_s"] = round(med[k], 1)
        out[f"{k}_mib_s_min_max"] = [round(min(v), 1), round(max(v), 1)]
    out["put_ratio"] = round(_paired(figures, "put", "raw_put"), 3)
    out["get_ratio"] = round(_paired(figures, "get", "raw_get"), 3)
    out["put_ratio_of_medians"] = round(med["put"] / med["raw_put"], 3)
    out["get_ratio_of_medians"] = round(med["get"] / med["raw_get"], 3)
    if "raw_put_page" in med:
        out["put_ratio_to_page_objects"] = round(_paired(figures, "put", "raw_put_page"), 3)
        out["get_ratio_to_page_transfer"] = round(_paired(figures, "get", "raw_get_page_into"), 3)
    out["put_call_us"] = round(statistics.median(call_us), 1)
    out["put_call_us_per_page"] = round(statistics.median(call_us) / n, 3)
    print(
        f"{name:10s} put {out['put_mib_s']:8.1f} MiB/s (raw {out['raw_put_mib_s']:8.1f}, "
        f"paired ratio {out['put_ratio']:.2f})  get {out['get_mib_s']:8.1f} MiB/s "
        f"(raw {out['raw_get_mib_s']:8.1f}, paired ratio {out['get_ratio']:.2f})  "
        f"put() on the caller's thread {out['put_call_us']:.0f} us for {n} pages"
    )
    print(
        f"{'':10s} ratios of the medians: put {out['put_ratio_of_medians']:.2f}  "
        f"get {out['get_ratio_of_medians']:.2f}"
    )
    for k, v in figures.items():
        print(f"{'':10s} {k:17s} median {med[k]:8.1f}  min {min(v):8.1f}  max {max(v):8.1f} MiB/s")
    if "raw_put_page" in med:
        print(
            f"{'':10s} against page-sized raw objects: put ratio "
            f"{out['put_ratio_to_page_objects']:.2f}; get against the bare transfer "
            f"(pages not handed back) {out['get_ratio_to_page_transfer']:.2f}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=512, help="pages per batch")
    parser.add_argument("--page-kib", type=int, default=64, help="KiB per page")
    parser.add_argument(
        "--rounds", type=int, default=11, help="counted rounds (the median is reported)"
    )
    parser.add_argument("--stores", default="directory,mooncake")
    args = parser.parse_args()
    if args.rounds < 7:
        parser.error("at least 7 rounds: the figures are medians")
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    page_bytes = args.page_kib * 1024
    results = []
    for name in args.stores.split(","):
        bench = {"directory": bench_directory, "mooncake": bench_mooncake}[name]
        results.append(bench(args.pages, page_bytes, args.rounds))
    print(json.dumps({"pages": args.pages, "page_kib": args.page_kib, "stores": results}))


if __name__ == "__main__":
    main()
