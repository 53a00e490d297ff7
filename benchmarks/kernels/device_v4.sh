#!/usr/bin/env bash
# SpliceGEMM v4 (issue 36) on one H100 or H200, in ONE device command on a bare GPU machine (torch +
# Triton preinstalled, ncu, no install of this package), inside a time budget that leaves ~30 s of the
# call for another script appended after it.
#
#   bash benchmarks/kernels/device_v4.sh                      # on the device: results into $OUT
#   DRY_RUN=1 OUT=/tmp/dry PY=.venv/bin/python bash benchmarks/kernels/device_v4.sh   # CPU: arguments,
#                                                   # provenance fields and the packing of $OUT, no GPU
#
# Steps (STEPS, comma-separated; this order), each under `timeout` = min(its cap, time left before
# TOTAL_S (default 465 s) minus RESERVE_S); a step that would get under 20 s is skipped with a note:
#   probe      benchmarks/kernels/probe_v4.py: PDL on/off, the timer's three flushes and rotated copies on cuBLAS
#              and on the chosen tile, static scale, the one-launch streaming ceiling (8192², 14336x4096; M 1/16/64)
#   ncu        Nsight Compute on probe_v4.py --ncu-target: stall reasons, scheduler, occupancy, speed of light of
#              the W4A4 call (quantizer + GEMM) and cuBLAS at M = 1/16/64, 8192², the probe's tiles
#   graph      pytest tests/test_kernels_graph_gpu.py (torch.compile + CUDA graphs = eager, bit for bit)
#   repeat     FOURSIGHT_REPEAT_REPS=50 FOURSIGHT_REPEAT_QUICK=1 pytest tests/test_kernels_repeat_gpu.py (every candidate at M 1/16/64/1024, static scale too where quant_in; 50 calls)
#   grid       benchmarks/kernels/bench_splice_gemm.py: the three 8B shapes, M 1/16/64/256, k 0/128, W4A4/W4A16,
#              cuBLAS BF16 and FP8 rowwise, rotated weights, one process
#   decode     benchmarks/kernels/bench_decode.py: 8B-shaped decoder, BF16, FourSight W4A4 k=128 and k=0, FP8
#              rowwise; batch 1/16/64 (no prefill)
#   breakdown  benchmarks/kernels/probe_breakdown.py: quantizer / GEMM / BF16 columns, 8192², M 1/64 (last: the
#              probe already has PDL and the whole call; this splits the call into its parts)
#   columns    (opt-in, not in the default STEPS) benchmarks/kernels/probe_columns.py: the BF16 columns' cost at
#              8192², M 16/64, the H100 grid's tiles forced, k = 0 vs k = 128, the columns before the FP4 loop
#              (today) vs after it (cols_late) and gathered vs dense X[:, S]; writes columns.json (+ columns.md
#              into v4_summary.md). ~2-3 min: `STEPS=columns TOTAL_S=230 bash benchmarks/kernels/device_v4.sh`
#              (carry .devcarry/a on a bare machine: the pydantic wheels are installed from it)
# The caps add up to ~485 s; steps usually end before their caps, and a step left with < 20 s is skipped
# with a note in v4_summary.md (the last ones first).
# $OUT gets 7 files (the device tool returns 8; one is left for the appended script):
#   v4_summary.md  card, commit, kernels sha256, step log, every markdown table
#   probe_v4.json  ncu_stalls.csv  splice_gemm.json  bench_decode.json  tests.log (graph + repeat)
#   v4_rest.tar.gz everything else (breakdown.json/md, the markdown files, ncu's raw log)
# Each file names the commit (FOURSIGHT_COMMIT, else git) and the sha256 of the kernels folder.
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out_v4}
TOTAL_S=${TOTAL_S:-465}
RESERVE_S=${RESERVE_S:-10}
STEPS=${STEPS:-probe,ncu,graph,repeat,grid,decode,breakdown}
DRY_RUN=${DRY_RUN:-0}
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
W=$(mktemp -d /tmp/v4work.XXXX)   # full outputs; packed into $OUT at the end
LOG="$W/steps.log"

if [ -z "${FOURSIGHT_COMMIT:-}" ]; then
  FOURSIGHT_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
fi
export FOURSIGHT_COMMIT

# the package as `foursight` without an install (pyproject's package-dir mapping, by copies)
PP=$(mktemp -d /tmp/pp.XXXX)
mkdir -p "$PP/foursight"
cp -r foursight_engine/* "$PP/foursight/"
cp -r kernels "$PP/foursight/kernels"
cp -r quant_methods "$PP/foursight/quant_methods"
cp foursight_autoload.py "$PP/"
export PYTHONPATH=$PP:/tmp/site:$ROOT  # /tmp/site: the pydantic wheels rl_device.sh stage installs (foursight.schema needs pydantic); $ROOT: foursight_autoload
# a bare machine without that stage: install the carried pydantic wheels (.devcarry/a, rl_prepare_carry.py) here
if ! $PY -c "import pydantic" 2>/dev/null && ls .devcarry/a/pydantic-*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .devcarry/a/*.whl 2>&1 | tail -2  # as rl_device.sh's stage
fi
KSHA=$($PY -c "
import hashlib, pathlib
h = hashlib.sha256()
for f in sorted(pathlib.Path('kernels').glob('*.py')):
    h.update(f.name.encode()); h.update(f.read_bytes())
print(h.hexdigest())")
CARD=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
CARD=${CARD:-no GPU (dry run)}
HDR="commit $FOURSIGHT_COMMIT, kernels sha256 $KSHA, card: $CARD"
say() { echo "[device_v4 +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
say "$HDR; steps $STEPS; total ${TOTAL_S}s; dry run $DRY_RUN"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" 2>&1 | tee -a "$LOG"

left() { echo $(( TOTAL_S - RESERVE_S - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); if [ "$1" -lt "$l" ]; then echo "$1"; else echo "$l"; fi; }
want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
run_step() {  # run_step <name> <cap> <command...>: the command's output goes to $W/<name>.out
  local name=$1 c; c=$(cap "$2"); shift 2
  if [ "$c" -lt 20 ]; then say "$name: SKIPPED (time budget: ${c}s left)"; return 0; fi
  say "$name: up to ${c}s: $*"
  local t=$(date +%s)
  timeout -k 5 "$c" "$@" > "$W/$name.out" 2>&1
  local rc=$?
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && say "$name: CUT at its ${c}s limit (partial results kept)"
  say "$name: rc $rc in $(( $(date +%s) - t ))s"
  tail -4 "$W/$name.out" | sed "s/^/    /" | tee -a "$LOG"
}
budget() { local c; c=$(cap "$1"); echo $(( c > $2 + 15 ? c - $2 : 10 )); }  # budget <cap> <margin>: a script's own --budget-s

DRY=""; [ "$DRY_RUN" = "1" ] && DRY="--dry-run"

if want probe; then
  run_step probe 90 $PY benchmarks/kernels/probe_v4.py --out "$W" --shapes 8192x8192,14336x4096 --ms 1,16,64 --k 128 \
    --budget-s "$(budget 90 35)" $DRY
fi
if want ncu; then
  NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats"
  NCU_METRICS="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum.per_second,smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active"
  if [ "$DRY_RUN" = "1" ]; then
    say "ncu: dry run: $(command -v ncu || echo 'ncu not on this machine'); target: $PY benchmarks/kernels/probe_v4.py --ncu-target --shapes 8192x8192 --ms 1,16,64 --configs-from $W/probe_v4.json"
    $PY benchmarks/kernels/probe_v4.py --help >/dev/null && say "ncu: target parses its arguments"
  else
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -z "$NCU" ] && say "ncu: not found on this machine; step skipped"
    [ -n "$NCU" ] && run_step ncu 60 "$NCU" --profile-from-start off $NCU_SECTIONS --metrics "$NCU_METRICS" --csv --page raw --log-file "$W/ncu.csv" \
      $PY benchmarks/kernels/probe_v4.py --ncu-target --shapes 8192x8192 --ms 1,16,64 --k 128 --configs-from "$W/probe_v4.json"
    if [ -n "$NCU" ] && ! grep -q "stalled" "$W/ncu.csv" 2>/dev/null; then  # the metric list refused: sections only
      say "ncu: no stall metrics in the output; again with the sections only"
      run_step ncu_sections 40 "$NCU" --profile-from-start off $NCU_SECTIONS --csv --page raw --log-file "$W/ncu.csv" \
        $PY benchmarks/kernels/probe_v4.py --ncu-target --shapes 8192x8192 --ms 1,16,64 --k 128 --configs-from "$W/probe_v4.json"
    fi
  fi
fi
if want graph; then
  if [ "$DRY_RUN" = "1" ]; then
    $PY -m pytest tests/test_kernels_graph_gpu.py -q -p no:cacheprovider -rs 2>&1 | tail -2 | sed 's/^/[graph dry] /' | tee -a "$LOG"
  else
    run_step graph 45 $PY -m pytest tests/test_kernels_graph_gpu.py -q -p no:cacheprovider -rA
  fi
fi
if want repeat; then
  if [ "$DRY_RUN" = "1" ]; then
    $PY -m pytest tests/test_kernels_repeat_gpu.py -q -p no:cacheprovider --collect-only 2>&1 | tail -1 | sed 's/^/[repeat dry] /' | tee -a "$LOG"
  else
    export FOURSIGHT_REPEAT_REPS=50 FOURSIGHT_REPEAT_QUICK=1; run_step repeat 75 $PY -m pytest tests/test_kernels_repeat_gpu.py -q -p no:cacheprovider -rf
  fi
fi
if want grid; then
  run_step grid 85 $PY benchmarks/kernels/bench_splice_gemm.py --out "$W" --shapes 8192x8192,14336x4096,4096x14336 \
    --ms 1,16,64,256 --ks 0,128 --skip-config-check --budget-s "$(budget 85 30)" $DRY
fi
if want decode; then
  run_step decode 100 $PY benchmarks/kernels/bench_decode.py --out "$W" --modes bf16,foursight-w4a4,foursight-w4a4-k0,fp8 \
    --batches 1,16,64 --prefill-tokens 0 --budget-s "$(budget 100 30)" $DRY
fi
if want breakdown; then
  run_step breakdown 35 $PY benchmarks/kernels/probe_breakdown.py --out "$W" --shapes 8192x8192 --ms 1,64 --budget-s "$(budget 35 15)" $DRY
fi
if want columns; then
  run_step columns 200 $PY benchmarks/kernels/probe_columns.py --out "$W" --shapes 8192x8192 --ms 16,64 --rounds 3 \
    --budget-s "$(budget 200 60)" $DRY
fi

# pack: 7 files into $OUT (8 with the columns step)
say "done in $(( $(date +%s) - T0 ))s; packing"
{ echo "# SpliceGEMM v4 device run (issue 36)"; echo; echo "$HDR"; echo; echo '```'; cat "$LOG"; echo '```'
  for f in probe_v4 splice_gemm breakdown bench_decode columns; do [ -f "$W/$f.md" ] && { echo; cat "$W/$f.md"; }; done
} > "$OUT/v4_summary.md"
for f in probe_v4.json splice_gemm.json bench_decode.json columns.json; do [ -f "$W/$f" ] && cp "$W/$f" "$OUT/$f"; done
{ echo "# $HDR"; echo "# Nsight Compute: W4A4 call (quantizer + GEMM) and cuBLAS per M (probe_v4.py --ncu-target), --page raw"
  cat "$W/ncu.csv" 2>/dev/null || echo "# no ncu output (see v4_summary.md)"; } > "$OUT/ncu_stalls.csv"
{ echo "# $HDR"; for s in graph repeat; do echo "## $s"; grep -h "\] $s" "$LOG"; tail -60 "$W/$s.out" 2>/dev/null; done; } > "$OUT/tests.log"
tar -C "$W" -czf "$OUT/v4_rest.tar.gz" . 2>/dev/null
ls -la "$OUT"
tail -40 "$OUT/v4_summary.md" | grep -v '^$' | tail -25
[ "$DRY_RUN" = "1" ] && rm -rf "$W" "$PP"
exit 0
