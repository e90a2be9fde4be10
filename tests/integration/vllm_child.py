"""A second vLLM process for tests/integration/test_vllm.py (warm restart, multiprocess mode).

Usage: ``python vllm_child.py ARGS.json``; ARGS holds model_dir, store_dir, report_dir,
prompts and fresh (token id lists), max_tokens and out (a path). Runs vLLM in its
default multiprocess mode with the kvlife backend, generates greedily ``prompts``
once (their blocks come from the persistent tier), then ``fresh`` twice with vLLM's
own prefix cache dropped in between (stored to the host tier by the worker's copy
engine in the worker process, then loaded back), writes the outputs to ``out`` as
JSON, and shuts the engine down (each role writes its accounting to report_dir).
Optional: ``extra`` (extra-config keys instead of store_dir: e.g. a Mooncake cluster),
``single_process`` (vLLM's single-process mode, faster to start), ``tp`` (tensor
parallel ranks, each a worker process) and ``clear_store``
(after the first round, vLLM's prefix cache dropped and the store directory emptied, then
``prompts`` again: their outputs in ``cleared``).
"""

from __future__ import annotations

import gc
import json
import os
import sys


def main() -> None:
    with open(sys.argv[1]) as f:
        args = json.load(f)
    single = bool(args.get("single_process"))
    if single:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvlife.integrations.vllm import transfer_config

    llm = LLM(
        model=args["model_dir"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        block_size=32,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.5,  # of CPU memory on vLLM's CPU build: a shared machine
        kv_transfer_config=transfer_config(
            8 << 20,
            report_dir=args["report_dir"],
            **(args.get("extra") or {"store_dir": args["store_dir"]}),
        ),
        tensor_parallel_size=int(args.get("tp", 1)),
        **({"distributed_executor_backend": "uni"} if single else {}),
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True, detokenize=False
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in args["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    cleared = None
    if args.get("clear_store"):  # the cache directory cleared while vLLM runs: same outputs
        import shutil

        assert llm.reset_prefix_cache(reset_connector=False)
        shutil.rmtree(args["store_dir"])
        os.mkdir(args["store_dir"])
        again = llm.generate(prompts, params, use_tqdm=False)
        cleared = [list(o.outputs[0].token_ids) for o in again]
    fresh = [TokensPrompt(prompt_token_ids=p) for p in args["fresh"]]
    rounds = []
    for _ in range(2 if args["fresh"] else 0):
        done = llm.generate(fresh, params, use_tqdm=False)
        rounds.append([list(o.outputs[0].token_ids) for o in done])
        assert llm.reset_prefix_cache()
    with open(args["out"], "w") as f:
        json.dump({"prompts": tokens, "fresh": rounds, "cleared": cleared}, f)
    # Shut the engine down with time to spare: each role drains, flushes its store and
    # writes its report as its process exits. vLLM's default grace before it kills the
    # engine processes is 5 s, which a loaded machine can overrun.
    llm.llm_engine.engine_core.shutdown(timeout=30)
    del llm, outputs
    gc.collect()


if __name__ == "__main__":  # vLLM's workers are spawned: they import this module
    main()
