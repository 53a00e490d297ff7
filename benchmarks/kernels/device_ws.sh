#!/usr/bin/env bash
# The warp-specialized Gluon SpliceGEMM form (issue 26, item 4) on the H200, in ONE command on a bare
# GPU machine (torch + Triton 3.6 preinstalled; FourSight staged by benchmarks/device/stage.sh --need base),
# inside a budget.
#
#   .venv/bin/python benchmarks/device/prepare.py --profile base   # on the CPU first: the part(s) to carry
#   bash benchmarks/kernels/device_ws.sh                      # on the device, carry [".devcarry/p1"]: results into
#                                                             # $OUT (default /tmp/out_ws)
#   DRY_RUN=1 PY=.venv/bin/python OUT=/tmp/dry bash benchmarks/kernels/device_ws.sh   # CPU machine: arguments and
#                                                             # JSON provenance, no GPU, no timing
#
# Steps (STEPS, comma-separated, in this order by default), each under a `timeout` that is the smaller
# of its cap and the time left before TOTAL_S (default 500 s) minus a reserve:
#   gputests  pytest tests/test_kernels_ws_gpu.py (Gluon vs reference_linear on the 8B and SmolLM2 shapes,
#             M in {1,16,64,128,256}, k in {0,128}, W4A4/W4A16, 10 repeated calls bit-identical; every Gluon
#             candidate; the autotuner's check)                                         -> ws_gpu_tests.log
#   bench     benchmarks/kernels/bench_ws.py: the three 8B shapes x M in {1,16,64,128,256}, W4A4 k=128 (then
#             W4A16 k=128 if BENCH_MODES says so): cuBLAS BF16, the best v3 form, the Gluon form forced
#                                                                                        -> bench_ws.{json,md}
# Every JSON records the commit (FOURSIGHT_COMMIT, else git), the sha256 of the kernels folder and the
# Triton version.
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out_ws}
TOTAL_S=${TOTAL_S:-500}
RESERVE_S=${RESERVE_S:-10}
STEPS=${STEPS:-gputests,bench}
BENCH_MODES=${BENCH_MODES:-w4a4,w4a16}
DRY_RUN=${DRY_RUN:-0}
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"

# FOURSIGHT_COMMIT, the package (on the device the one staging step, benchmarks/device/stage.sh --need base;
# the dry run: the interpreter's installed package) and KSHA: device_prelude.sh
source benchmarks/kernels/device_prelude.sh
echo "[device_ws] commit $FOURSIGHT_COMMIT, kernels sha256 $KSHA, steps $STEPS, total ${TOTAL_S}s, dry run $DRY_RUN"
$PY -c "import torch, triton; print('[device_ws] torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
$PY -c "import foursight.kernels.experimental.gluon_ws as g; print('[device_ws] gluon available:', g.available(), g.GLUON_IMPORT_ERROR)"

left() { echo $(( TOTAL_S - RESERVE_S - ($(date +%s) - T0) )); }
cap() {  # cap <seconds>: the timeout of the next step
  local l; l=$(left)
  if [ "$1" -lt "$l" ]; then echo "$1"; else echo "$l"; fi
}
want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
run_step() {  # run_step <name> <cap> <command...>
  local name=$1 c; c=$(cap "$2"); shift 2
  if [ "$c" -lt 20 ]; then echo "[device_ws] $name: not run (time budget)"; return 0; fi
  echo "[device_ws] $name: up to ${c}s: $*"
  local t=$(date +%s)
  timeout -k 5 "$c" "$@"
  local rc=$?
  echo "[device_ws] $name: rc $rc in $(( $(date +%s) - t ))s"
}

if [ "$DRY_RUN" = "1" ]; then
  want bench && $PY benchmarks/kernels/bench_ws.py --out "$OUT" --dry-run --modes "$BENCH_MODES" --budget-s 100 \
    && echo "[device_ws] bench: dry run ok"
  want gputests && $PY -m pytest tests/test_kernels_ws_gpu.py -q -p no:cacheprovider --collect-only 2>&1 | tail -1 | sed 's/^/[device_ws] gputests: /'
  ls "$OUT"
  exit 0
fi

if want gputests; then
  { echo "# pytest tests/test_kernels_ws_gpu.py; commit $FOURSIGHT_COMMIT; kernels sha256 $KSHA"
    nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
    run_step gputests 240 $PY -m pytest tests/test_kernels_ws_gpu.py -q -s -p no:cacheprovider --maxfail=6 -rfEs --tb=line 2>&1 | tail -60
  } > "$OUT/ws_gpu_tests.log" 2>&1
  tail -5 "$OUT/ws_gpu_tests.log"
fi
if want bench; then
  c=$(cap 250)
  run_step bench 250 $PY benchmarks/kernels/bench_ws.py --out "$OUT" --modes "$BENCH_MODES" --budget-s $(( c > 60 ? c - 40 : 15 )) 2>&1 | tail -40
  [ -f "$OUT/bench_ws.md" ] && cat "$OUT/bench_ws.md"
fi
echo "[device_ws] done in $(( $(date +%s) - T0 ))s"; ls -la "$OUT"
