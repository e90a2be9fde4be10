#!/usr/bin/env bash
# CI step: MooncakeStore against a real Mooncake master and memory pool on loopback ports the
# tests pick (tests/test_store_mooncake.py starts them, kills them with SIGKILL, stops them by
# PID). Needs .ci/run's venv. Prints the step's time.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# Mooncake's binaries and store.so load libibverbs.so.1 even over TCP.
if ! ldconfig -p | grep -q libibverbs.so.1; then
    { apt-get update -q && apt-get install -y -q libibverbs1; } >/dev/null
fi
. .venv/bin/activate
# Mooncake's non-CUDA client (the `mooncake` extra names the CUDA one a GPU user installs).
pip install --quiet mooncake-transfer-engine-non-cuda==0.3.13.post1
export MC_TCP_BIND_ADDRESS=127.0.0.1
python -m pytest -q -p no:cacheprovider tests/test_store_mooncake.py
echo "mooncake step: $(( $(date +%s) - start )) s"
