#!/usr/bin/env bash
# Optional engine suites: each engine's own storage code, driven against a real kvfs mount,
# in a venv of its own under build/engine-venvs/ (ignored by git; never the dev .venv).
#
#   bash scripts/engine-suites.sh install sglang   # ~1 min, ~2.3 GB (CPU torch + triton)
#   bash scripts/engine-suites.sh test sglang      # tests/test_integration_sglang.py
#   bash scripts/engine-suites.sh install vllm     # ~2 min, ~3.4 GB (CPU torch + the vllm wheel)
#   bash scripts/engine-suites.sh test vllm
#
# Engines are installed with --no-deps plus only the modules their storage code imports:
# the full engines pull CUDA torch and several GB more, and do not run on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH="torch==2.13.0"
# A local CPU wheel when the machine has one, else the CPU wheel index.
TORCH_SRC=(--index-url https://download.pytorch.org/whl/cpu "$TORCH")
for w in /opt/wheels/torch-2.13.0+cpu-*.whl; do [ -e "$w" ] && TORCH_SRC=("$w"); done

usage() { echo "usage: $0 install|test sglang|vllm [pytest args...]" >&2; exit 2; }
[ $# -ge 2 ] || usage
action=$1 engine=$2
shift 2
venv="build/engine-venvs/$engine"

case "$engine" in
sglang)
    # What sglang.srt.mem_cache.hicache_storage (HiCacheFile) and the sglang package
    # import on the way: sglang/__init__ and sglang.srt.utils import these at top level.
    ENGINE_PKGS=(--no-deps "sglang==0.5.23")
    ENGINE_DEPS=(orjson psutil pybase64 "triton==3.9.0" pillow starlette msgspec pyzmq tqdm
        ipython aiohttp requests packaging)
    TESTS=(tests/test_integration_sglang.py)
    ;;
vllm)
    # What vllm's package import and vllm.v1.kv_offload.tiering.fs import on the way.
    ENGINE_PKGS=(--no-deps "vllm==0.33.0")
    ENGINE_DEPS=(psutil pyzmq "transformers>=5.16.1,<5.21" huggingface_hub tqdm httpx2
        httpcore2 truststore h11 cbor2 aiohttp openai_harmony openai pillow pybase64
        cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus_client xgrammar fastapi
        partial_json_parser llguidance)
    TESTS=(tests/test_integration_vllm.py)
    ;;
*) usage ;;
esac

case "$action" in
install)
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "${TORCH_SRC[@]}"
    "$venv/bin/pip" install -q -e '.[dev]'
    # Constrained so no dependency swaps the CPU torch for a CUDA build.
    "$venv/bin/pip" install -q -c <(echo "$TORCH") "${ENGINE_DEPS[@]}"
    "$venv/bin/pip" install -q "${ENGINE_PKGS[@]}"
    "$venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
    du -sh "$venv"
    ;;
test)
    [ -x "$venv/bin/pytest" ] || { echo "no $venv: run '$0 install $engine' first" >&2; exit 1; }
    "$venv/bin/pytest" -q "${TESTS[@]}" "$@"
    ;;
*) usage ;;
esac
