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
pip install --quiet -e '.[test]'
python -m pytest -q -p no:cacheprovider tests/test_sglang_backend.py
echo "sglang step: $(( $(date +%s) - start )) s"
