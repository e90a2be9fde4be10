"""vLLM 0.34's offloading-connector test harness (``RequestRunner`` in vLLM's
``tests/v1/kv_connector/unit/offloading_connector/utils.py``) with kvlife's spec in place
of vLLM's mock spec: vLLM's real scheduler, its real ``OffloadingConnector`` on both roles,
kvlife's real manager and kvlife's real worker copying the runner's KV cache through
kvlife's copy engine.

vLLM's harness asserts its spec is a ``MockOffloadingSpec`` whose manager is a
``MagicMock``: :class:`KVLifeRunnerSpec` is that subclass, its manager a ``MagicMock`` that
*wraps* kvlife's manager (each call reaches kvlife and is recorded, so vLLM's
``assert_called`` checks hold) and its worker the mock worker's bookkeeping around
kvlife's worker (each job is copied by kvlife; its result is handed to vLLM when the test
says the transfers complete, as the mock does). vLLM's tests script some manager
decisions (``prepare_store.side_effect = lambda keys, ctx: generate_store_output(subset)``):
:func:`generate_store_output` replaces vLLM's helper and asks kvlife to store ``subset``
for the request the connector asked about, so the keys stored are still kvlife's choice
among those offered.

vLLM's tests are loaded from its source distribution, unpacked under ``$KVLIFE_VLLM_TESTS``
(default ``build/vllm-tests``) by ``bash .ci/vllm034.sh``; :data:`ROOT` is None without it.
Importing this module needs vLLM 0.34.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest.mock import MagicMock

# vLLM's test config names a hub model: offline, its file list is not asked of the hub
# (a machine without network waits for retries of every lookup).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import vllm

VERSION = vllm.__version__.split("+")[0]
_TREE = Path(os.environ.get("KVLIFE_VLLM_TESTS", Path(__file__).parents[2] / "build/vllm-tests"))
_UTILS = _TREE / f"vllm-{VERSION}" / "tests/v1/kv_connector/unit/offloading_connector/utils.py"
#: vLLM's source tree whose ``tests`` package holds the connector's tests, or None.
ROOT: Path | None = _UTILS.parents[5] if _UTILS.is_file() else None


#: vLLM's own pytest marks in those tests: registered here, or pytest's ``--strict-markers``
#: refuses them as the modules are imported.
VLLM_MARKS = ("cpu_test", "skip_global_cleanup")


def upstream(name: str) -> ModuleType:
    """vLLM's test module ``tests.v1.kv_connector.unit.<name>`` (``ROOT`` must be set)."""
    import pytest

    assert ROOT is not None
    config = getattr(pytest.mark, "_config", None)  # the running session's (None outside)
    if config is not None:
        for mark in VLLM_MARKS:
            config.addinivalue_line("markers", f"{mark}: vLLM's own mark (its tests)")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    tests = sys.modules.get("tests")
    if tests is not None and not str(getattr(tests, "__file__", "")).startswith(str(ROOT)):
        del sys.modules["tests"]  # a namespace package of another tree: vLLM's is the one
    return importlib.import_module(f"tests.v1.kv_connector.unit.{name}")


def _local_model() -> str:
    """A local stand-in for the hub model vLLM's test config names (facebook/opt-125m):
    its config only (the scheduler reads the config; no weights are loaded)."""
    import tempfile

    from transformers import OPTConfig

    path = tempfile.mkdtemp(prefix="kvlife-opt-config-")
    OPTConfig(max_position_embeddings=16384).save_pretrained(path)
    return path


if ROOT is not None:
    _utils = upstream("offloading_connector.utils")
    _create_vllm_config = _utils.create_vllm_config
    _MODEL = _local_model()

    def create_vllm_config(*args: Any, **kwargs: Any) -> Any:
        if not args:
            kwargs.setdefault("model", _MODEL)
        return _create_vllm_config(*args, **kwargs)

    _utils.create_vllm_config = create_vllm_config
    from vllm.v1.kv_offload.base import OffloadingManager, PrepareStoreOutput

    from kvlife.integrations.vllm import KVLifeOffloadingSpec

    MockLoadStoreSpec = _utils.MockLoadStoreSpec
    MockOffloadingSpec = _utils.MockOffloadingSpec
    MockOffloadingWorker = _utils.MockOffloadingWorker

    class KVLifeHostSpec(MockLoadStoreSpec):  # type: ignore[misc, valid-type]
        """kvlife's host spec (``block_ids``: host pages, ``keys``) that vLLM's harness
        reads as its mock spec (``offload_keys``)."""

        def __init__(self, keys: list[bytes], block_ids: list[int]) -> None:
            super().__init__(keys)
            self.keys = list(keys)
            self.block_ids = list(block_ids)

    class _Manager:
        """kvlife's manager, its host specs in the harness's terms."""

        def __init__(self, kvlife: Any) -> None:
            self.kvlife = kvlife

        def prepare_store(self, keys: Any, req_context: Any) -> Any:
            out = self.kvlife.prepare_store(keys, req_context)
            if out is None:
                return None
            spec = out.store_spec
            return PrepareStoreOutput(
                keys_to_store=list(out.keys_to_store),
                store_spec=KVLifeHostSpec(list(spec.keys), list(spec.block_ids)),
                evicted_keys=list(out.evicted_keys),
            )

        def prepare_load(self, keys: Any, req_context: Any, *args: Any, **kwargs: Any) -> Any:
            spec = self.kvlife.prepare_load(keys, req_context, *args, **kwargs)
            return KVLifeHostSpec(list(spec.keys), list(spec.block_ids))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.kvlife, name)

    class _Worker(MockOffloadingWorker):  # type: ignore[misc, valid-type]
        """The mock worker's bookkeeping (what the harness reads) around kvlife's worker:
        kvlife copies each job at once; its result reaches vLLM when the harness completes
        the job (``complete_jobs``, ``wait``), as the mock's does."""

        def __init__(self, gpu_spec_map: dict[int, Any]) -> None:
            super().__init__(gpu_spec_map)
            self.kvlife: Any = None
            self._results: dict[int, Any] = {}
            #: Each job handed to vLLM: whether kvlife's result said it succeeded.
            self.outcomes: dict[int, bool] = {}

        def submit_store(self, job_id: int, device_ptrs: Any, dst_spec: Any) -> bool:
            super().submit_store(job_id, device_ptrs, dst_spec)
            return bool(self.kvlife.submit_store(job_id, device_ptrs, dst_spec))

        def submit_load(
            self, job_id: int, src_spec: Any, device_ptrs: Any, expedited: bool = False
        ) -> bool:
            super().submit_load(job_id, src_spec, device_ptrs, expedited)
            self._failing_jobs.discard(job_id)
            if self.fail_loads:  # the harness's failed load: kvlife's engine fails the copy
                self.kvlife.engine.fail_next()
            return bool(self.kvlife.submit_load(job_id, src_spec, device_ptrs, expedited=expedited))

        def complete_jobs(self, job_ids: set[int]) -> None:
            wanted = [j for j in job_ids if j in self.waiting_jobs]
            deadline = time.monotonic() + 30
            while any(j not in self._results for j in wanted):
                assert time.monotonic() < deadline, f"kvlife never finished jobs {wanted}"
                self.kvlife.flush(timeout=10)
                for result in self.kvlife.get_finished():
                    self._results[result.job_id] = result
            for job_id in wanted:
                self.waiting_jobs.remove(job_id)
                self.completed_jobs.append(job_id)
                result = self._results.pop(job_id)
                self.outcomes[job_id] = bool(result.success)
                self.completed_transfers.append(result)

    class KVLifeRunnerSpec(MockOffloadingSpec):  # type: ignore[misc, valid-type]
        """vLLM's mock spec with kvlife's manager and worker doing the work."""

        #: Host pages of each runner's tier (a class attribute: tests may set it).
        host_pages = 1024
        #: The scheduler-role spec made last (vLLM's tests run one runner at a time).
        current: KVLifeRunnerSpec | None = None

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            config.extra_config.setdefault(
                "host_bytes", self.host_pages * int(config.worker_kv_bytes_per_block)
            )
            config.extra_config.setdefault("model_id", "vllm-connector-unit-tests")
            self.kvlife = KVLifeOffloadingSpec(config)
            self.kvlife_manager: Any = None
            self.handler = _Worker(self._gpu_spec_map)

        def get_manager(self) -> Any:
            if self.kvlife_manager is None:  # the scheduler's role
                self.kvlife_manager = self.kvlife.get_manager()
                self.manager = MagicMock(
                    spec=OffloadingManager, wraps=_Manager(self.kvlife_manager)
                )
                KVLifeRunnerSpec.current = self
            return self.manager

        def get_worker(self, kv_caches: Any) -> Any:
            self.handler.kvlife = self.kvlife.get_worker(kv_caches)
            return self.handler

    def generate_store_output(keys: Any) -> Any:
        """vLLM's scripted store decision (store these keys) asked of kvlife, for the
        request vLLM's connector is asking about."""
        spec = KVLifeRunnerSpec.current
        assert spec is not None
        call = spec.manager.prepare_store.call_args
        assert call is not None, "a scripted prepare_store answers a call"
        ctx = call.kwargs.get("req_context", call.args[1] if len(call.args) > 1 else None)
        return _Manager(spec.kvlife_manager).prepare_store(list(keys), ctx)
