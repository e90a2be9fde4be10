"""kvlife.integrations.sglang against SGLang's real HiCacheStorage and its documented contract.

Runs where ``sglang`` imports (``.ci/sglang.sh`` makes a venv with ``sglang``
installed ``--no-deps`` and the small packages ``hicache_storage`` imports);
skipped with the reason elsewhere.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"sglang is not importable ({type(exc).__name__}: {exc}); run .ci/sglang.sh",
        allow_module_level=True,
    )

from kvlife.errors import StoreError
from kvlife.hashing import sglang_page_hashes
from kvlife.integrations.sglang import KVLifeHiCacheStorage, store_key
from kvlife.store.directory import LocalDirectoryStore
from kvlife.store.memory import MemoryStore


def config(extra: dict[str, object] | None = None, **over: object) -> HiCacheStorageConfig:
    fields: dict[str, object] = dict(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="org/model-7b",
        extra_config=extra,
    )
    fields.update(over)
    return HiCacheStorageConfig(**fields)  # type: ignore[arg-type]


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[KVLifeHiCacheStorage]:
    b = KVLifeHiCacheStorage(config({"kvlife_root": str(tmp_path)}), {})
    yield b
    b.close()


def page(tag: int, numel: int = 512) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.bfloat16) + tag


def key(i: int) -> str:
    return f"{i:064x}"


def test_it_is_sglangs_abstract_class_fully_implemented() -> None:
    assert issubclass(KVLifeHiCacheStorage, HiCacheStorage)
    assert not inspect.isabstract(KVLifeHiCacheStorage)
    for name in ("get", "set", "batch_get", "batch_set", "exists", "batch_exists"):
        ours = inspect.signature(getattr(KVLifeHiCacheStorage, name)).parameters
        theirs = inspect.signature(getattr(HiCacheStorage, name)).parameters
        assert list(ours)[: len(theirs)] == list(theirs), name


def test_sglangs_dynamic_loader_builds_it(tmp_path: Path) -> None:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = {
        "backend_name": "kvlife",
        "module_path": "kvlife.integrations.sglang",
        "class_name": "KVLifeHiCacheStorage",
        "kvlife_root": str(tmp_path),
    }
    backend = StorageBackendFactory.create_backend("dynamic", config(extra), None)
    try:
        assert isinstance(backend, KVLifeHiCacheStorage)
        assert backend.set(key(1), page(1))
        assert isinstance(backend.store, LocalDirectoryStore)
        assert backend.store.namespace == "sglang/org-model-7b/tp0of1"
        assert backend.store.path(key(1)).is_file()
    finally:
        backend.close()


def test_set_get_into_target_and_misses(backend: KVLifeHiCacheStorage) -> None:
    assert backend.get(key(1), torch.empty(512, dtype=torch.bfloat16)) is None
    assert backend.set(key(1), page(1))
    target = torch.zeros(512, dtype=torch.bfloat16)
    got = backend.get(key(1), target)
    assert got is target and torch.equal(target, page(1))
    assert backend.get(key(1), torch.zeros(256, dtype=torch.bfloat16)) is None  # wrong size
    raw = backend.get(key(1))
    assert raw is not None and raw.numel() == 1024
    assert backend.exists(key(1)) and not backend.exists(key(2))


def test_first_value_kept_other_bytes_are_a_success_counted_as_a_mismatch(
    backend: KVLifeHiCacheStorage,
) -> None:
    """Issue 24 item 3: as SGLang's HiCacheFile, a key it holds is a success (first value
    kept); kvlife counts the other bytes in page_mismatches, never silently."""
    assert backend.set(key(1), page(1))
    assert backend.set(key(1), page(1))
    assert backend.store.stats().page_mismatches == 0
    assert backend.set(key(1), page(2))
    assert backend.store.stats().page_mismatches == 1
    target = torch.empty(512, dtype=torch.bfloat16)
    assert torch.equal(backend.get(key(1), target), page(1))  # type: ignore[arg-type]


def test_batch_set_stores_the_new_pages_when_other_keys_existed(
    backend: KVLifeHiCacheStorage,
) -> None:
    """Issue 24 item 3: under SGLang's _page_backup a False ends the backup, so a key
    that held other bytes (KV is not bit-stable across batch shapes) must not drop the
    batch's new pages."""
    assert backend.set(key(3), page(3))
    keys = [key(1), key(2), key(3)]
    assert backend.batch_set(keys, [page(1), page(2), page(99)])  # key 3 holds other bytes
    assert backend.exists(key(1)) and backend.exists(key(2))
    got = backend.batch_get(keys, [torch.empty(512, dtype=torch.bfloat16) for _ in keys])
    assert [torch.equal(g, page(i + 1)) for i, g in enumerate(got)] == [True] * 3  # type: ignore[arg-type]
    assert backend.store.stats().page_mismatches == 1
    assert backend.batch_get([key(7)], [torch.empty(512, dtype=torch.bfloat16)]) == [None]


class FailingKey(MemoryStore):
    """A MemoryStore whose writer fails (an I/O error) every put holding ``bad``."""

    def __init__(self, bad: str) -> None:
        self.bad = bad
        super().__init__()

    def _store_pages(self, keys, pages, *rest):  # type: ignore[no-untyped-def]
        if self.bad in keys:
            raise OSError(5, "injected EIO")
        return super()._store_pages(keys, pages, *rest)


def test_defect23_6_batch_set_of_pages_of_different_sizes_is_all_or_none() -> None:
    """Pages of different sizes are one put: a failure stores none of them (it stored
    the pages before the failing one)."""
    store = FailingKey(key(2))
    backend = KVLifeHiCacheStorage(store=store)
    try:
        keys = [key(1), key(2), key(3)]
        values = [page(1, 512), page(2, 256), page(3, 512)]
        assert not backend.batch_set(keys, values)
        assert [backend.exists(k) for k in keys] == [False, False, False]
        assert backend.refusals.count("batch_set") == 1
        assert backend.batch_set([key(1), key(3), key(4)], [page(1, 512), page(3, 128), page(4)])
        assert store.stats().puts_ok == 1  # one put for the three sizes
    finally:
        store.close()


def test_clear_removes_the_namespaces_pages(tmp_path: Path) -> None:
    """Issue 24 item 3: clear() was SGLang's no-op, so the admin call 'cleared' nothing."""
    extra = {"kvlife_root": str(tmp_path)}
    a = KVLifeHiCacheStorage(config(extra), {})
    b = KVLifeHiCacheStorage(config(extra, model_name="other/model"), {})
    try:
        assert a.batch_set([key(1), key(2)], [page(1), page(2)]) and b.set(key(1), page(1))
        assert a.clear() is True
        assert not a.exists(key(1)) and a.batch_exists([key(1), key(2)]) == 0
        assert b.exists(key(1))  # another model's namespace keeps its pages
        assert a.get_stats().pages_cleared == 2
        assert a.set(key(1), page(5)) and a.exists(key(1))
    finally:
        a.close()
        b.close()


def test_defect23_5_a_long_model_path_is_hashed_into_the_namespace(tmp_path: Path) -> None:
    """A Hugging Face snapshot path is over 100 characters; SGLang's HiCacheFile takes it."""
    path = (
        "/root/.cache/huggingface/hub/models--meta-llama--Llama-3.1-8B-Instruct/"
        "snapshots/0e9e39f249a16976918f6564b8830bc894c89659"
    )
    b = KVLifeHiCacheStorage(config({"kvlife_root": str(tmp_path)}, model_name=path), {})
    other = KVLifeHiCacheStorage(
        config({"kvlife_root": str(tmp_path)}, model_name=path[:-1] + "0"), {}
    )
    try:
        assert b.set(key(1), page(1)) and not other.exists(key(1))
        model = b.store.namespace.split("/")[1]  # type: ignore[attr-defined]
        assert len(model) <= 100 and model.startswith("root-.cache-huggingface-hub-models--")
        assert model != other.store.namespace.split("/")[1]  # type: ignore[attr-defined]
    finally:
        b.close()
        other.close()


class Exploding(MemoryStore):
    def get_batch(self, keys):  # type: ignore[no-untyped-def]
        raise MemoryError("no memory for the read")

    def get_batch_into(self, keys, outs):  # type: ignore[no-untyped-def]
        raise OSError(5, "EIO")


def test_nothing_a_store_raises_reaches_sglang() -> None:
    """Issue 23 item 1 at the backend: _read caught only StoreError (MemoryError and
    OSError went into SGLang); every failure is a counted miss, raised only if strict."""
    store = Exploding()
    backend = KVLifeHiCacheStorage(store=store)
    try:
        assert backend.get(key(1), torch.empty(512, dtype=torch.bfloat16)) is None
        assert backend.get(key(1)) is None
        assert not backend.exists(key(1)) and backend.batch_exists([key(1)]) == 0
        assert backend.set(key(1), "not a tensor") is False  # type: ignore[arg-type]
        assert backend.refusals.snapshot() == {"get": 2, "exists": 2, "set": 1}
        strict = KVLifeHiCacheStorage(store=store, strict=True)
        with pytest.raises(StoreError, match="MemoryError"):
            strict.get(key(1))
    finally:
        store.close()


def test_batch_exists_counts_consecutive_keys_from_the_first(
    backend: KVLifeHiCacheStorage,
) -> None:
    keys = [key(i) for i in range(150)]  # past one read chunk (64)
    assert backend.batch_set(keys[:100], [page(i) for i in range(100)])
    assert backend.set(keys[120], page(120))
    assert backend.batch_exists(keys) == 100
    assert backend.batch_exists(keys[:70]) == 70
    assert backend.batch_exists(keys[100:]) == 0
    assert backend.batch_exists([keys[0], keys[140], keys[1]]) == 1
    assert backend.batch_exists([]) == 0


def test_a_damaged_page_is_not_served(backend: KVLifeHiCacheStorage) -> None:
    assert backend.set(key(5), page(5))
    store = backend.store
    assert isinstance(store, LocalDirectoryStore)
    file = store.path(key(5))
    file.write_bytes(file.read_bytes()[:-2])
    assert backend.get(key(5), torch.empty(512, dtype=torch.bfloat16)) is None
    assert not backend.exists(key(5)) and backend.batch_exists([key(5)]) == 0
    assert backend.set(key(5), page(5))  # the next set replaces it
    assert backend.exists(key(5))


def test_kvlife_keys_are_sglangs_keys() -> None:
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = list(range(1000, 1064))
    ours = sglang_page_hashes(tokens, 16, None)
    theirs: list[str] = []
    prior = None
    for i in range(0, 64, 16):
        prior = get_hash_str(tokens[i : i + 16], prior)
        theirs.append(prior)
    assert ours == theirs
    assert all(store_key(k) == k for k in ours)


def test_any_store_backs_it_and_non_hex_keys_are_hashed() -> None:
    store = MemoryStore()
    backend = KVLifeHiCacheStorage(store=store)
    try:
        assert backend.set("abc_0_k.mamba", page(4))
        assert list(store.keys()) == [store_key("abc_0_k.mamba")]
        assert torch.equal(
            backend.get("abc_0_k.mamba", torch.empty(512, dtype=torch.bfloat16)),  # type: ignore[arg-type]
            page(4),
        )
    finally:
        store.close()


def test_mla_pages_are_shared_by_every_tp_rank(tmp_path: Path) -> None:
    extra = {"kvlife_root": str(tmp_path)}
    ranks = [
        KVLifeHiCacheStorage(config(extra, is_mla_model=True, tp_rank=r, tp_size=2), {})
        for r in range(2)
    ]
    try:
        assert ranks[0].set(key(1), page(1))
        assert ranks[1].exists(key(1))
    finally:
        for r in ranks:
            r.close()


def _mha_host_pool_class() -> Any:
    """SGLang's MHATokenToKVPoolHost; its import chain reaches torchvision, which the
    suite's one stand-in place (tests/sglang_stubs.py) provides where it cannot load."""
    try:
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    except ImportError:
        try:
            import sglang_stubs  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            pytest.skip(f"SGLang's host pool does not import here ({exc})")
        sglang_stubs.install()
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    return MHATokenToKVPoolHost


def host_pool(
    layout: str, page_size: int = 4, layers: int = 3, pages: int = 8, heads: int = 2, dim: int = 8
) -> Any:
    """SGLang's real MHA host pool class, its buffer set up as its constructor would
    (object.__new__, as SGLang's own unit tests build pools): its own get_data_page and
    set_from_flat_data_page run."""
    pool = object.__new__(_mha_host_pool_class())
    size = page_size * pages
    shape = {
        "layer_first": (2, layers, size, heads, dim),
        "page_first": (2, size, layers, heads, dim),
        "page_first_direct": (2, pages, layers, page_size, heads, dim),
    }[layout]
    gen = torch.Generator().manual_seed(7)
    pool.kv_buffer = torch.randn(shape, generator=gen).to(torch.bfloat16)
    fields = dict(layout=layout, page_size=page_size, layer_num=layers, size=size)
    fields.update(head_num=heads, head_dim=dim, dtype=torch.bfloat16, device="cpu")
    for name, value in fields.items():
        setattr(pool, name, value)
    pool.pin_memory = False
    return pool


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_v1_zero_copy_calls_read_and_write_sglangs_host_pool_in_place(
    tmp_path: Path, layout: str
) -> None:
    """Issue 24 item 3: batch_set_v1/batch_get_v1 (interface_v1). The pages stored are
    byte for byte the v0 pages (get_data_page flattened), so v0 and v1 share a store."""
    backend = KVLifeHiCacheStorage(config({"kvlife_root": str(tmp_path), "interface_v1": 1}), {})
    pool = host_pool(layout)
    backend.register_mem_pool_host(pool)
    try:
        ps, keys = 4, [key(i) for i in range(3)]
        assert backend.batch_set_v1(keys, torch.arange(2 * ps, 5 * ps)) == [True] * 3
        for i, k in enumerate(keys):  # what v0 reads is SGLang's own flat page
            flat = pool.get_data_page((2 + i) * ps, flat=True)
            got = backend.get(k, torch.empty_like(flat))
            assert got is not None and torch.equal(got, flat)
        saved = host_pool(layout)
        saved.kv_buffer = pool.kv_buffer.clone()
        pool.kv_buffer.zero_()
        got = backend.batch_get_v1([keys[0], keys[1], key(9)], torch.arange(0, 3 * ps))
        assert got == [True, True, False]
        for i in range(2):
            want = saved.get_data_page((2 + i) * ps, flat=True)
            assert torch.equal(pool.get_data_page(i * ps, flat=True), want)
        assert not pool.get_data_page(2 * ps, flat=True).any()  # the miss wrote nothing
        assert backend.refusals.total == 0
    finally:
        backend.close()


def test_v1_calls_move_no_page_through_python_memory(tmp_path: Path) -> None:
    """Zero copy, measured: writing and reading 8 pages of 256 KiB allocate less
    Python memory than one page (the pages go between the pool and the files)."""
    import tracemalloc

    backend = KVLifeHiCacheStorage(config({"kvlife_root": str(tmp_path)}), {})
    pool = host_pool("layer_first", page_size=16, layers=4, pages=16, heads=8, dim=128)
    backend.register_mem_pool_host(pool)
    page_bytes = pool.get_data_page(0, flat=True).numel() * 2
    keys = [key(i) for i in range(8)]
    try:
        assert backend.batch_set_v1(keys, torch.arange(0, 8 * 16)) == [True] * 8  # warm up
        backend.clear()
        tracemalloc.start()
        assert backend.batch_set_v1(keys, torch.arange(0, 8 * 16)) == [True] * 8
        _, put_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        assert backend.batch_get_v1(keys, torch.arange(8 * 16, 16 * 16)) == [True] * 8
        _, get_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert page_bytes == 256 << 10
        assert put_peak < page_bytes and get_peak < page_bytes, (put_peak, get_peak)
        assert torch.equal(pool.kv_buffer[:, :, 128:], pool.kv_buffer[:, :, :128])
    finally:
        backend.close()
