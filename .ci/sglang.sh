#!/usr/bin/env bash
# CI step: the SGLang storage backend against SGLang's real HiCacheStorage, in a venv of its own
# (.venv-sglang): sglang installed --no-deps (its full install pulls a CUDA torch) with the CPU
# torch and the packages sglang.srt.mem_cache.hicache_storage imports. Prints the step's time.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
python3 -m venv .venv-sglang
. .venv-sglang/bin/activate
pip install --quiet torch==2.13.0
pip install --quiet --no-deps sglang==0.5.23
pip install --quiet orjson psutil pybase64 requests triton packaging pillow starlette msgspec \
    pydantic pyzmq tqdm ipython aiohttp
# The decode offload manager's and the unified-cache linker's import chains (docs/sglang.md):
# pure-Python packages SGLang pins; torchvision and the CUDA kernels get stand-ins
# (tests/sglang_stubs.py).
pip install --quiet apache-tvm-ffi==0.1.11 transformers==5.19.0 openai==2.8.0 dill \
    sentencepiece compressed-tensors gguf partial_json_parser setproctitle einops uvicorn fastapi
pip install --quiet -e '.[test]'
python -m pytest -q -p no:cacheprovider tests/test_sglang_backend.py tests/test_sglang_decode.py \
    tests/test_sglang_linker.py
echo "sglang step: $(( $(date +%s) - start )) s"
