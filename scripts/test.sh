#!/usr/bin/env bash
# Run the whole test suite: the main suite in .venv (format, calibration, checkpoints, Triton
# kernels under TRITON_INTERPRET=1, vLLM CPU engine, trainer bridge, compare) and, beside it, the
# SGLang suite in .venv-sglang. Every run names its slowest tests (--durations). GPU-only tests
# are marked `gpu` and skip on a machine without CUDA.
# Extra arguments go to every pytest run (e.g. -x, -k expr).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VENV="${FOURSIGHT_VENV:-$REPO/.venv}"
SGL_VENV="${SGLANG_VENV:-$REPO/.venv-sglang}"

# The Triton kernel tests run in their own process: they set TRITON_INTERPRET=1 for the process,
# which must not leak into the engines that later tests start. The interpreter is single-threaded
# Python, so that process runs beside the main suite (on 2 cores it hides its ~3 min); its output
# is printed once it ends.
KERNEL_TESTS=(tests/test_kernels.py tests/test_kernels_actq.py tests/test_act_quant_xs_split.py tests/test_blackwell_kernels.py tests/test_kernels_ws.py tests/test_kernels_v4.py tests/test_producers.py tests/test_engine_weight_release.py tests/test_fp8_producers.py tests/test_kernels_forms.py tests/test_kernels_zfill.py)
IGNORE=()
for t in "${KERNEL_TESTS[@]}"; do IGNORE+=("--ignore=$t"); done
KLOG=$(mktemp /tmp/foursight-kernel-tests.XXXX)
"$VENV/bin/python" -m pytest "${KERNEL_TESTS[@]}" -p no:cacheprovider --timeout=900 --durations=30 "$@" >"$KLOG" 2>&1 &
kpid=$!
# The SGLang suite runs beside the main suite too (its own venv and engines; it took 6-7 minutes after the main
# suite, which spends most of its time waiting on engine subprocesses); its output is printed once it ends.
SLOG=$(mktemp /tmp/foursight-sglang-tests.XXXX)
spid=""
if [ "${FOURSIGHT_SKIP_SGLANG:-0}" = "1" ]; then
    echo "[test] SGLang suite skipped (FOURSIGHT_SKIP_SGLANG=1)" >"$SLOG"
else
    "$SGL_VENV/bin/python" -m pytest tests/sglang -p no:cacheprovider --timeout=900 --durations=30 "$@" >"$SLOG" 2>&1 &
    spid=$!
fi
# The main suite runs as two processes, side by side: the engine road (the bridge's and vLLM's tests:
# engine servers, the shared BF16 vLLM server of test_bridge_vllm.py and test_bridge_openai_vllm.py) and
# the rest. After the interpreter and SGLang suites end (13-17 min), one pytest process alone left the
# second core mostly idle while it waited on its engines: as one process the main suite took 33 min.
ROAD=(tests/test_bridge_*.py tests/test_vllm_*.py)
for t in "${ROAD[@]}"; do IGNORE+=("--ignore=$t"); done
RLOG=$(mktemp /tmp/foursight-rest-tests.XXXX)
"$VENV/bin/python" -m pytest tests "${IGNORE[@]}" --ignore=tests/sglang --ignore=tests/sglang_harness \
    -p no:cacheprovider --timeout=1800 --durations=30 "$@" >"$RLOG" 2>&1 &
rpid=$!
"$VENV/bin/python" -m pytest "${ROAD[@]}" -p no:cacheprovider --timeout=1800 --durations=30 "$@"
rc_main=$?

# collect PID LOG TITLE: wait for a suite run in the background (none when PID is empty), print its
# output under TITLE and remove its log; its exit status
collect() {
    local rc=0
    [ -z "$1" ] || wait "$1" || rc=$?
    echo "[test] $3:"
    cat "$2"
    rm -f "$2"
    return "$rc"
}
collect "$rpid" "$RLOG" "the rest of the main suite, run beside the engine road" || rc_main=$?
collect "$kpid" "$KLOG" "kernel tests (interpreter), run beside the main suite" || rc_main=$?
rc_sgl=0
collect "$spid" "$SLOG" "SGLang suite, run beside the main suite" || rc_sgl=$?
echo "[test] main suite exit $rc_main, SGLang suite exit $rc_sgl"
[ "$rc_main" -eq 0 ] && [ "$rc_sgl" -eq 0 ]
