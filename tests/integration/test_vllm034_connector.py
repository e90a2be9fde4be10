"""vLLM 0.34's offloading-connector scheduler tests with kvlife's spec, and faults injected
at the connector level. Runs in the vLLM 0.34 venv (.ci/vllm034.sh); skipped elsewhere."""

from __future__ import annotations

import inspect
import random
from typing import Any

import pytest

base = pytest.importorskip("vllm.v1.kv_offload.base")
if not hasattr(base, "DevicePointers"):
    pytest.skip("vLLM before 0.34: its connector tests are 0.34's", allow_module_level=True)

import vllm034_kvlife_runner as kit  # noqa: E402

from kvlife.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.vllm

if kit.ROOT is None:
    pytest.skip(
        "vLLM's tests/v1/kv_connector/unit/offloading_connector is not unpacked: "
        "bash .ci/vllm034.sh fetches it (or set KVLIFE_VLLM_TESTS)",
        allow_module_level=True,
    )

SPEC = {"spec_name": "KVLifeRunnerSpec", "spec_module_path": "vllm034_kvlife_runner"}
#: The control: vLLM's own CPUOffloadingManager in kvlife's seat.
REFERENCE = {"spec_name": "ReferenceRunnerSpec", "spec_module_path": "vllm034_kvlife_runner"}
_unit_conftest = kit.upstream("conftest")
_mock_cpu_backend_block_sizes = _unit_conftest._mock_cpu_backend_block_sizes
_scheduler = kit.upstream("offloading_connector.test_scheduler")
_scheduler.generate_store_output = kit.generate_store_output

# Why vLLM's expectation is its mock manager's script, not a host tier's decision.
_RESTORE = (
    "expects vLLM's scripted mock manager to store again keys the host tier holds ready "
    "(a real manager, vLLM's CPUOffloadingManager as kvlife's, stores only new keys)"
)
_LOOKUP_MISS = (
    "reads the mock manager's scripted lookup (MISS for keys it was told to store): a real "
    "host tier holds them, so the resumed request loads them instead of recomputing"
)
_PENDING_MISS = (
    "reads the mock manager's scripted lookup (MISS for keys whose stores are in flight): "
    "a real host tier answers HIT_PENDING and the request loads them once stored"
)

#: vLLM's tests that assert its mock manager's scripted decisions, which a real host tier
#: (vLLM's own CPUOffloadingManager as much as kvlife's) does not make: skipped here with
#: the reason, and each run by test_scripted_scenarios_match_vllm_cpu_manager, which asks
#: that kvlife observes what vLLM's CPUOffloadingManager observes in the same scenario.
#: node name -> (vLLM's test function, its parameters, the reason)
SCRIPTED: dict[str, tuple[str, dict[str, Any], str]] = {
    **{
        f"test_offloading_connector[{a}]": (
            "test_offloading_connector",
            {"async_scheduling": a},
            _RESTORE,
        )
        for a in (True, False)
    },
    **{
        f"test_request_preemption[False-{a}]": (
            "test_request_preemption",
            {"async_scheduling": a, "cpu_hit": False},
            _LOOKUP_MISS,
        )
        for a in (True, False)
    },
    **{
        f"{name}[{a}]": (name, {"async_scheduling": a}, _RESTORE)
        for name in (
            "test_sliding_window_chunk_with_null_block_is_not_stored",
            "test_request_level_policy_stores_all_blocks",
            "test_skip_reading_prefix_cache",
            "test_max_load_tokens_limits_external_load",
        )
        for a in (True, False)
    },
    "test_request_finished_with_pending_stores_populates_fence": (
        "test_request_finished_with_pending_stores_populates_fence",
        {},
        _PENDING_MISS,
    ),
    "test_multiple_in_flight_stores_all_flushed_by_fence": (
        "test_multiple_in_flight_stores_all_flushed_by_fence",
        {},
        _PENDING_MISS,
    ),
}


def _runner_factory(spec: dict[str, str]) -> Any:
    """vLLM's runner factory with the offloading spec ``spec``."""

    def factory(*args: Any, extra_config_overrides: dict[str, Any] | None = None, **kw: Any):
        try:
            return kit._utils.RequestRunner(
                *args, extra_config_overrides={**(extra_config_overrides or {}), **spec}, **kw
            )
        except ConfigError as exc:
            if "one KV cache group" in str(exc) or "blocks_per_chunk" in str(exc):
                pytest.xfail(f"kvlife refuses at start: {exc}")
            raise

    return factory


@pytest.fixture
def hybrid_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's runner asks for the hybrid KV cache manager, which vLLM refuses on a
    platform without a GPU (this CUDA wheel on a CPU machine); the scheduler's side of it
    is plain Python, so the platform says yes."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        type(current_platform), "support_hybrid_kv_cache", classmethod(lambda cls: True)
    )


@pytest.fixture
def request_runner(request: pytest.FixtureRequest, hybrid_platform: None) -> Any:
    """vLLM's runner factory with kvlife's spec."""
    if request.node.name in SCRIPTED:
        pytest.skip(SCRIPTED[request.node.name][2])
    return _runner_factory(SPEC)


@pytest.mark.parametrize("node", sorted(SCRIPTED))
def test_scripted_scenarios_match_vllm_cpu_manager(node: str, hybrid_platform: None) -> None:
    """Scenario: one of vLLM's scheduler tests that asserts its mock's scripted decisions
    (SCRIPTED), run twice with its ``RequestRunner.run`` recording instead of asserting:
    with kvlife's manager and worker, then with vLLM 0.34's CPUOffloadingManager in the
    same seat. kvlife stores, loads and flushes the same GPU blocks in every run, each
    load reading the address its GPU block was stored at, and the test ends the same way;
    and vLLM's scripted expectation differs from both (the reason it is skipped)."""
    name, params, _ = SCRIPTED[node]
    test = getattr(_scheduler, name)
    kvlife = kit.observe(test, request_runner=_runner_factory(SPEC), **params)
    reference = kit.observe(test, request_runner=_runner_factory(REFERENCE), **params)
    assert len(kvlife) > 1, kvlife  # at least one run recorded
    assert len(kvlife) == len(reference), (kvlife, reference)
    for run, (ours, theirs) in enumerate(zip(kvlife, reference, strict=True)):
        assert ours == theirs, (run, ours, theirs)
        assert not ours.get("wrong_address"), (run, ours)
    scripted = [[r["stored"], r["loaded"], r["flushed"]] != r["expected"] for r in kvlife[:-1]]
    assert any(scripted), "vLLM's expectation holds: the test need not be skipped"


def _uses_runner(fn: Any) -> bool:
    return "request_runner" in inspect.signature(fn).parameters


#: Marks of vLLM's tests pytest knows here (vLLM's own, e.g. ``cpu_test``, are dropped).
_KNOWN_MARKS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}

for _name, _fn in list(vars(_scheduler).items()):
    if _name.startswith("test_") and callable(_fn) and _uses_runner(_fn):
        _fn.pytestmark = [m for m in getattr(_fn, "pytestmark", []) if m.name in _KNOWN_MARKS]
        globals()[_name] = _fn


# ------------------------------------------------------------------ faults, connector level

FAIL_RATE = 0.1
FAIL_SEED = 3


def test_with_10_percent_of_transfers_failed_loads_recompute_stores_drop_pages_wait(
    request_runner: Any,
) -> None:
    """Scenario: vLLM 0.34's scheduler and connector (both roles) over kvlife's manager and
    worker, whose copy engine fails 10 % of the copies. 24 prompts are stored, vLLM's
    prefix cache dropped, and the same prompts run again (loads, and stores of what a
    failed store left out). Every request completes; each failed load is reported to vLLM
    as its request's ``failed_recving`` (vLLM recomputes it); each failed store is dropped
    (its keys are misses, never announced as stored); and no host page is handed to a
    store or a load while a copy that may write it, a failed one included, is in flight."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    eos = kit._utils.EOS_TOKEN_ID
    runner = request_runner(block_size=16, num_gpu_blocks=400, async_scheduling=False)
    spec = runner.offloading_spec
    manager = kit.KVLifeRunnerSpec.current.kvlife_manager
    worker = spec.handler.kvlife
    engine = worker.engine
    engine.fail_rate = FAIL_RATE
    engine._rng.seed(FAIL_SEED)

    # Pages handed out by the manager, checked against the engine's copies in flight.
    violations: list[str] = []
    checked = {"store": 0, "load": 0}
    prepare_store, prepare_load = manager.prepare_store, manager.prepare_load

    def check(kind: str, pages: list[int]) -> None:
        busy = engine.host_pages_busy(reads=kind == "store")
        if busy & set(pages):
            violations.append(f"{kind} handed out {sorted(busy & set(pages))}")
        checked[kind] += 1

    def guarded_store(keys: Any, ctx: Any) -> Any:
        out = prepare_store(keys, ctx)
        if out is not None:
            check("store", list(out.store_spec.block_ids))
        return out

    def guarded_load(keys: Any, ctx: Any, *args: Any, **kwargs: Any) -> Any:
        out = prepare_load(keys, ctx, *args, **kwargs)
        check("load", list(out.block_ids))
        return out

    manager.prepare_store = guarded_store
    manager.prepare_load = guarded_load

    # What vLLM's worker connector reports: the requests whose load failed.
    failed_recving: set[str] = set()
    get_results = runner.worker_connector.get_transfer_results

    def results(*args: Any, **kwargs: Any) -> Any:
        out = get_results(*args, **kwargs)
        failed_recving.update(out.failed_recving or ())
        return out

    runner.worker_connector.get_transfer_results = results

    rng = random.Random(7)
    prompts = [
        [rng.randrange(1, 5000) for _ in range(16 * rng.randint(2, 5) + 3)] for _ in range(24)
    ]
    handler = spec.handler
    ctx = ReqContext("probe")
    manager.on_new_request(ctx)
    dropped = 0
    for round_ in range(2):
        for prompt in prompts:
            runner.new_request(token_ids=prompt)
            runner._run(decoded_tokens=[0, eos], complete_transfers=True)
            assert not runner.scheduler.requests  # the request completed
        if round_ == 0:
            # Failed stores dropped: their keys are misses; the stored ones hits.
            for job, (src, dst) in handler.transfer_specs.items():
                if not isinstance(src, kit.KVLifeHostSpec):
                    want = LookupResult.HIT if handler.outcomes[job] else LookupResult.MISS
                    dropped += not handler.outcomes[job]
                    for key in dst.offload_keys:
                        assert manager.lookup(key, ctx) is want, (job, want)
            assert runner.scheduler.reset_prefix_cache()
    assert dropped

    assert not handler._results and not handler.waiting_jobs  # every job reached vLLM
    jobs = handler.transfer_specs
    outcome = handler.outcomes
    assert set(outcome) == set(jobs)
    failed = [job for job, ok in outcome.items() if not ok]
    store_jobs = [j for j, (src, _) in jobs.items() if not isinstance(src, kit.KVLifeHostSpec)]
    load_jobs = [j for j in jobs if j not in store_jobs]
    failed_stores = [j for j in failed if j in store_jobs]
    failed_loads = [j for j in failed if j in load_jobs]
    assert failed_stores and failed_loads, (len(jobs), failed)
    assert worker.refusals.count("copy_failures") == len(failed)
    assert worker.stats["copies_made_directly"] == 0  # reported, never made behind vLLM
    # Failed loads: reported to vLLM as their requests' failed_recving.
    # (a request loads its hit in one job here: one failed load job, one request)
    assert len(failed_recving) == len(failed_loads), (failed_recving, failed_loads)
    # Pages: none handed out under a copy in flight; the books balance.
    assert checked["store"] > 20 and checked["load"] > 10, checked
    assert not violations, violations[:5]
    acc = manager.accounting()
    assert acc["pending"] == 0 and acc["pinned"] == 0, acc
    print(
        f"\n0.34 faults: {len(failed)} of {len(jobs)} jobs failed ({len(failed_stores)} of "
        f"{len(store_jobs)} stores dropped, {len(failed_loads)} of {len(load_jobs)} loads "
        f"recomputed); pages checked at {checked}"
    )


def test_failed_copy_of_a_synchronous_load_is_made_again_not_fatal(
    request_runner: Any,
) -> None:
    """Scenario: vLLM 0.34's scheduler and connector over kvlife's manager and worker,
    with synchronous loads on (``sync_load_budget_bytes``: a hit that fits is loaded in
    the step that runs its request, ``submit_load(..., expedited=True)`` then ``wait``).
    16 prompts are stored, the device blocks are zeroed and vLLM's prefix cache dropped,
    and the prompts run again, each with two new blocks, while kvlife's copy engine fails
    30 % of the copies. vLLM
    raises on a failed synchronous load (its request already runs on the blocks): each
    failed copy of one is made again at once, so every request completes, every
    synchronous load reports success and its device blocks hold the host pages' bytes
    when vLLM's wait returns; failed stores are still reported failed (dropped)."""
    import torch

    eos = kit._utils.EOS_TOKEN_ID
    runner = request_runner(
        block_size=16,
        num_gpu_blocks=400,
        async_scheduling=False,
        extra_config_overrides={"sync_load_budget_bytes": 1 << 30},
    )
    handler = runner.offloading_spec.handler
    worker = handler.kvlife
    layout, pool = worker.layout, worker.pool
    gen = torch.Generator().manual_seed(5)
    for block in range(400):  # distinct bytes in every device block
        row = torch.randint(-128, 128, (layout.page_numel,), dtype=torch.int8, generator=gen)
        layout.write_page(block, row)

    # Each synchronous load's device blocks against its host pages, when vLLM's wait returns.
    mismatched: list[int] = []
    checked: list[int] = []
    wait = handler.wait

    def checked_wait(job_ids: set[int]) -> None:
        wait(job_ids)
        for job in job_ids & handler.expedited:
            device, host = handler.loads[job]
            checked.append(job)
            for d, h in zip(device, host, strict=True):
                if not torch.equal(layout.read_page(d).cpu(), pool.tensor[h].cpu()):
                    mismatched.append(job)

    handler.wait = checked_wait

    rng = random.Random(11)
    prompts = [
        [rng.randrange(1, 5000) for _ in range(16 * rng.randint(2, 4) + 3)] for _ in range(16)
    ]
    for prompt in prompts:
        runner.new_request(token_ids=prompt)
        runner._run(decoded_tokens=[0, eos], complete_transfers=True)
    assert runner.scheduler.reset_prefix_cache()
    zero = torch.zeros(layout.page_numel, dtype=torch.int8)
    for block in range(400):  # a load that copies nothing leaves zeros
        layout.write_page(block, zero)
    stores_before = set(handler.outcomes)

    worker.engine.fail_rate = 0.3
    worker.engine._rng.seed(FAIL_SEED)
    for prompt in prompts:  # the stored prefix, and new blocks to store
        runner.new_request(token_ids=prompt + [rng.randrange(1, 5000) for _ in range(32)])
        runner._run(decoded_tokens=[0, eos], complete_transfers=True)
        assert not runner.scheduler.requests  # the request completed

    sync = handler.expedited
    assert len(sync) >= 10, sorted(sync)  # the hits were loaded synchronously
    assert sorted(checked) == sorted(sync)
    assert all(handler.outcomes[job] for job in sync), "a synchronous load reported failed"
    assert not mismatched, mismatched
    made_again = worker.stats["copies_made_directly"]
    assert made_again > 0, "no copy of a synchronous load failed: the test tests nothing"
    later = [j for j in handler.outcomes if j not in stores_before and j not in handler.loads]
    failed_stores = [j for j in later if not handler.outcomes[j]]
    # Every failed copy was either made again (a synchronous load) or reported (a store).
    assert failed_stores, later  # stores still fail as they did: reported, dropped
    assert worker.refusals.count("copy_failures") == made_again + len(failed_stores)
    print(
        f"\n0.34 sync loads: {len(sync)} synchronous loads, {made_again} failed copies made "
        f"again; {len(failed_stores)} of {len(later)} later stores failed and dropped"
    )
