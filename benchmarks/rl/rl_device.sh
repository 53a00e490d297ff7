#!/usr/bin/env bash
# The RL study v3 (issue 35; docs/rl.md "Study v3") on the device, in back-to-back calls on one warm machine.
#
# What the device lacks travels as the parts of the one staging step, prepared on the CPU, after the last
# commit, by `.venv/bin/python benchmarks/device/prepare.py --profile model`: FourSight's dependencies, the
# packaged SmolLM2 GGUF (98 MB, over the 64 MiB one device call may carry) and the CPU conversion's tokenizer and
# config files with its tensors' sha256, cut into .devcarry/p1 .. pN (git-ignored; it prints N). Every call
# starts with `source benchmarks/device/stage.sh --need model` (benchmarks/device/stage.py): it receives the part
# carried, installs FourSight from the tree the call brings, and once every part is there converts SmolLM2 on the
# device and checks its tensors against the CPU conversion's (a mismatch stops the call):
#   calls 1..N-1:  bash benchmarks/rl/rl_device.sh stage                  carry [".devcarry/p1"], then p2, ...
#            receives its part; RL_SMOKE=1 (default) also runs, once per machine, one CUDA step of every study
#            precision on a tiny model (~1 min)
#   call N+: RL_SEEDS=0,1 bash benchmarks/rl/rl_device.sh run            carry [".devcarry/pN"] (later calls: none)
#            the last part, SmolLM2's conversion and check (the first run call), then benchmarks/rl/rl_study.py: a
#            chunk of RL_ARMS x RL_SEEDS runs, as many at once as the GPU's memory holds (--slots auto)
# Runs span calls on one warm machine: a run still going at RL_DEADLINE_S pauses with a checkpoint in /tmp,
# which only the same warm machine can continue (the next run call, issued at once: the machine goes back after
# ~30 s idle). With eight runs sharing an H100 a FourSight run needs ~770 s (study v3 chunk 2), more than one
# call's 600 s, so most chunks take two or three calls. Each call starts paused runs first, then seed by seed
# the slowest arms first (rl_study.launch_order); no run starts after half the deadline (--latest-start-s).
# The first run call of a machine spends ~60 s on the GGUF before the study starts: give it
# RL_DEADLINE_S <= its timeout - 110 (the first calls of chunks 2 and 3, deadlines 500 and 490 under 575 and 570 s
# timeouts, were cut by them while packing). Or pass the call's timeout as RL_CALL_S: the study's deadline is then
# RL_CALL_S minus the seconds this call has spent before the study starts (staging, GGUF, checks) minus RL_RESERVE_S
# (60: a run's pause at its next step, the summary and the packing), whatever RL_DEADLINE_S says.
# The runs import FourSight as the staging step installed it from the tree of the call: commit before preparing
# the parts and leave the tree alone until the study is done (stage.py installs it again when the tree changed).
# Exit codes: the staging step's (3: the machine went back, start again from call 1; 4: a later part is still to
# come, carry it; 2: anything else, the message says what), 5: no filter τ, 6: a deadline too short.
#
# Settings (environment): RL_ARMS (default: the 6 main arms), RL_SEEDS (default 0,1,2,3,4,5), RL_SLOTS (auto),
# RL_DEADLINE_S (520), RL_STEPS, RL_ONLY (run names), RL_OBJECTIVE (learner-tis), RL_TIMING=1 (each arm alone).
# Results: $OUT/rl_study.tgz (logs <arm>_s<seed>.jsonl, their stdout, manifest.json, summary), $OUT/study.log,
# $OUT/stage.log (the staging step's messages: parts received, FourSight installed, SmolLM2 converted and identical
# to the CPU conversion), $OUT/smoke.log. Each log's config record names the commit (FOURSIGHT_COMMIT: the one
# prepare.py recorded in the parts, FOURSIGHT_PARTS_COMMIT) and the card.
#
# CPU dry run, in any checkout (no .devcarry needed, no staging: the venv's installed package; tiny model, 2 steps;
# pause, resume and skip exercised):
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
WORK=$BASE/fsrl; STATE=$BASE/fsrl_state
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FOURSIGHT_CACHE=$BASE/fscache \
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-$BASE/fsrl_out}; mkdir -p "$OUT"

# the package, its dependencies and SmolLM2 on the device: the one staging step (the header); its messages also go
# to $OUT/stage.log. The dry run stages nothing: the venv's installed package
if [ "$DRY" != 1 ]; then
  case $MODE in
    stage) NEED=(--need model --receive-only) ;;
    run) NEED=(--need model) ;;
    *) echo "mode: stage | run | dry"; exit 1 ;;
  esac
  source benchmarks/device/stage.sh "${NEED[@]}" 2> "$OUT/stage.log"; RC=$?
  cat "$OUT/stage.log"
  [ "$RC" = 0 ] || { echo "rl_device.sh $MODE: the staging step stopped (exit $RC; benchmarks/device/stage.sh)"; exit "$RC"; }
  export FOURSIGHT_COMMIT=$FOURSIGHT_PARTS_COMMIT
else
  export FOURSIGHT_COMMIT=${FOURSIGHT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
fi
echo "rl_device.sh $MODE: code $FOURSIGHT_COMMIT, base $BASE"
BENCH=$ROOT/benchmarks
echo "code from $($PY -c "import importlib.util as u; print(u.find_spec('foursight').submodule_search_locations[0])" 2>&1 | tail -1)"

stage() {
  mkdir -p "$WORK"
  if [ "$DRY" = 1 ]; then
    echo "dry run: no parts or GGUF (the venv has what the tiny model needs)"; DEV=cpu
  else
    nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv; DEV=cuda
  fi
  # once per machine: a later stage call (the parts after p1) neither repeats a smoke that passed nor hides one that failed
  [ "$(cat "$WORK/smoke.status" 2>/dev/null)" = ok ] && { echo "smoke: ok in an earlier call on this machine"; return 0; }
  [ "${RL_SMOKE:-1}" = 0 ] && { echo "smoke skipped (RL_SMOKE=0)"; [ -f "$WORK/smoke.status" ] || echo skipped > "$WORK/smoke.status"; return 0; }
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
  if [ "$(grep -c ' ok ' "$OUT/smoke.log")" = 6 ]; then echo ok > "$WORK/smoke.status"; else echo failed > "$WORK/smoke.status"; fi
  echo "smoke: $(cat "$WORK/smoke.status")"
}

run() {
  if [ "$DRY" != 1 ]; then
    # SmolLM2 was converted and checked by the staging step (FOURSIGHT_CACHE, once per machine)
    [ "$(cat "$WORK/smoke.status" 2>/dev/null)" = failed ] && { echo "rl_device.sh run: the stage call's CUDA smoke failed" \
                                                                    "(its smoke.log): not starting the study"; exit 2; }
    M=$FOURSIGHT_CACHE/models/smollm2-135m-instruct-bf16
    [ -f "$M/config.json" ] || { echo "rl_device.sh run: no SmolLM2 in $M: the staging step converted it under another" \
                                      "FOURSIGHT_CACHE on this machine"; exit 2; }
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
