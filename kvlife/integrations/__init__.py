"""Adapters that plug kvlife into host runtimes (docs/design.md, "Architecture"): vLLM's
offloading spec (:mod:`kvlife.integrations.vllm`, docs/vllm.md) and SGLang's storage backend,
decode offload manager and cache linker (docs/sglang.md). Each submodule imports its runtime
and is imported only by that runtime or by the user, so kvlife never needs one installed."""
