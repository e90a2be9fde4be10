"""MooncakeStore against a real Mooncake cluster: a master and a memory pool on loopback.

Every test talks to real processes (``mooncake_master``, ``mooncake_client``)
started on free 127.0.0.1 ports and stopped by PID; the failure tests kill them
with SIGKILL mid-run. Skipped, with the reason, where the ``mooncake`` extra (or
``libibverbs.so.1``) is missing: ``.ci/mooncake.sh`` installs both.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch

from kvlife.errors import (
    ConfigError,
    InvalidPut,
    MissingDependency,
    PageMismatch,
    StoreError,
    StoreUnavailable,
)
from kvlife.store.base import (
    frame_into,
    frame_page,
    frame_size,
    tensor_segments,
    unframe_page,
)

try:
    from kvlife.store.mooncake import MooncakeStore, load_client_class
    from kvlife.testing.faults import FaultyMooncakeStore
    from kvlife.testing.mooncake_local import LocalMooncake

    load_client_class()
except MissingDependency as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"mooncake is not installed ({exc}); run .ci/mooncake.sh", allow_module_level=True)

os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalMooncake]:
    with LocalMooncake(pool_size="256MB") as c:
        yield c


@pytest.fixture
def own_cluster() -> Iterator[LocalMooncake]:
    """A cluster of the test's own, for tests that kill its processes."""
    with LocalMooncake(pool_size="128MB") as c:
        yield c


_n = 0


def fresh_namespace() -> str:
    global _n
    _n += 1
    return f"t{os.getpid()}-{_n}-{time.monotonic_ns() % 10**9}"


def key(i: int, salt: int = 0) -> str:
    return f"{salt:08x}{i:08x}"


def pages_for(n: int, numel: int = 1024, tag: int = 0) -> torch.Tensor:
    return (torch.arange(n * numel, dtype=torch.float32) + tag * 1e6).reshape(n, numel)


def as_bytes(row: torch.Tensor) -> bytes:
    return row.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def store(cluster: LocalMooncake) -> Iterator[MooncakeStore]:
    s = MooncakeStore(cluster.master, cluster.metadata, fresh_namespace())
    yield s
    s.close()


def put_one(store: MooncakeStore, keys: list[str], pages: torch.Tensor, timeout: float = 30):
    store.put("t", keys, pages)
    (result,) = store.drain(timeout)
    return result


# ---------------------------------------------------------------- the protocol


def test_frame_into_writes_the_shared_format_and_views_verify_in_place() -> None:
    payload = as_bytes(pages_for(1, 300)[0])
    k = key(7)
    whole = frame_page(k, payload) + payload
    out = bytearray(len(whole) + 5)
    assert frame_into(memoryview(out), k, memoryview(payload)) == len(whole)
    assert frame_size(k, len(payload)) == len(whole)
    assert bytes(out[: len(whole)]) == whole
    view = memoryview(out)[: len(whole)]
    got = unframe_page(k, view)
    assert isinstance(got, memoryview) and got.tobytes() == payload
    out[len(whole) - 1] ^= 1  # a flipped bit in place is a miss
    assert unframe_page(k, view) is None
    assert unframe_page(key(8), memoryview(whole)) is None  # another key's page


def test_roundtrip_batch_get_contains_keys(store: MooncakeStore) -> None:
    keys = [key(i, 1) for i in range(16)]
    pages = pages_for(16)
    result = put_one(store, keys, pages)
    assert result.ok, result.error
    got = store.get_batch([*keys, key(99, 1)])
    assert got[-1] is None
    for i, data in enumerate(got[:-1]):
        assert data == as_bytes(pages[i])
    assert store.get(keys[3]) == as_bytes(pages[3])
    assert store.contains(keys[0]) and not store.contains(key(98, 1))
    assert sorted(store.keys()) == sorted(keys)
    s = store.stats()
    assert (s.puts_ok, s.pages_written, s.bytes_written) == (1, 16, 16 * 4096)


def test_put_is_asynchronous_and_results_come_by_poll(cluster: LocalMooncake) -> None:
    """A 64 MiB put returns at once; its result appears only at a later poll/drain."""
    s = MooncakeStore(cluster.master, cluster.metadata, fresh_namespace())
    try:
        pages = pages_for(256, numel=64 * 1024)  # 256 x 256 KiB
        keys = [key(i, 2) for i in range(256)]
        t0 = time.perf_counter()
        s.put("big", keys, pages)
        call = time.perf_counter() - t0
        assert s.poll() == [] and s.pending == 1
        assert call < 0.02, f"put blocked the caller {call * 1e3:.1f} ms"
        (result,) = s.drain(60)
        assert result.ok and result.token == "big" and s.pending == 0
        pages.fill_(-1.0)  # the caller may reuse its pages once it holds the result
        assert s.get(keys[200]) == as_bytes(pages_for(256, numel=64 * 1024)[200])
    finally:
        s.close()


def test_namespaces_keep_pages_apart(cluster: LocalMooncake) -> None:
    a = MooncakeStore(cluster.master, cluster.metadata, fresh_namespace())
    b = MooncakeStore(cluster.master, cluster.metadata, fresh_namespace())
    try:
        k = key(1, 3)
        assert put_one(a, [k], pages_for(1, tag=1)).ok
        assert put_one(b, [k], pages_for(1, tag=2)).ok  # no mismatch: another namespace
        assert a.get(k) == as_bytes(pages_for(1, tag=1)[0])
        assert b.get(k) == as_bytes(pages_for(1, tag=2)[0])
    finally:
        a.close()
        b.close()


def test_first_value_wins_same_bytes_dedup_other_bytes_mismatch(store: MooncakeStore) -> None:
    keys = [key(i, 4) for i in range(4)]
    assert put_one(store, keys, pages_for(4)).ok
    again = put_one(store, keys, pages_for(4))
    assert again.ok and store.stats().pages_deduplicated == 4
    new_key = key(9, 4)
    other = put_one(store, [new_key, keys[2]], pages_for(2, tag=5))
    assert isinstance(other.error, PageMismatch) and other.error.key == keys[2]
    assert store.get(keys[2]) == as_bytes(pages_for(4)[2])  # the stored page is kept
    assert store.get(new_key) is None  # the failed put wrote nothing
    assert store.stats().page_mismatches == 1


def test_invalid_keys_and_puts_are_refused_before_anything(store: MooncakeStore) -> None:
    with pytest.raises(InvalidPut, match="is not 2 to 128 lowercase hex digits"):
        store.get("../x")
    with pytest.raises(InvalidPut, match="is not 2 to 128 lowercase hex digits"):
        store.put("t", ["Z1"], pages_for(1))
    assert store.pending == 0


@pytest.mark.parametrize(
    "damage",
    ["truncated", "flipped", "other_key", "other_namespace", "extended", "header_only"],
)
def test_damaged_page_is_a_counted_miss_and_the_next_put_replaces_it(
    store: MooncakeStore, damage: str
) -> None:
    k, other = key(1, 6), key(2, 6)
    payload = as_bytes(pages_for(1, tag=6)[0])
    whole = frame_page(k, payload, store.namespace) + payload
    bad = {
        "truncated": whole[:-100],
        "flipped": whole[:-1] + bytes([whole[-1] ^ 1]),
        "other_key": frame_page(other, payload, store.namespace) + payload,
        "other_namespace": frame_page(k, payload, store.namespace + "x") + payload,
        "extended": whole + b"\0",
        "header_only": frame_page(k, payload, store.namespace),
    }[damage]
    assert store.client.put(store.object_key(k), bad) == 0
    assert store.get(k) is None
    assert not store.contains(k)
    assert store.stats().pages_corrupt == 2
    result = put_one(store, [k], pages_for(1, tag=6))
    assert result.ok, result.error  # not a mismatch: the bad page is replaced
    assert store.get(k) == payload


def test_issue36_5_an_object_copied_from_another_namespace_is_a_counted_miss(
    cluster: LocalMooncake, store: MooncakeStore
) -> None:
    """Scenario: the object of a page of namespace A is copied, byte for byte, to the same
    key's object in namespace B. B does not serve it (it is A's KV): a counted miss, and
    B's put of the key stores B's page; A keeps serving its own."""
    k = key(1, 11)
    a_page, b_page = pages_for(1, tag=1), pages_for(1, tag=2)
    assert put_one(store, [k], a_page).ok
    copied = store.client.get(store.object_key(k))
    assert len(copied) > len(as_bytes(a_page[0]))
    other = MooncakeStore(cluster.master, cluster.metadata, fresh_namespace())
    try:
        assert other.client.put(other.object_key(k), copied) == 0
        assert other.get(k) is None and not other.contains(k)
        assert other.stats().pages_corrupt == 2
        result = put_one(other, [k], b_page)
        assert result.ok, result.error
        assert other.get(k) == as_bytes(b_page[0])
        assert store.get(k) == as_bytes(a_page[0])
    finally:
        other.close()


def test_large_page_read_by_a_new_reader(cluster: LocalMooncake, store: MooncakeStore) -> None:
    """A reader that never wrote does not know the page size: reads still whole pages."""
    keys = [key(i, 7) for i in range(3)]
    pages = pages_for(3, numel=256 * 1024)  # 1 MiB pages
    assert put_one(store, keys, pages).ok
    reader = MooncakeStore(cluster.master, cluster.metadata, store.namespace)
    try:
        assert reader.get_batch(keys) == [as_bytes(p) for p in pages]
    finally:
        reader.close()


def test_injected_faults_roll_back_every_page(cluster: LocalMooncake) -> None:
    """Faults at every step (before lookup, before writing, after writing): nothing visible."""
    store = FaultyMooncakeStore(cluster.master, cluster.metadata, fresh_namespace())
    try:
        store.fail_rate = 1.0
        for i in range(9):
            store.put(i, [key(i, 8), key(100 + i, 8)], pages_for(2, tag=i))
        results = store.drain(60)
        assert len(results) == 9
        for r in results:
            assert type(r.error) is StoreError and "injected" in str(r.error), r.error
            assert r.error.code is None and r.error.call is None
        assert store.get_batch([k for r in results for k in r.keys]) == [None] * 18
        store.fail_rate = 0.0
        assert put_one(store, [key(0, 8)], pages_for(1, tag=0)).ok
    finally:
        store.close()


def test_evicted_pages_are_misses_not_errors(tmp_path: object) -> None:
    with LocalMooncake(pool_size="32MB") as small:
        s = MooncakeStore(small.master, small.metadata, fresh_namespace())
        try:
            for batch in range(12):  # 12 x 4 MiB into a 32 MiB pool
                keys = [key(batch * 16 + i, 9) for i in range(16)]
                s.put(batch, keys, pages_for(16, numel=64 * 1024, tag=batch))
            results = s.drain(60)
            assert all(r.ok for r in results), [r.error for r in results if not r.ok]
            got = s.get_batch([key(i, 9) for i in range(12 * 16)])
            assert got[0] is None, "the oldest page should have been evicted"
            assert got[-1] == as_bytes(pages_for(16, numel=64 * 1024, tag=11)[15])
            assert s.stats().pages_corrupt == 0
        finally:
            s.close()


def test_two_processes_share_pages(cluster: LocalMooncake, store: MooncakeStore) -> None:
    """Another process writes; this one reads its pages, and dedups a put of the same bytes."""
    code = textwrap.dedent(
        f"""
        import torch
        from kvlife.store.mooncake import MooncakeStore
        s = MooncakeStore({cluster.master!r}, {cluster.metadata!r}, {store.namespace!r})
        pages = (torch.arange(8 * 1024, dtype=torch.float32) + 7e6).reshape(8, 1024)
        s.put(0, [f"{{i:016x}}" for i in range(8)], pages)
        (r,) = s.drain(30)
        assert r.ok, r.error
        s.close()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, capture_output=True)
    keys = [f"{i:016x}" for i in range(8)]
    pages = pages_for(8, tag=7)
    assert store.get_batch(keys) == [as_bytes(p) for p in pages]
    assert put_one(store, keys, pages).ok
    assert store.stats().pages_deduplicated == 8 and store.stats().pages_written == 0


# ---------------------------------------------------------------- failures


def test_no_master_is_a_typed_error_within_seconds() -> None:
    from kvlife.testing.mooncake_local import free_port

    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        MooncakeStore(f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}/metadata")
    assert time.monotonic() - t0 < 30
    assert info.value.call == "setup" and info.value.code is not None


@pytest.mark.parametrize(
    "bad",
    [
        {"max_page_bytes": 0},
        {"retry_after": -1.0},
        {"full_wait": float("nan")},
        {"max_batch_bytes": 0},
        {"local_buffer_size": 2.5},
    ],
)
def test_bad_options_are_refused_before_a_client_is_set_up(bad: dict[str, object]) -> None:
    """No master answers there, so a client set up first would fail with StoreUnavailable
    (and one set up before a refusal would never be closed)."""
    from kvlife.testing.mooncake_local import free_port

    with pytest.raises(ConfigError, match=next(iter(bad))):
        MooncakeStore(f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}/metadata", **bad)


def test_not_installed_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(MissingDependency, match="kvlife\\[mooncake\\]"):
        MooncakeStore("127.0.0.1:1", "http://127.0.0.1:2/metadata")


def _wait_ok(store: MooncakeStore, k: str, pages: torch.Tensor, within: float) -> float:
    """Put until one succeeds; the seconds it took (fails the test past ``within``)."""
    t0 = time.monotonic()
    while True:
        result = put_one(store, [k], pages)
        if result.ok:
            return time.monotonic() - t0
        # A Mooncake call's error code (the breaker's StoreUnavailable or another code).
        assert isinstance(result.error, StoreError), result.error
        assert result.error.code is not None, result.error
        assert time.monotonic() - t0 < within, f"not usable again after {within} s"
        time.sleep(0.2)


def test_master_killed_mid_run_then_restarted(own_cluster: LocalMooncake) -> None:
    s = MooncakeStore(own_cluster.master, own_cluster.metadata, fresh_namespace())
    try:
        stored = [key(i, 10) for i in range(4)]
        assert put_one(s, stored, pages_for(4)).ok
        for i in range(20):  # puts in flight when the master dies
            s.put(i, [key(100 + i, 10)], pages_for(1, tag=i))
        own_cluster.kill_master()
        t0 = time.monotonic()
        for i in range(20, 40):
            s.put(i, [key(100 + i, 10)], pages_for(1, tag=i))
        results = s.drain(30)  # nothing hangs: every result within one failing call or so
        took = time.monotonic() - t0
        assert len(results) == 40 and took < 15, took
        failed = [r for r in results if not r.ok]
        assert failed and all(type(r.error) is StoreUnavailable for r in failed)
        assert results[-1].error is not None
        with pytest.raises(StoreUnavailable):
            s.get(stored[0])  # a failure, not a miss
        own_cluster.start_master()  # the same ports; it starts empty, the pool re-registers
        took = _wait_ok(s, key(999, 10), pages_for(1, tag=99), within=40)
        assert s.get(key(999, 10)) == as_bytes(pages_for(1, tag=99)[0])
        assert s.get(stored[0]) is None  # gone with the old master: a miss
        print(f"usable again {took:.1f} s after the restart")
    finally:
        s.close()


def test_pool_killed_mid_run_then_restarted(own_cluster: LocalMooncake) -> None:
    s = MooncakeStore(own_cluster.master, own_cluster.metadata, fresh_namespace())
    try:
        stored = key(1, 11)
        assert put_one(s, [stored], pages_for(1)).ok
        for i in range(10):
            s.put(i, [key(100 + i, 11)], pages_for(4, tag=i)[:1])
        own_cluster.kill_pool()
        t0 = time.monotonic()
        for i in range(10, 30):
            s.put(i, [key(100 + i, 11)], pages_for(1, tag=i))
        results = s.drain(30)
        assert len(results) == 30 and time.monotonic() - t0 < 15
        failed = [r for r in results if not r.ok]
        assert failed and all(type(r.error) is StoreUnavailable for r in failed)
        assert results[-1].error is not None
        # The pool's pages are gone: a miss, or (while the master still lists them) a
        # failure; never stale bytes.
        with contextlib.suppress(StoreUnavailable):
            assert s.get(stored) is None
        own_cluster.start_pool()
        _wait_ok(s, key(999, 11), pages_for(1, tag=9), within=40)
        assert s.get(key(999, 11)) == as_bytes(pages_for(1, tag=9)[0])
    finally:
        s.close()


def test_manager_frees_host_pages_when_the_master_dies(own_cluster: LocalMooncake) -> None:
    """The offload manager on a Mooncake store: store failures free host pages, nothing hangs."""
    from kvlife.engine.cpu import CpuCopyEngine
    from kvlife.layout import LayerFirstLayout
    from kvlife.manager import OffloadManager
    from kvlife.pool import HostPagePool

    layout = LayerFirstLayout.zeros(2, 64, 4, 2, 4, dtype=torch.float32)
    host = HostPagePool(32, layout.page_numel, torch.float32)
    engine = CpuCopyEngine(layout, host, copy_delay=0.0)
    store = MooncakeStore(own_cluster.master, own_cluster.metadata, fresh_namespace())
    manager = OffloadManager(engine, host, store, page_size=4)
    released: list[object] = []
    try:
        for r in range(6):
            if r == 3:
                own_cluster.kill_master()
            tokens = [(r * 7919 + i) % 50_000 for i in range(4 * 3 + 1)]
            lc = manager.start(f"r{r}", [], lambda lc, pages: released.append(pages))
            pages = [r * 3, r * 3 + 1, r * 3 + 2]
            for p in pages:
                layout.write_page(p, torch.full((layout.page_numel,), float(r * 10 + p)))
            manager.offload(lc, tokens, pages)
            manager.finish(lc)
            manager.poll()
        t0 = time.monotonic()
        manager.close(timeout=60)
        assert time.monotonic() - t0 < 30
        m = manager.metrics()
        assert host.num_used == 0 and len(released) == 6
        assert m.store_failures >= 1, m
    finally:
        engine.close()
        store.close()


# ---------------------------------------------------------------- kvlife simulate


def _simulate(cluster: LocalMooncake, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "kvlife", "simulate", "--store", "mooncake", "--json"]
    cmd += ["--mooncake-master", cluster.master, "--mooncake-metadata", cluster.metadata]
    return subprocess.Popen(
        [*cmd, "--requests", "200", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_simulate_two_processes_share_pages(own_cluster: LocalMooncake) -> None:
    """Two simulate runs at once on one cluster, then a third: every page verified. The
    store half only: which prompt pages a run restores instead of prefilling (and so
    stores) depends on timing, and the third run must offload the same keys."""
    import json

    reports = []
    same = ("--no-restores",)
    for proc in [_simulate(own_cluster, *same), _simulate(own_cluster, *same)]:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        reports.append(json.loads(out))
    third = _simulate(own_cluster, *same)
    out, _ = third.communicate(timeout=120)
    assert third.returncode == 0, out
    reports.append(json.loads(out))
    for r in reports:
        assert r["ok"] and r["pages_stored"] > 0 and r["store_failures"] == 0
        assert r["pages_verified"] == r["pages_stored"] and r["pages_missing"] == 0
    # The third run found every page it offloaded already stored by the first two.
    assert reports[2]["pages_written"] == 0 and reports[2]["pages_found_stored"] > 0
    assert reports[0]["pages_written"] + reports[1]["pages_written"] >= reports[2]["pages_stored"]


def test_simulate_two_ranks_restore_from_the_cluster(own_cluster: LocalMooncake) -> None:
    """``--store mooncake --world-size 2``: both halves on the cluster, every rank restoring
    the same prefixes (each from its own shard's pages), every restored page checked."""
    import json

    proc = _simulate(own_cluster, "--world-size", "2", "--concurrency", "8")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    report = json.loads(out)
    assert report["ok"] and report["ranks_agreed"], report
    ranks = report["per_rank"]
    restored = [(r["restores"], r["pages_restored"], r["load_failures"]) for r in ranks]
    assert restored[0][0] > 0 and restored[0] == restored[1]
    assert all(r["corrupted_restores"] == 0 and r["store_failures"] == 0 for r in ranks)


def test_simulate_keeps_running_when_the_master_dies(own_cluster: LocalMooncake) -> None:
    """The master killed mid-run and restarted: store failures counted, nothing leaks."""
    import threading

    from kvlife.sim.runtime import SimConfig, run_simulation

    cfg = SimConfig(
        requests=600,
        store="mooncake",
        mooncake_master=own_cluster.master,
        mooncake_metadata=own_cluster.metadata,
        copy_delay=0.004,
    )
    reports = []
    runner = threading.Thread(target=lambda: reports.append(run_simulation(cfg)))
    runner.start()
    time.sleep(0.5)
    own_cluster.kill_master()
    time.sleep(1.0)
    own_cluster.start_master()
    runner.join(120)
    assert not runner.is_alive(), "the simulation hung"
    (report,) = reports
    assert report.ok, report.violations
    assert report.store_failures > 0
    assert report.leaked_host_pages == 0 and report.leaked_device_pages == 0


# ------------------------------------------------------------ issue 23 items 3-4, issue 24 item 3


def test_defect23_3_a_large_foreign_object_never_sizes_a_read_buffer(
    store: MooncakeStore,
) -> None:
    """48 MiB under a kvlife key: a counted miss, and later 64-key reads stay small."""
    k = key(1, 30)
    assert store.client.put(store.object_key(k), b"\0" * (48 << 20)) == 0
    assert store.get(k) is None and store.stats().pages_corrupt == 1
    keys = [key(100 + i, 30) for i in range(64)]
    assert put_one(store, keys, pages_for(64, numel=1024)).ok  # 4 KiB pages
    assert store.get_batch(keys) == [as_bytes(p) for p in pages_for(64, numel=1024)]
    assert store._read_buffer.array.nbytes < 16 << 20  # 64 slots of a page, not of 48 MiB


def test_defect23_3_an_object_larger_than_any_page_is_not_read(cluster: LocalMooncake) -> None:
    k = key(2, 30)
    with MooncakeStore(
        cluster.master, cluster.metadata, fresh_namespace(), max_page_bytes=1 << 20
    ) as s:
        assert s.client.put(s.object_key(k), b"\0" * (4 << 20)) == 0
        real, got = s._client, []

        class Watch:  # the pybind client's attributes cannot be patched: wrap it
            def __getattr__(self, name: str) -> object:
                if name == "get_into":
                    got.append(name)
                return getattr(real, name)

        s._client = Watch()
        assert s.get(k) is None and s.get_batch([k, k]) == [None, None]
        assert got == [] and s.stats().pages_corrupt == 3
        assert s.get_into(k, memoryview(bytearray(4 << 20))) is False  # over the page size


def test_defect23_4_a_page_larger_than_the_pool_is_refused_and_opens_no_breaker() -> None:
    with (
        LocalMooncake(pool_size="32MB") as c,
        MooncakeStore(c.master, c.metadata, fresh_namespace(), full_wait=0.3) as s,
    ):
        huge = torch.zeros(1, 40 << 18)  # 40 MiB: under max_page_bytes, over the pool
        result = put_one(s, [key(1, 31)], huge)
        assert isinstance(result.error, InvalidPut), result.error
        assert "does not fit" in str(result.error)
        assert put_one(s, [key(2, 31)], pages_for(1)).ok  # at once, no breaker
        assert s.get(key(2, 31)) == as_bytes(pages_for(1)[0])
        assert s.get(key(1, 31)) is None


def test_clear_removes_this_namespace_only(cluster: LocalMooncake) -> None:
    ns = fresh_namespace()
    with (
        MooncakeStore(cluster.master, cluster.metadata, ns) as a,
        MooncakeStore(cluster.master, cluster.metadata, ns + "/below") as below,
    ):
        keys = [key(i, 32) for i in range(5)]
        assert put_one(a, keys, pages_for(5)).ok
        assert put_one(below, keys[:2], pages_for(2)).ok
        assert a.clear() == 5 and a.stats().pages_cleared == 5
        assert a.get_batch(keys) == [None] * 5 and list(a.keys()) == []
        assert below.get_batch(keys[:2]) == [as_bytes(p) for p in pages_for(2)]
        assert put_one(a, keys[:1], pages_for(1, tag=3)).ok  # a cleared key takes new bytes
        assert a.get(keys[0]) == as_bytes(pages_for(1, tag=3)[0])


def test_keep_first_stores_the_new_pages_and_counts_the_mismatch(store: MooncakeStore) -> None:
    keys = [key(i, 33) for i in range(3)]
    assert put_one(store, keys[1:2], pages_for(1, tag=1)).ok
    store.put("t", keys, pages_for(3, tag=2), keep_first=True)
    (result,) = store.drain(30)
    assert result.ok, result.error
    got = store.get_batch(keys)
    assert got[0] == as_bytes(pages_for(3, tag=2)[0]) and got[2] == as_bytes(pages_for(3, tag=2)[2])
    assert got[1] == as_bytes(pages_for(1, tag=1)[0])
    assert store.stats().page_mismatches == 1


def test_get_batch_into_and_lists_of_pages(store: MooncakeStore) -> None:
    pool = torch.randn(2, 3, 16, 4).to(torch.bfloat16)  # [K/V, layers, tokens, dim]
    views = [pool[:, :, t : t + 4] for t in (0, 4)]
    keys = [key(1, 34), key(2, 34)]
    store.put("t", keys, views)
    (result,) = store.drain(30)
    assert result.ok, result.error
    into = torch.zeros_like(pool)
    outs = [tensor_segments(into[:, :, t : t + 4], writable=True) for t in (0, 4)]
    outs.append(tensor_segments(into[:, :, 8:12], writable=True))
    assert store.get_batch_into([*keys, key(3, 34)], outs) == [True, True, False]
    assert torch.equal(into[:, :, :8], pool[:, :, :8])
    wrong = [memoryview(bytearray(10))]
    assert store.get_batch_into(keys[:1], [wrong]) == [False]  # another size: not that page
