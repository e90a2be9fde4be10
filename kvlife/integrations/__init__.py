"""Adapters that plug kvlife into other runtimes.

Each submodule imports its runtime (vLLM, ...) and is imported only by that
runtime or by the user; nothing else in kvlife imports this package, so kvlife
itself never needs the runtime installed.

- :mod:`kvlife.integrations.vllm`: ``KVLifeOffloadingSpec``, a vLLM KV
  offloading backend (``pip install kvlife[vllm]``; see ``docs/vllm.md``).
- :mod:`kvlife.integrations.sglang`: ``KVLifeHiCacheStorage``, an SGLang HiCache
  storage backend on any kvlife store (see ``docs/store-tier.md``).
"""
