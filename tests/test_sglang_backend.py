"""kvlife.integrations.sglang against SGLang's real HiCacheStorage and its documented contract.

Runs where ``sglang`` imports (``.ci/sglang.sh`` makes a venv with ``sglang``
installed ``--no-deps`` and the small packages ``hicache_storage`` imports);
skipped with the reason elsewhere.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"sglang is not importable ({type(exc).__name__}: {exc}); run .ci/sglang.sh",
        allow_module_level=True,
    )

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


def test_first_value_kept_same_bytes_ok_other_bytes_false(backend: KVLifeHiCacheStorage) -> None:
    assert backend.set(key(1), page(1))
    assert backend.set(key(1), page(1))
    assert not backend.set(key(1), page(2))
    target = torch.empty(512, dtype=torch.bfloat16)
    assert torch.equal(backend.get(key(1), target), page(1))  # type: ignore[arg-type]


def test_batch_set_is_all_or_nothing(backend: KVLifeHiCacheStorage) -> None:
    assert backend.set(key(3), page(3))
    keys = [key(1), key(2), key(3)]
    assert not backend.batch_set(keys, [page(1), page(2), page(99)])  # key 3 holds other bytes
    assert not backend.exists(key(1)) and not backend.exists(key(2))
    assert backend.batch_set(keys, [page(1), page(2), page(3)])
    targets = [torch.empty(512, dtype=torch.bfloat16) for _ in keys]
    got = backend.batch_get(keys, targets)
    assert all(torch.equal(g, page(i + 1)) for i, g in enumerate(got))  # type: ignore[arg-type]
    assert backend.batch_get([key(7)], [torch.empty(512, dtype=torch.bfloat16)]) == [None]


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
