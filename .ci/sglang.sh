#!/usr/bin/env bash
# CI step: kvlife's SGLang integrations against SGLang 0.5.23's real classes, in a venv of its own
# (KVLIFE_SGLANG_VENV, default .venv-sglang): sglang installed --no-deps (its full install pulls a
# CUDA torch) beside the CPU torch, then the packages its modules import, at SGLang's own pins
# where it pins them. Prints the step's time. `.ci/sglang.sh deps` installs the third-party
# packages alone (what .ci/run starts in the background); a later full run finds them there.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVLIFE_SGLANG_VENV:-.venv-sglang}
start=$(date +%s)
python3 -m venv "$venv"
[ -e "$venv/.gitignore" ] || echo '*' >"$venv/.gitignore"  # never committed, whatever its name
. "$venv/bin/activate"
pip install --quiet torch==2.13.0
pip install --quiet --no-deps sglang==0.5.23
pip install --quiet orjson psutil pybase64 requests triton packaging pillow starlette msgspec \
    pydantic 'pyzmq>=25.1.2' tqdm ipython aiohttp
# The decode offload manager's and the unified-cache linker's import chains (docs/sglang.md):
# pure-Python packages, pinned as SGLang 0.5.23 pins them (its wheel's Requires-Dist);
# torchvision gets a stand-in (tests/sglang_stubs.py).
pip install --quiet apache-tvm-ffi==0.1.11 transformers==5.19.0 openai==2.8.0 \
    sentencepiece==0.2.1 compressed-tensors==0.18.0 'uvicorn>=0.51' dill gguf \
    partial_json_parser setproctitle einops fastapi
if [ "${1:-}" = deps ]; then
    exit 0
fi
pip install --quiet -e '.[test]'
python -m pytest -q -p no:cacheprovider tests/test_sglang_backend.py tests/test_sglang_decode.py \
    tests/test_sglang_decode_tp.py tests/test_sglang_linker.py
echo "sglang step: $(( $(date +%s) - start )) s"
