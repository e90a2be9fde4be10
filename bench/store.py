"""Store throughput against the raw calls each store wraps, and the scheduler thread's cost.

For each store, the same pages in the same run, interleaved round by round
(raw put, store put, raw get, store get, in alternating order), median of the
rounds:

- ``directory``: ``LocalDirectoryStore`` vs writing and reading one file per
  page with ``open``/``write``/``read`` in a temporary folder (no framing,
  no verification, no links);
- ``mooncake``: ``MooncakeStore`` (batched put: a lookup, framing, CRC32 and
  ``batch_put_from``; batched get: ``batch_get_into``, then verification) vs
  ``batch_put_from`` and ``batch_get_into`` of the bare pages on a registered
  buffer, against a real master and pool this script starts on loopback ports.

Also the scheduler thread's time per ``put`` call (validation and queueing;
the writing is on the writer thread). The last line printed is one JSON object.

    python bench/store.py [--pages 512] [--page-kib 64] [--rounds 7] [--stores directory,mooncake]
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


def bench_directory(n: int, page_bytes: int, rounds: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kvlife-bench-store-"))
    raw_dir = root / "raw"
    raw_dir.mkdir()
    store = LocalDirectoryStore(root / "store", "bench")
    figures: dict[str, list[float]] = {k: [] for k in ("raw_put", "put", "raw_get", "get")}
    call_us: list[float] = []
    nbytes = n * page_bytes
    try:
        for r in range(rounds):
            pages = _pages(n, page_bytes, r)
            keys = _keys(n, r, 1)
            rows = [pages[i].numpy().data for i in range(n)]

            def raw_put() -> None:
                for k, row in zip(keys, rows, strict=True):
                    with open(raw_dir / f"{k}.page", "wb") as f:
                        f.write(row)

            def put() -> None:
                t0 = time.perf_counter()
                store.put(r, keys, pages)
                call_us.append((time.perf_counter() - t0) * 1e6)
                (result,) = store.drain()
                assert result.ok, result.error

            def raw_get() -> None:
                for k in keys:
                    (raw_dir / f"{k}.page").read_bytes()

            def get() -> None:
                for k in keys:
                    assert store.get(k) is not None

            order = [("raw_put", raw_put), ("put", put)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                figures[name].append(_mib_s(nbytes, _timed(fn)))
            order = [("raw_get", raw_get), ("get", get)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                figures[name].append(_mib_s(nbytes, _timed(fn)))
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    return _summary("directory", figures, call_us, n)


def bench_mooncake(n: int, page_bytes: int, rounds: int) -> dict[str, Any]:
    from kvlife.store.mooncake import MooncakeStore
    from kvlife.store.mooncake_local import LocalMooncake

    pool = f"{max(256, 4 * n * page_bytes // 2**20)}MB"
    figures: dict[str, list[float]] = {k: [] for k in ("raw_put", "put", "raw_get", "get")}
    call_us: list[float] = []
    nbytes = n * page_bytes
    with LocalMooncake(pool_size=pool) as cluster:
        store = MooncakeStore(cluster.master, cluster.metadata, "bench")
        client = store.client  # the same client: the same connection, the same pool
        raw_buf = np.empty(nbytes, dtype=np.uint8)
        raw_ptr = int(raw_buf.ctypes.data)
        assert client.register_buffer(raw_ptr, nbytes) == 0
        try:
            for r in range(rounds):
                pages = _pages(n, page_bytes, r)
                keys = _keys(n, r, 2)
                raw_keys = [f"raw/{k}" for k in keys]
                ptrs = [raw_ptr + i * page_bytes for i in range(n)]
                sizes = [page_bytes] * n

                def raw_put() -> None:
                    raw_buf[:] = pages.numpy().reshape(-1)  # the same values, staged
                    codes = client.batch_put_from(raw_keys, ptrs, sizes)
                    assert all(c == 0 for c in codes), set(codes)

                def put() -> None:
                    t0 = time.perf_counter()
                    store.put(r, keys, pages)
                    call_us.append((time.perf_counter() - t0) * 1e6)
                    (result,) = store.drain()
                    assert result.ok, result.error

                def raw_get() -> None:
                    codes = client.batch_get_into(raw_keys, ptrs, sizes)
                    assert all(c == page_bytes for c in codes), set(codes)

                def get() -> None:
                    got = store.get_batch(keys)
                    assert all(g is not None for g in got)

                order = [("raw_put", raw_put), ("put", put)]
                for name, fn in order if r % 2 == 0 else order[::-1]:
                    figures[name].append(_mib_s(nbytes, _timed(fn)))
                order = [("raw_get", raw_get), ("get", get)]
                for name, fn in order if r % 2 == 0 else order[::-1]:
                    figures[name].append(_mib_s(nbytes, _timed(fn)))
                client.batch_remove(raw_keys + [store.object_key(k) for k in keys], True)
        finally:
            client.unregister_buffer(raw_ptr)
            store.close()
    return _summary("mooncake", figures, call_us, n)


def _summary(
    name: str, figures: dict[str, list[float]], call_us: list[float], n: int
) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in figures.items()}
    out: dict[str, Any] = {
        "store": name,
        "rounds": len(figures["put"]),
        "put_mib_s": round(med["put"], 1),
        "raw_put_mib_s": round(med["raw_put"], 1),
        "put_ratio": round(med["put"] / med["raw_put"], 3),
        "get_mib_s": round(med["get"], 1),
        "raw_get_mib_s": round(med["raw_get"], 1),
        "get_ratio": round(med["get"] / med["raw_get"], 3),
        "put_call_us": round(statistics.median(call_us), 1),
        "put_call_us_per_page": round(statistics.median(call_us) / n, 3),
    }
    print(
        f"{name:10s} put {out['put_mib_s']:8.1f} MiB/s (raw {out['raw_put_mib_s']:8.1f}, "
        f"ratio {out['put_ratio']:.2f})  get {out['get_mib_s']:8.1f} MiB/s "
        f"(raw {out['raw_get_mib_s']:8.1f}, ratio {out['get_ratio']:.2f})  "
        f"put() on the caller's thread {out['put_call_us']:.0f} us for {n} pages"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=512, help="pages per batch")
    parser.add_argument("--page-kib", type=int, default=64, help="KiB per page")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (the median is reported)")
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
