#!/usr/bin/env bash
# Issue 56's device runs (FourSight inside vLLM on the GPU), each step in its own process under its own cap, after
# the staging step has run in the same call (docs/gpu.md, "The device bootstrap"):
#
#   source benchmarks/device/stage.sh --need vllm && STEPS=bench ROWS=bf16,fs128 bash benchmarks/engine/device_engine.sh
#   source benchmarks/device/stage.sh --need all && STEPS=tests,update bash benchmarks/engine/device_engine.sh
#
# Steps (STEPS, comma-separated, run in this order):
#   pretune benchmarks/engine/pretune.py: the autotuner's disk cache filled for SmolLM2's shapes (k > 0, k = 0) and
#           the 8B's (k > 0), so the engines of the later steps and calls on this warm machine read their choices
#   tests   pytest tests/test_vllm_gpu.py tests/test_vllm_gpu_server.py (needs the model parts: --need all), with
#           the autotuner's disk cache on as an engine has it (the suite turns it off by default); the
#           correctness table goes to $OUT/correctness.md/json
#   bench   benchmarks/engine/bench_engine.py --rows $ROWS --workloads $WORKLOADS
#   update  benchmarks/engine/bench_update.py --rows $UPDATE_ROWS
# Caps: CAP_PRETUNE (300), CAP_TESTS (540), CAP_BENCH (520), CAP_UPDATE (300); TOTAL_S (570) bounds the call: a step that would get
# under 30 s is skipped with a note. $OUT gets at most 9 files: engine_summary.md (card, commit, kernels sha256,
# the step log and every table), correctness.json, engine.json, update.json, tests.log, engine_rest.tar.gz (every
# step's full output and log). FOURSIGHT_COMMIT names the commit (the device's copy has no git).
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out_engine}
STEPS=${STEPS:-tests,bench,update}
ROWS=${ROWS:-bf16,fs128}
WORKLOADS=${WORKLOADS:-c1,c16,c64,c256,c512}
UPDATE_ROWS=${UPDATE_ROWS:-bf16,fs128}
TOTAL_S=${TOTAL_S:-570}
CAP_PRETUNE=${CAP_PRETUNE:-300}
CAP_TESTS=${CAP_TESTS:-540}
TUNE_CACHE=${FOURSIGHT_TUNE_CACHE_DIR:-$HOME/.cache/foursight/autotune}
CAP_BENCH=${CAP_BENCH:-520}
CAP_UPDATE=${CAP_UPDATE:-300}
PY=${PY:-python3}
DRY=""; [ "${DRY_RUN:-0}" = 1 ] && DRY="--dry-run"  # CPU: the bench step writes its models and an empty table
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
W=$(mktemp -d /tmp/engwork.XXXX)
LOG="$W/steps.log"
export PYTHONUNBUFFERED=1 FOURSIGHT_COMMIT=${FOURSIGHT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo "${FOURSIGHT_PARTS_COMMIT:-unknown}")}
KSHA=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); from common import kernels_sha256; print(kernels_sha256())")
CARD=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
say() { echo "[device_engine +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
say "commit $FOURSIGHT_COMMIT, kernels sha256 $KSHA, card: ${CARD:-no GPU}; steps $STEPS; rows $ROWS; total ${TOTAL_S}s"
want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
cap() { local l=$(( TOTAL_S - 10 - ($(date +%s) - T0) )); if [ "$1" -lt "$l" ]; then echo "$1"; else echo "$l"; fi; }
run_step() {  # run_step <name> <cap> <command...>
  local name=$1 c; c=$(cap "$2"); shift 2
  if [ "$c" -lt 30 ]; then say "$name: SKIPPED (${c}s left)"; return 0; fi
  say "$name: up to ${c}s: $*"
  local t=$(date +%s)
  timeout -k 10 "$c" "$@" > "$W/$name.out" 2>&1
  local rc=$?
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && say "$name: CUT at its ${c}s limit"
  say "$name: rc $rc in $(( $(date +%s) - t ))s"
  tail -5 "$W/$name.out" | sed "s/^/    /" | tee -a "$LOG"
}

if want pretune && [ -z "$DRY" ]; then
  # SmolLM2 first (the tests' engines: k = 32 / 128 share the k > 0 key, then k = 0; the first shape also pays the
  # Triton compiles, ~100 s on the H100), then the 8B shapes with channels (the bench's fs128) with what is left
  run_step pretune "$CAP_PRETUNE" env FOURSIGHT_TUNE_CACHE="$TUNE_CACHE" bash -c "$PY benchmarks/engine/pretune.py \
    --config benchmarks/engine/smollm2-135m-config.json --channels 128,0 --budget-s 60 --out $W/pretune_smollm2.json && \
    $PY benchmarks/engine/pretune.py --config benchmarks/engine/llama-3.1-8b-config.json --channels 128 \
    --budget-s $(( $(cap "$CAP_PRETUNE") - 200 )) --out $W/pretune.json"
  cp "$W"/pretune*.json "$OUT/" 2>/dev/null
fi
if want tests && [ -z "$DRY" ]; then
  run_step tests "$CAP_TESTS" env FOURSIGHT_GPU_RESULTS="$W" FOURSIGHT_TUNE_CACHE="$TUNE_CACHE" $PY -m pytest -v -p no:cacheprovider -rfE --durations=10 \
    tests/test_vllm_gpu.py tests/test_vllm_gpu_server.py
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$W/tests.out" | sed 's#^tests/##' > "$OUT/tests.log"
fi
if want bench; then
  # per row, from its start: a cold FourSight engine spends ~3 minutes starting (compile, profile, graph capture with
  # the autotuner; benchmarks/results/engine-h100-2026-12-07), BF16 ~1 minute; the workloads ~1-2 minutes more
  run_step bench "$CAP_BENCH" $PY benchmarks/engine/bench_engine.py --rows "$ROWS" --workloads "$WORKLOADS" --out "$W/engine" \
    --budget-s "${BENCH_BUDGET_S:-300}" --timeout-s "${BENCH_TIMEOUT_S:-360}" $DRY
fi
if want update && [ -z "$DRY" ]; then
  run_step update "$CAP_UPDATE" $PY benchmarks/engine/bench_update.py --rows "$UPDATE_ROWS" --out "$W/update" --timeout-s $(( $(cap "$CAP_UPDATE") / 2 - 5 ))
fi

{
  echo "# Issue 56 device run: $CARD"
  echo
  echo "commit $FOURSIGHT_COMMIT, kernels sha256 $KSHA"
  echo
  echo '```'; cat "$LOG"; echo '```'
  for f in "$W/correctness.md" "$W/engine/engine.md" "$W/update/update.md"; do [ -f "$f" ] && { echo; cat "$f"; }; done
  [ -f "$W/update_smollm2.json" ] && { echo; echo "SmolLM2 TRL sync on the GPU (tests/test_vllm_gpu.py):"; cat "$W/update_smollm2.json"; }
} > "$OUT/engine_summary.md"
for f in "$W/correctness.json" "$W/engine/engine.json" "$W/update/update.json"; do [ -f "$f" ] && cp "$f" "$OUT/"; done
tar -czf "$OUT/engine_rest.tar.gz" -C "$W" . 2>/dev/null
say "done; $OUT: $(ls "$OUT" | tr '\n' ' ')"
