#!/usr/bin/env bash
# SpliceGEMM v4 (issue 36) on one H100 or H200 (a bare GPU machine: torch + Triton preinstalled, ncu;
# FourSight staged by benchmarks/device/stage.sh --need base), every step in a fresh process under its own time cap.
#
# The issue's must-shows in TWO device calls of at most 570 s each (H100 80GB HBM3; caps from its runs,
# benchmarks/results/h100-2026-12-06-v4/, h100-2026-12-06b-v4/ and h100-2026-12-06c-v4/):
#
#   CALL=1 bash benchmarks/kernels/device_v4.sh   # TOTAL_S 500: probe 130 + ncu 60 (+ ncu_sections 40 if the
#                                                 # stall metrics are refused) + grid 215 + breakdown 35 = 440 (480)
#   CALL=2 bash benchmarks/kernels/device_v4.sh   # TOTAL_S 490: repeat 300 + decode 170 = 470
#   STEPS=graph TOTAL_S=200 bash benchmarks/kernels/device_v4.sh   # the graph test (passed in 64 s at e816e6c,
#                                                 # h100-2026-12-06c-v4/; run it again after a kernel change)
#   CALL=fair bash benchmarks/kernels/device_v4.sh   # issue 52 item 0, before any kernel change: fairtest 60 +
#                                                 # fair 480, TOTAL_S 570 (not yet run: the caps are guesses)
#   DRY_RUN=1 OUT=/tmp/dry PY=.venv/bin/python bash benchmarks/kernels/device_v4.sh   # CPU: arguments,
#                                                 # provenance fields and the packing of $OUT, no GPU
#
# (each call also spends ~5-10 s on its setup; a call to the device tool adds its own start.) Where the caps
# come from: probe 64 s for 8192² at M 1/16/64 (2026-12-06-v4), so ~110 s for both shapes; grid 85 s for six
# of its twelve (shape, M) cells, one shape's autotuning compiles shared by the next, so ~165 s; breakdown 10 s;
# decode 74 s after the grid had compiled its kernels, but 106 s as a machine's first step, where its 80 s
# budget left out k = 0 and FP8 (06c), so its cap is 170 s (budget 140 s); repeat 81 of its 95 tests in 75 s
# alone (06b) and 92 in 180 s beside the RL study (06c), cut in the autotuned-default test, so its cap is
# 300 s; graph 64 s beside the RL study (06c: 4 passed). On one warm machine whose Triton cache the first
# call had filled (06d, the final kernels): probe 70 s cold / 10 s warm, grid 195 s / 17 s, breakdown 6 s,
# ncu 14 s, graph 50 s, columns 8 s, repeat 12 s beside six RL runs, decode 44 s / 26 s: a fresh machine
# pays the cold figures, so the caps stay.
# Any cap: CAP_<STEP>=seconds (CAP_PROBE, CAP_NCU, CAP_NCU_SECTIONS, CAP_GRAPH, CAP_REPEAT, CAP_GRID, CAP_DECODE,
# CAP_BREAKDOWN, CAP_COLUMNS); a step's own --budget-s follows its cap.
#
# Steps (STEPS, comma-separated, run in this order whatever the order given; CALL=1 / CALL=2 set STEPS and
# TOTAL_S as above, the default is every step but columns with TOTAL_S 565, which cuts the last ones), each
# under `timeout` = min(its cap, time left before TOTAL_S minus RESERVE_S); a step that would get under 20 s
# is skipped with a note:
#   probe      benchmarks/kernels/probe_v4.py: PDL on/off, the timer's three flushes and rotated copies on cuBLAS
#              and on the chosen tile, static scale, the one-launch streaming ceiling (8192², 14336x4096; M 1/16/64)
#   ncu        Nsight Compute on probe_v4.py --ncu-target: stall reasons, scheduler, occupancy, speed of light of
#              the W4A4 call (quantizer + GEMM) and cuBLAS at M = 1/16/64, 8192², the probe's tiles (run it
#              after probe, in the same call: without probe_v4.json the target autotunes under the profiler)
#   graph      pytest -v tests/test_kernels_graph_gpu.py (torch.compile + CUDA graphs = eager, bit for bit; its
#              autotuner's choices printed as they are made) and tests/test_producers_gpu.py (the fused
#              producers against the oracle, the linear on their output = the unfused one, a CUDA graph; GRAPH_TESTS)
#   repeat     FOURSIGHT_REPEAT_REPS=50 FOURSIGHT_REPEAT_QUICK=1 pytest -v tests/test_kernels_repeat_gpu.py (every
#              candidate at M 1/16/64/1024, static scale too where quant_in; 50 calls)
#   grid       benchmarks/kernels/bench_splice_gemm.py: the three 8B shapes, M 1/16/64/256, k 0/128, W4A4/W4A16,
#              cuBLAS BF16 and FP8 rowwise, rotated weights, one process
#   decode     benchmarks/kernels/bench_decode.py: 8B-shaped decoder, BF16, FourSight W4A4 k=128 and k=0, FP8
#              rowwise; batch 1/16/64 (no prefill); the fused producers (its default --producers fused)
#   decodetorch (opt-in) the same with --producers torch (eager add/RMSNorm/SiLU·mul, the quantizer in each
#              linear: the runs before 2026-12-07), BF16 / W4A4 k=128 / k=0; writes torch_producers/ (in v4_rest)
#   breakdown  benchmarks/kernels/probe_breakdown.py: quantizer / GEMM / BF16 columns, 8192², M 1/64
#              (BREAKDOWN_SHAPES, BREAKDOWN_MS override: e.g. BREAKDOWN_MS=256 for the prefill tile; GRID_SHAPES,
#              GRID_MS do the same for the grid, e.g. GRID_MS=256 after a change to the prefill list alone)
#   columns    (opt-in, not in the default STEPS) benchmarks/kernels/probe_columns.py: the BF16 columns' cost at
#              8192², M 16/64, the H100 grid's tiles forced, k = 0 vs k = 128, the columns before the FP4 loop
#              vs after it (cols_late) and gathered vs dense X[:, S]; writes columns.json (+ columns.md into
#              v4_summary.md). 7 s on the H100: `STEPS=columns TOTAL_S=60 bash benchmarks/kernels/device_v4.sh`
#   values     (opt-in) benchmarks/kernels/probe_baseline_values.py: cuBLAS BF16's time on weights ~N(0,1), ~N(0,0.02²)
#              and zeros, interleaved rounds (the probe's and the grid's cuBLAS differed by ~17 % in 06d)
#   stepprof   (opt-in) benchmarks/kernels/probe_decode_step.py: the 8B-shaped decode step's kernel time by
#              category (quantizer, producer, FourSight GEMM, cuBLAS, attention, norm, other), BF16 / W4A4 k=128 / k=0
#   producers  (opt-in) benchmarks/kernels/probe_producers.py: the fused producers alone (add + RMSNorm K = 4096,
#              SiLU·mul K = 14336; M 1/16/64; k 0/128) against the eager producer + standalone quantizer, and by
#              warps; writes producers.json (+ producers.md)
#   streamtest (opt-in) pytest -v tests/test_kernels_stream_gpu.py: the register-streaming Gluon form (issue 36
#              item 3) against the reference, 10 repeats bit-identical, the autotuner with FOURSIGHT_STREAM=1
#   ncustream  (opt-in) the ncu step's profile with FOURSIGHT_STREAM=only: the register-streaming tiles at
#              8192², M 1/16 (the autotuner's pick among them); writes ncu_stream.csv
#   fairtest   (opt-in; CALL=fair) pytest -v tests/test_fp8_producers_gpu.py: the FP8 fused producers' hardware
#              E4M3 conversion and CUDA scale arithmetic, bit for bit against their PyTorch references
#   fair       (opt-in; CALL=fair) benchmarks/kernels/bench_fair.py (issue 52 item 0): per layer, the four 8B linears
#              at M 1/16/64 with their producers: BF16, FP8 with its quantization fused into the producers, FP8 GEMM
#              alone, the eager FP8 of the earlier runs, W4A4 producer + GEMM and GEMM alone; decode at batch
#              1/16/64 (BF16, fused FP8, W4A4 k=128 and k=0, FlexAttention): the step and its linears alone; every
#              table in interleaved rounds (min/median/max), the clocks after every round; writes bench_fair.json
#              (+ bench_fair.md). Dry run: one linear, three decode modes, on the CPU interpreter (about 2 min)
#   stream     (opt-in) benchmarks/kernels/probe_stream.py: that form's tiles forced against the autotuned default
#              and cuBLAS (before and after), the three 8B shapes, M 1/16, k 0/128 (STREAM_SHAPES, STREAM_MS,
#              STREAM_KS override); writes stream.json (+ stream.md)
# On a bare machine: `.venv/bin/python benchmarks/device/prepare.py --profile base` on the CPU first, then carry
# its part (.devcarry/p1) with the call: the script stages FourSight with benchmarks/device/stage.sh --need base.
# The pytest steps print one line per test as it ends (-v), so a cut run still says what passed; tests.log
# keeps those lines (path prefix dropped), the autotuner's lines and each run's last lines.
# $OUT gets at most 7 files (the device tool returns 8; one is left for an appended script):
#   v4_summary.md  card, commit, kernels sha256, step log, every markdown table
#   probe_v4.json  ncu_stalls.csv  splice_gemm.json  bench_decode.json  tests.log (graph + repeat)
#   v4_rest.tar.gz everything else (breakdown.json/md, the markdown files, each step's full output, ncu's raw log)
#   (a call writes only the files of its steps, plus v4_summary.md and v4_rest.tar.gz)
# Each file names the commit (FOURSIGHT_COMMIT, else git) and the sha256 of the kernels folder.
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out_v4}
CALL=${CALL:-}
case "$CALL" in
  1) STEPS=${STEPS:-probe,ncu,grid,breakdown}; TOTAL_S=${TOTAL_S:-500} ;;
  2) STEPS=${STEPS:-repeat,decode}; TOTAL_S=${TOTAL_S:-490} ;;
  fair) STEPS=${STEPS:-fairtest,fair}; TOTAL_S=${TOTAL_S:-570} ;;
  "") ;;
  *) echo "device_v4: CALL is 1, 2 (the two calls of the header's plan) or fair (issue 52 item 0), got '$CALL'" >&2; exit 2 ;;
esac
TOTAL_S=${TOTAL_S:-565}
RESERVE_S=${RESERVE_S:-10}
STEPS=${STEPS:-probe,ncu,graph,repeat,grid,decode,breakdown}
# the graph step's tests: the linear as vLLM calls it, and the fused producers (tests/test_producers_gpu.py)
GRAPH_TESTS=${GRAPH_TESTS:-tests/test_kernels_graph_gpu.py tests/test_producers_gpu.py}
# each step's cap in seconds (the header says where the defaults come from); CAP_<STEP> overrides
CAP_PROBE=${CAP_PROBE:-130}
CAP_NCU=${CAP_NCU:-60}
CAP_NCU_SECTIONS=${CAP_NCU_SECTIONS:-40}
CAP_GRAPH=${CAP_GRAPH:-180}
CAP_REPEAT=${CAP_REPEAT:-300}
CAP_GRID=${CAP_GRID:-215}
CAP_DECODE=${CAP_DECODE:-170}
CAP_BREAKDOWN=${CAP_BREAKDOWN:-35}
CAP_COLUMNS=${CAP_COLUMNS:-60}
CAP_VALUES=${CAP_VALUES:-60}
CAP_STEPPROF=${CAP_STEPPROF:-170}
CAP_PRODUCERS=${CAP_PRODUCERS:-120}
CAP_STREAMTEST=${CAP_STREAMTEST:-200}
CAP_STREAM=${CAP_STREAM:-240}
CAP_FAIR=${CAP_FAIR:-480}
CAP_FAIRTEST=${CAP_FAIRTEST:-60}
# bench_fair.py's extra arguments (e.g. FAIR_ARGS="--parts layers" for a second call when the cap cut the per-layer part, which runs after the decode)
FAIR_ARGS=${FAIR_ARGS:-}
# the grid's and the breakdown's cells (the header's defaults)
GRID_SHAPES=${GRID_SHAPES:-8192x8192,14336x4096,4096x14336}
GRID_MS=${GRID_MS:-1,16,64,256}
BREAKDOWN_SHAPES=${BREAKDOWN_SHAPES:-8192x8192}
BREAKDOWN_MS=${BREAKDOWN_MS:-1,64}
# the stream step's cells (probe_stream.py's defaults)
STREAM_SHAPES=${STREAM_SHAPES:-8192x8192,14336x4096,4096x14336}
STREAM_MS=${STREAM_MS:-1,16}
STREAM_KS=${STREAM_KS:-0,128}
DRY_RUN=${DRY_RUN:-0}
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
W=$(mktemp -d /tmp/v4work.XXXX)   # full outputs; packed into $OUT at the end
LOG="$W/steps.log"

# FOURSIGHT_COMMIT, the package (on the device the one staging step, benchmarks/device/stage.sh --need base;
# the dry run: the interpreter's installed package) and KSHA: device_prelude.sh
source benchmarks/kernels/device_prelude.sh
CARD=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
CARD=${CARD:-no GPU (dry run)}
HDR="commit $FOURSIGHT_COMMIT, kernels sha256 $KSHA, card: $CARD"
say() { echo "[device_v4 +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
say "$HDR; steps $STEPS; total ${TOTAL_S}s; caps probe $CAP_PROBE ncu $CAP_NCU(+$CAP_NCU_SECTIONS) graph $CAP_GRAPH repeat $CAP_REPEAT grid $CAP_GRID decode $CAP_DECODE breakdown $CAP_BREAKDOWN columns $CAP_COLUMNS; dry run $DRY_RUN"
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
# pytest: one line per test as it ends (-v), failures' reasons at the end, the slowest tests (for the next caps)
PYTEST_V="-v -p no:cacheprovider -rfE --durations=8"
export PYTHONUNBUFFERED=1  # a step cut by its cap keeps every line printed so far

if want probe; then
  run_step probe "$CAP_PROBE" $PY benchmarks/kernels/probe_v4.py --out "$W" --shapes 8192x8192,14336x4096 --ms 1,16,64 --k 128 \
    --budget-s "$(budget "$CAP_PROBE" 35)" $DRY
fi
NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats"
NCU_METRICS="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum.per_second,smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active"
if want ncu; then
  if [ "$DRY_RUN" = "1" ]; then
    say "ncu: dry run: $(command -v ncu || echo 'ncu not on this machine'); target: $PY benchmarks/kernels/probe_v4.py --ncu-target --shapes 8192x8192 --ms 1,16,64 --configs-from $W/probe_v4.json"
    $PY benchmarks/kernels/probe_v4.py --help >/dev/null && say "ncu: target parses its arguments"
  else
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -z "$NCU" ] && say "ncu: not found on this machine; step skipped"
    [ -n "$NCU" ] && run_step ncu "$CAP_NCU" "$NCU" --profile-from-start off $NCU_SECTIONS --metrics "$NCU_METRICS" --csv --page raw --log-file "$W/ncu.csv" \
      $PY benchmarks/kernels/probe_v4.py --ncu-target --shapes 8192x8192 --ms 1,16,64 --k 128 --configs-from "$W/probe_v4.json"
    if [ -n "$NCU" ] && ! grep -q "stalled" "$W/ncu.csv" 2>/dev/null; then  # the metric list refused: sections only
      say "ncu: no stall metrics in the output; again with the sections only"
      run_step ncu_sections "$CAP_NCU_SECTIONS" "$NCU" --profile-from-start off $NCU_SECTIONS --csv --page raw --log-file "$W/ncu.csv" \
        $PY benchmarks/kernels/probe_v4.py --ncu-target --shapes 8192x8192 --ms 1,16,64 --k 128 --configs-from "$W/probe_v4.json"
    fi
  fi
fi
if want ncustream; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ "$DRY_RUN" = "1" ] || [ -z "$NCU" ]; then say "ncustream: dry run or no ncu here"
  else
    export FOURSIGHT_STREAM=only
    run_step ncustream "$CAP_NCU" "$NCU" --profile-from-start off $NCU_SECTIONS --metrics "$NCU_METRICS" --csv --page raw \
      --log-file "$W/ncu_stream.csv" $PY benchmarks/kernels/probe_v4.py --ncu-target --shapes 8192x8192 --ms 1,16 --k 128
    unset FOURSIGHT_STREAM
  fi
fi
if want graph; then
  if [ "$DRY_RUN" = "1" ]; then
    $PY -m pytest $GRAPH_TESTS $PYTEST_V -s > "$W/graph.out" 2>&1  # on the CPU: collects, skips
    grep -E "passed|skipped|failed|error" "$W/graph.out" | tail -1 | sed 's/^/[graph dry] /' | tee -a "$LOG"
  else
    run_step graph "$CAP_GRAPH" $PY -m pytest $GRAPH_TESTS $PYTEST_V -s
  fi
fi
if want repeat; then
  if [ "$DRY_RUN" = "1" ]; then
    $PY -m pytest tests/test_kernels_repeat_gpu.py $PYTEST_V > "$W/repeat.out" 2>&1
    grep -E "passed|skipped|failed|error" "$W/repeat.out" | tail -1 | sed 's/^/[repeat dry] /' | tee -a "$LOG"
  else
    export FOURSIGHT_REPEAT_REPS=50 FOURSIGHT_REPEAT_QUICK=1; run_step repeat "$CAP_REPEAT" $PY -m pytest tests/test_kernels_repeat_gpu.py $PYTEST_V
  fi
fi
if want grid; then
  run_step grid "$CAP_GRID" $PY benchmarks/kernels/bench_splice_gemm.py --out "$W" --shapes "$GRID_SHAPES" \
    --ms "$GRID_MS" --ks 0,128 --skip-config-check --budget-s "$(budget "$CAP_GRID" 30)" $DRY
fi
if want decode; then
  run_step decode "$CAP_DECODE" $PY benchmarks/kernels/bench_decode.py --out "$W" --modes bf16,foursight-w4a4,foursight-w4a4-k0,fp8 \
    --batches 1,16,64 --prefill-tokens 0 --budget-s "$(budget "$CAP_DECODE" 30)" $DRY
fi
if want decodetorch; then
  mkdir -p "$W/torch_producers"
  run_step decodetorch "$CAP_DECODE" $PY benchmarks/kernels/bench_decode.py --out "$W/torch_producers" --producers torch \
    --modes bf16,foursight-w4a4,foursight-w4a4-k0 --batches 1,16,64 --prefill-tokens 0 --budget-s "$(budget "$CAP_DECODE" 30)" $DRY
fi
if want breakdown; then
  run_step breakdown "$CAP_BREAKDOWN" $PY benchmarks/kernels/probe_breakdown.py --out "$W" --shapes "$BREAKDOWN_SHAPES" --ms "$BREAKDOWN_MS" \
    --budget-s "$(budget "$CAP_BREAKDOWN" 15)" $DRY
fi
if want columns; then
  run_step columns "$CAP_COLUMNS" $PY benchmarks/kernels/probe_columns.py --out "$W" --shapes 8192x8192 --ms 16,64 --rounds 3 \
    --budget-s "$(budget "$CAP_COLUMNS" 20)" $DRY
fi

if want streamtest; then
  if [ "$DRY_RUN" = "1" ]; then
    $PY -m pytest tests/test_kernels_stream_gpu.py $PYTEST_V > "$W/streamtest.out" 2>&1
    grep -E "passed|skipped|failed|error" "$W/streamtest.out" | tail -1 | sed 's/^/[streamtest dry] /' | tee -a "$LOG"
  else
    run_step streamtest "$CAP_STREAMTEST" $PY -m pytest tests/test_kernels_stream_gpu.py $PYTEST_V -s
  fi
fi
if want stream; then
  run_step stream "$CAP_STREAM" $PY benchmarks/kernels/probe_stream.py --out "$W" --budget-s "$(budget "$CAP_STREAM" 30)" \
    --shapes "$STREAM_SHAPES" --ms "$STREAM_MS" --ks "$STREAM_KS" $DRY
fi
if want fairtest; then
  if [ "$DRY_RUN" = "1" ]; then
    $PY -m pytest tests/test_fp8_producers_gpu.py $PYTEST_V > "$W/fairtest.out" 2>&1
    grep -E "passed|skipped|failed|error" "$W/fairtest.out" | tail -1 | sed 's/^/[fairtest dry] /' | tee -a "$LOG"
  else
    run_step fairtest "$CAP_FAIRTEST" $PY -m pytest tests/test_fp8_producers_gpu.py $PYTEST_V
  fi
fi
if want fair; then
  if [ "$DRY_RUN" = "1" ]; then
    run_step fair "$CAP_FAIR" $PY benchmarks/kernels/bench_fair.py --out "$W" --dry-run --linears down --modes bf16,fp8,fp8-fused
  else
    run_step fair "$CAP_FAIR" $PY benchmarks/kernels/bench_fair.py --out "$W" --budget-s "$(budget "$CAP_FAIR" 90)" $FAIR_ARGS
  fi
fi
if want values; then
  if [ "$DRY_RUN" = "1" ]; then $PY benchmarks/kernels/probe_baseline_values.py --help > /dev/null && say "values: parses its arguments"
  else run_step values "$CAP_VALUES" $PY benchmarks/kernels/probe_baseline_values.py --out "$W"; fi
fi
if want producers; then
  run_step producers "$CAP_PRODUCERS" $PY benchmarks/kernels/probe_producers.py --out "$W" --budget-s "$(budget "$CAP_PRODUCERS" 25)" $DRY
fi
if want stepprof; then
  if [ "$DRY_RUN" = "1" ]; then $PY benchmarks/kernels/probe_decode_step.py --help > /dev/null && say "stepprof: parses its arguments"
  else run_step stepprof "$CAP_STEPPROF" $PY benchmarks/kernels/probe_decode_step.py --out "$W" --budget-s "$(budget "$CAP_STEPPROF" 45)"; fi
fi

# pack: 7 files into $OUT (8 with the columns step)
say "done in $(( $(date +%s) - T0 ))s; packing"
{ echo "# SpliceGEMM v4 device run (issue 36)"; echo; echo "$HDR"; echo; echo '```'; cat "$LOG"; echo '```'
  for f in probe_v4 splice_gemm breakdown bench_decode torch_producers/bench_decode columns baseline_values decode_step producers stream bench_fair; do [ -f "$W/$f.md" ] && { echo; cat "$W/$f.md"; }; done
} > "$OUT/v4_summary.md"
for f in probe_v4.json splice_gemm.json bench_decode.json columns.json baseline_values.json decode_step.json producers.json stream.json bench_fair.json; do [ -f "$W/$f" ] && cp "$W/$f" "$OUT/$f"; done
want ncustream && { echo "# $HDR"; echo "# Nsight Compute, FOURSIGHT_STREAM=only: the register-streaming tiles (probe_v4.py --ncu-target), --page raw"
  cat "$W/ncu_stream.csv" 2>/dev/null || echo "# no ncu output (see v4_summary.md)"; } > "$OUT/ncu_stream.csv"
want ncu && { echo "# $HDR"; echo "# Nsight Compute: W4A4 call (quantizer + GEMM) and cuBLAS per M (probe_v4.py --ncu-target), --page raw"
  cat "$W/ncu.csv" 2>/dev/null || echo "# no ncu output (see v4_summary.md)"; } > "$OUT/ncu_stalls.csv"
{ want graph || want repeat || want streamtest || want fairtest; } && { echo "# $HDR"
  for s in graph repeat streamtest fairtest; do
    want "$s" || continue
    echo "## $s"; grep -h "\] $s" "$LOG"
    [ -f "$W/$s.out" ] || continue
    # under -s a test's own output can come between its name and its outcome, leaving the outcome alone
    # at the start of a line: count an outcome word at a line's start or after a space (-rfE's summary lines
    # start with FAILED / ERROR, so those two count the per-test lines only)
    echo "# $(grep -cE '(^| )PASSED( |$)' "$W/$s.out") passed, $(grep -cE ' FAILED( |$)' "$W/$s.out") failed, $(grep -cE ' ERROR( |$)' "$W/$s.out") errors, $(grep -cE '(^| )SKIPPED( |$)' "$W/$s.out") skipped (one line per test as it ended):"
    grep -E '(^| )(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)( |$)|^\[graph autotune\]' "$W/$s.out" | sed 's#^tests/test_kernels_[a-z]*_gpu\.py::##' | cut -c1-220
    echo "# last lines:"; tail -25 "$W/$s.out" | cut -c1-400
  done; } > "$OUT/tests.log"
tar -C "$W" -czf "$OUT/v4_rest.tar.gz" . 2>/dev/null
ls -la "$OUT"
tail -40 "$OUT/v4_summary.md" | grep -v '^$' | tail -25
[ "$DRY_RUN" = "1" ] && rm -rf "$W"
exit 0
