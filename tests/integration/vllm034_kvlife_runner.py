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

Two departures from vLLM's harness, each because a real manager meets what its mock
never does: a completed job's GPU blocks are named as they were at its submit (vLLM's
names them at completion, which a store completed after its request ended gets wrong),
and the stand-in model config names a generating architecture (without one vLLM takes
OPT for a pooling model, which samples no token per step, so the async scheduler
schedules every other step and vLLM's async tests decode fewer tokens than they count).
:class:`ReferenceRunnerSpec` seats vLLM's own ``CPUOffloadingManager`` where kvlife's
manager sits, and :func:`observe` runs one of vLLM's tests recording what each run
stored, loaded and flushed instead of asserting the mock's scripted expectation: the
tests that assert a script no real host tier follows are compared that way.

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
    # vLLM's bare asserts (its harness's expected_stored check) report what differed.
    pytest.register_assert_rewrite("tests.v1.kv_connector.unit")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    tests = sys.modules.get("tests")
    if tests is not None and not str(getattr(tests, "__file__", "")).startswith(str(ROOT)):
        del sys.modules["tests"]  # a namespace package of another tree: vLLM's is the one
    return importlib.import_module(f"tests.v1.kv_connector.unit.{name}")


def _local_model() -> str:
    """A local stand-in for the hub model vLLM's test config names (facebook/opt-125m):
    its config only (the scheduler reads the config; no weights are loaded). It names
    the hub model's architecture: without it vLLM resolves ``OPTModel``, a pooling model
    (no sampled token per step: the async scheduler idles every other step)."""
    import tempfile

    from transformers import OPTConfig

    path = tempfile.mkdtemp(prefix="kvlife-opt-config-")
    OPTConfig(architectures=["OPTForCausalLM"], max_position_embeddings=16384).save_pretrained(path)
    return path


#: The scheduler-role manager (a MagicMock around the real one) of the runner made last.
_asked: list[Any] = []
#: What :func:`_observed_run` recorded, one entry per run.
_observed: list[dict[str, Any]] = []
#: The runner whose steps run now (its workers name GPU blocks by its map).
_runner: list[Any] = []

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

    class _NotingWorker(MockOffloadingWorker):  # type: ignore[misc, valid-type]
        """vLLM's mock worker that notes each job's GPU blocks as the runner names them
        when the job is submitted (:func:`_parse_transfers` names them so)."""

        def __init__(self, gpu_spec_map: dict[int, Any]) -> None:
            super().__init__(gpu_spec_map)
            self.at_submit: dict[int, list[Any]] = {}

        def _note(self, job_id: int, device_ptrs: Any) -> None:
            runner = _runner[0] if _runner else None
            if runner is not None:
                ids = self._gpu_spec_map[id(device_ptrs)].block_ids
                self.at_submit[job_id] = [runner.gpu_blocks[int(b)] for b in ids]

        def submit_store(self, job_id: int, device_ptrs: Any, dst_spec: Any) -> bool:
            self._note(job_id, device_ptrs)
            return bool(super().submit_store(job_id, device_ptrs, dst_spec))

        def submit_load(
            self, job_id: int, src_spec: Any, device_ptrs: Any, expedited: bool = False
        ) -> bool:
            self._note(job_id, device_ptrs)
            return bool(super().submit_load(job_id, src_spec, device_ptrs, expedited))

    _vllm_run = _utils.RequestRunner._run
    _vllm_parse_transfers = _utils.RequestRunner._parse_transfers

    def _run(runner: Any, *args: Any, **kwargs: Any) -> None:
        """vLLM's ``RequestRunner._run``, the runner noted for its worker."""
        _runner[:] = [runner]
        _vllm_run(runner, *args, **kwargs)

    def _parse_transfers(runner: Any) -> None:
        """vLLM's ``RequestRunner._parse_transfers``, each completed job's GPU blocks named
        as they were when the job was submitted. vLLM's names them when the job completes:
        a store completed after its request ended (flushed when a later request reuses
        its blocks) would name the blocks' next owner. vLLM's mock masks that (it stores
        again what the next request offers, a fresh job naming its own blocks); a real
        manager stores a key once, so the late job is the only one."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        handler = runner.offloading_spec.handler
        if not isinstance(handler, _NotingWorker):
            _vllm_parse_transfers(runner)
            return
        jobs = list(handler.completed_jobs)
        stores, loads = len(runner.completed_stores), len(runner.completed_loads)
        _vllm_parse_transfers(runner)
        for job in jobs:
            blocks = handler.at_submit.pop(job)
            if isinstance(handler.transfer_specs[job][0], GPULoadStoreSpec):
                runner.completed_stores[stores].gpu_blocks = blocks
                stores += 1
            else:
                runner.completed_loads[loads].gpu_blocks = blocks
                loads += 1

    _utils.RequestRunner._run = _run
    _utils.RequestRunner._parse_transfers = _parse_transfers

    class _Worker(_NotingWorker):
        """The mock worker's bookkeeping (what the harness reads) around kvlife's worker:
        kvlife copies each job at once; its result reaches vLLM when the harness completes
        the job (``complete_jobs``, ``wait``), as the mock's does."""

        def __init__(self, gpu_spec_map: dict[int, Any]) -> None:
            super().__init__(gpu_spec_map)
            self.kvlife: Any = None
            self._results: dict[int, Any] = {}
            #: Each job handed to vLLM: whether kvlife's result said it succeeded.
            self.outcomes: dict[int, bool] = {}
            #: Each load job's GPU block ids and host pages; the synchronous ones.
            self.loads: dict[int, tuple[list[int], list[int]]] = {}
            self.expedited: set[int] = set()

        def submit_store(self, job_id: int, device_ptrs: Any, dst_spec: Any) -> bool:
            super().submit_store(job_id, device_ptrs, dst_spec)
            return bool(self.kvlife.submit_store(job_id, device_ptrs, dst_spec))

        def submit_load(
            self, job_id: int, src_spec: Any, device_ptrs: Any, expedited: bool = False
        ) -> bool:
            gpu = self._gpu_spec_map[id(device_ptrs)]
            self.loads[job_id] = ([int(b) for b in gpu.block_ids], list(src_spec.block_ids))
            if expedited:
                self.expedited.add(job_id)
            super().submit_load(job_id, src_spec, device_ptrs, expedited)
            self._failing_jobs.discard(job_id)
            if self.fail_loads:  # the harness's failed load: kvlife's engine fails the copy
                self.kvlife.engine.fail_next()
            return bool(self.kvlife.submit_load(job_id, src_spec, device_ptrs, expedited=expedited))

        def wait(self, job_ids: set[int]) -> None:
            """vLLM's wait (on a flush, on its synchronous loads) reaches kvlife's."""
            self.kvlife.wait(set(job_ids))
            super().wait(job_ids)

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
                _asked[:] = [self.manager]
            return self.manager

        def get_worker(self, kv_caches: Any) -> Any:
            self.handler.kvlife = self.kvlife.get_worker(kv_caches)
            return self.handler

    class _Reference:
        """vLLM's own CPUOffloadingManager (the reference for host-tier semantics), its
        host specs in the harness's terms (vLLM's CPU spec carries chunk ids, not keys)."""

        def __init__(self, manager: Any) -> None:
            self.reference = manager

        def prepare_store(self, keys: Any, req_context: Any) -> Any:
            out = self.reference.prepare_store(keys, req_context)
            if out is None:
                return None
            return PrepareStoreOutput(
                keys_to_store=list(out.keys_to_store),
                store_spec=MockLoadStoreSpec(list(out.keys_to_store)),
                evicted_keys=list(out.evicted_keys),
            )

        def prepare_load(self, keys: Any, req_context: Any, *args: Any, **kwargs: Any) -> Any:
            self.reference.prepare_load(keys, req_context, *args, **kwargs)
            return MockLoadStoreSpec(list(keys))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.reference, name)

    class ReferenceRunnerSpec(MockOffloadingSpec):  # type: ignore[misc, valid-type]
        """The control: vLLM 0.34's CPUOffloadingManager in kvlife's seat (wrapped as
        kvlife's is, as many host pages), vLLM's mock worker (no bytes move). What a
        vLLM test observes with it is what vLLM's own host tier decides."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.handler = _NotingWorker(self._gpu_spec_map)

        def get_manager(self) -> Any:
            if not isinstance(getattr(self.manager, "_mock_wraps", None), _Reference):
                from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

                reference = CPUOffloadingManager(
                    num_chunks=KVLifeRunnerSpec.host_pages, enable_events=True
                )
                self.manager = MagicMock(spec=OffloadingManager, wraps=_Reference(reference))
                _asked[:] = [self.manager]
            return self.manager

    def generate_store_output(keys: Any) -> Any:
        """vLLM's scripted store decision (store these keys) asked of the real manager
        (kvlife's, or the reference's), for the request vLLM's connector is asking about."""
        assert _asked, "no runner made a manager"
        manager = _asked[0]
        call = manager.prepare_store.call_args
        assert call is not None, "a scripted prepare_store answers a call"
        ctx = call.kwargs.get("req_context", call.args[1] if len(call.args) > 1 else None)
        return manager._mock_wraps.prepare_store(list(keys), ctx)

    def _observed_run(
        runner: Any,
        decoded_tokens: list[int],
        complete_transfers: bool = True,
        expected_stored: tuple[Any, ...] = (),
        expected_loaded: tuple[Any, ...] = (),
        expected_flushed: tuple[Any, ...] = (),
        post_step_fn: Any = None,
    ) -> None:
        """``RequestRunner.run`` that records what happened instead of asserting vLLM's
        scripted expectation: the GPU blocks stored, loaded and flushed, beside what the
        test expected. A run's stores are mapped before its loads (a load in the same run
        as the store it waited for, HIT_PENDING, reads that store's address); a load of an
        address that holds another GPU block's data is recorded as such."""
        runner.manager.reset_mock()
        runner._run(decoded_tokens, complete_transfers, post_step_fn=post_step_fn)
        stored: set[Any] = set()
        for transfer in runner.completed_stores:
            for block, address in zip(transfer.gpu_blocks, transfer.offload_addresses, strict=True):
                stored.add(block)
                runner.offloaded[address] = block
        loaded: set[Any] = set()
        wrong: list[Any] = []
        for transfer in runner.completed_loads:
            for block, address in zip(transfer.gpu_blocks, transfer.offload_addresses, strict=True):
                loaded.add(block)
                if runner.offloaded.get(address) != block:
                    wrong.append((block, runner.offloaded.get(address)))
        flushed = set(runner.flushed_gpu_blocks)
        runner.completed_stores.clear()
        runner.completed_loads.clear()
        runner.flushed_gpu_blocks.clear()

        def blocks(found: set[Any]) -> list[tuple[int, int]]:
            return sorted((b.group_idx, b.request_block_offset) for b in found)

        expected = (expected_stored, expected_loaded, expected_flushed)
        want = [blocks(set(runner._to_gpu_blocks(e))) for e in expected]
        _observed.append(
            {
                "stored": blocks(stored),
                "loaded": blocks(loaded),
                "flushed": blocks(flushed),
                "wrong_address": sorted(map(repr, wrong)),
                "expected": want,
            }
        )

    def observe(test: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """Run vLLM's scheduler test ``test`` (its runner factory among ``kwargs``) with
        ``RequestRunner.run`` recording (:func:`_observed_run`): each run's observations,
        then how the test ended (``"passed"`` or its exception, addresses removed)."""
        import re

        runner_cls = _utils.RequestRunner
        run = runner_cls.run
        _observed.clear()
        runner_cls.run = _observed_run
        try:
            test(**kwargs)
            end = "passed"
        except (AssertionError, KeyError) as exc:
            end = re.sub(r" at 0x[0-9a-f]+|id='\d+'", "", f"{type(exc).__name__}: {exc}")
        finally:
            runner_cls.run = run
        return [*_observed, {"end": end}]
