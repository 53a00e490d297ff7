#!/usr/bin/env bash
# The H200 run of issue 26 for SpliceGEMM v3, in ONE command on a bare GPU machine (torch + Triton
# preinstalled; FourSight staged by benchmarks/device/stage.sh --need base), inside a time budget.
#
#   .venv/bin/python benchmarks/device/prepare.py --profile base   # on the CPU first: the part(s) to carry
#   bash benchmarks/kernels/device_v3.sh                 # on the device, carry [".devcarry/p1"]: results into $OUT
#                                                # (default /tmp/out_v3)
#   DRY_RUN=1 PY=.venv/bin/python OUT=/tmp/dry bash benchmarks/kernels/device_v3.sh   # on a CPU machine: every
#                                                # step's argument handling and JSON provenance, no GPU, no timing
#
# Steps (STEPS, comma-separated, in this order by default), each under a `timeout` that is the smaller
# of its cap and the time left before TOTAL_S (default 530 s) minus a reserve:
#   repeat     FOURSIGHT_REPEAT_REPS=50 pytest tests/test_kernels_repeat_gpu.py  -> repeat.log
#   gputests   pytest tests/test_kernels_gpu.py                                    -> gpu_tests.log
#   grid       benchmarks/kernels/bench_splice_gemm.py: the three 8B shapes + SmolLM2's, k in {0,128}, W4A4/W4A16,
#              cuBLAS BF16, FP8 rowwise (GEMM alone and with its quantization), GemLite (if .whl/ carries
#              its wheel)                                                          -> splice_gemm.{json,md}
#   breakdown  benchmarks/kernels/probe_breakdown.py: quant / GEMM / BF16 segment, PDL on and off -> breakdown.{json,md}
#   decode     benchmarks/kernels/bench_decode.py: BF16, FourSight W4A4 k=128 and W4A16, FP8 -> bench_decode.{json,md}
# That is 8 files in $OUT (the device tool returns at most 8). Every JSON records the commit
# (FOURSIGHT_COMMIT, else git), the sha256 of the kernels folder, the Triton version, PDL, and the
# configurations the autotuner chose.
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out_v3}
TOTAL_S=${TOTAL_S:-530}
RESERVE_S=${RESERVE_S:-15}
STEPS=${STEPS:-repeat,gputests,grid,breakdown,decode}
DRY_RUN=${DRY_RUN:-0}
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"

# FOURSIGHT_COMMIT, the package (on the device the one staging step, benchmarks/device/stage.sh --need base;
# the dry run: the interpreter's installed package) and KSHA: device_prelude.sh
source benchmarks/kernels/device_prelude.sh
if [ "$DRY_RUN" != "1" ] && ls .whl/*.whl >/dev/null 2>&1; then  # GemLite's wheel, when .whl/ carries it (the grid's optional baseline)
  $PY -m pip install -q --no-index --no-deps --target "$FOURSIGHT_STAGE/whl" .whl/*.whl >/dev/null 2>&1 \
    && export PYTHONPATH=$PYTHONPATH:$FOURSIGHT_STAGE/whl || echo "[device_v3] carried wheels did not install"
fi
echo "[device_v3] commit $FOURSIGHT_COMMIT, kernels sha256 $KSHA, steps $STEPS, total ${TOTAL_S}s, dry run $DRY_RUN"
$PY -c "import torch, triton; print('[device_v3] torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"

left() { echo $(( TOTAL_S - RESERVE_S - ($(date +%s) - T0) )); }
cap() {  # cap <seconds>: the timeout of the next step
  local l; l=$(left)
  if [ "$1" -lt "$l" ]; then echo "$1"; else echo "$l"; fi
}
want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
run_step() {  # run_step <name> <cap> <command...>
  local name=$1 c; c=$(cap "$2"); shift 2
  if [ "$c" -lt 20 ]; then echo "[device_v3] $name: not run (time budget)"; return 0; fi
  echo "[device_v3] $name: up to ${c}s: $*"
  local t=$(date +%s)
  timeout -k 5 "$c" "$@"
  local rc=$?
  echo "[device_v3] $name: rc $rc in $(( $(date +%s) - t ))s"
}

if [ "$DRY_RUN" = "1" ]; then
  want grid && $PY benchmarks/kernels/bench_splice_gemm.py --out "$OUT" --dry-run --shapes 8192x8192,14336x4096,4096x14336,960x576,576x576,3072x576,576x1536 \
    --ms 1,16,64,256,1024,4096 --smol-ms 1,16,256 --ks 0,128 --skip-config-check --budget-s 150 >/dev/null && echo "[device_v3] grid: dry run ok"
  want breakdown && $PY benchmarks/kernels/probe_breakdown.py --out "$OUT" --dry-run --shapes 8192x8192,14336x4096 --ms 1,16,64 >/dev/null \
    && echo "[device_v3] breakdown: dry run ok"
  want decode && $PY benchmarks/kernels/bench_decode.py --out "$OUT" --dry-run --modes bf16,foursight-w4a4,foursight-w4a16,fp8 --batches 1,16,64 \
    --budget-s 90 >/dev/null && echo "[device_v3] decode: dry run ok"
  want repeat && $PY -m pytest tests/test_kernels_repeat_gpu.py -q -p no:cacheprovider --collect-only 2>&1 | tail -1 | sed 's/^/[device_v3] repeat: /'
  want gputests && $PY -m pytest tests/test_kernels_gpu.py -q -p no:cacheprovider --collect-only 2>&1 | tail -1 | sed 's/^/[device_v3] gputests: /'
  ls "$OUT"
  exit 0
fi

if want repeat; then
  { echo "# FOURSIGHT_REPEAT_REPS=50 pytest tests/test_kernels_repeat_gpu.py; commit $FOURSIGHT_COMMIT; kernels sha256 $KSHA"
    nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
    export FOURSIGHT_REPEAT_REPS=50; run_step repeat 170 $PY -m pytest tests/test_kernels_repeat_gpu.py -q -p no:cacheprovider 2>&1 | tail -40
  } > "$OUT/repeat.log" 2>&1
  tail -3 "$OUT/repeat.log"
fi
if want gputests; then
  { echo "# pytest tests/test_kernels_gpu.py; commit $FOURSIGHT_COMMIT; kernels sha256 $KSHA"
    run_step gputests 110 $PY -m pytest tests/test_kernels_gpu.py -q -p no:cacheprovider 2>&1 | tail -40
  } > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
fi
if want grid; then
  c=$(cap 190)
  run_step grid 190 $PY benchmarks/kernels/bench_splice_gemm.py --out "$OUT" --shapes 8192x8192,14336x4096,4096x14336,960x576,576x576,3072x576,576x1536 \
    --ms 1,16,64,256,1024,4096 --smol-ms 1,16,256 --ks 0,128 --skip-config-check --budget-s $(( c > 60 ? c - 45 : 15 )) 2>&1 | grep -v "^{" | tail -60
fi
if want breakdown; then
  c=$(cap 70)
  run_step breakdown 70 $PY benchmarks/kernels/probe_breakdown.py --out "$OUT" --shapes 8192x8192,14336x4096 --ms 1,16,64 --budget-s $(( c > 40 ? c - 30 : 10 )) 2>&1 | tail -12
fi
if want decode; then
  c=$(cap 120)
  run_step decode 120 $PY benchmarks/kernels/bench_decode.py --out "$OUT" --modes bf16,foursight-w4a4,foursight-w4a16,fp8 --batches 1,16,64 \
    --budget-s $(( c > 60 ? c - 40 : 10 )) 2>&1 | tail -25
fi
echo "[device_v3] done in $(( $(date +%s) - T0 ))s"; ls -la "$OUT"
