"""Choose the RL study's filter τ and error target from CPU measurements on the real model.

    python benchmarks/rl/rl_choose.py [--samples-steps 4] [--out benchmarks/results/rl/choose.json]

1. Channel budget: the RL run's calibration (built-in texts + 32 task prompts, one
   :func:`foursight.calibration.collect_stats` pass with 512 rows, as
   :func:`foursight.channels.calibrate_channel_sets`) with ``--channels 2%`` and with ``--error-target``
   at several levels; per level the mean k / K over layers (``channels_k_fraction``). The study's
   error-budget run uses the level whose average fraction is closest to 2%'s, so both spend about
   the same number of BF16 channels, distributed differently.
2. Filter τ: FourSight 2% rollouts of the ``add`` task at the initial weights (the study's batch:
   8 prompts x 8 samples, 8 new tokens, ``--samples-steps`` steps), the BF16 learner's teacher-forced
   logprobs, and per sequence max |r|; the share of sequences ``max_token`` would drop at each τ.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import channels_by_layer  # noqa: E402  (benchmarks/common.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples-steps", type=int, default=4)
    ap.add_argument("--targets", default="0.1,0.2,0.3,0.4,0.5")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/rl/choose.json"))
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.channels import channel_summary
    from foursight.calibration import builtin_texts
    from foursight.models import resolve_model
    from foursight.rl import prompt_ids
    from foursight.rl import tasks as rl_tasks
    from foursight.trainer_bridge.backends.hf import HFRollout
    from foursight.trainer_bridge.scoring import teacher_forced_logprobs

    t0 = time.time()
    torch.manual_seed(0)
    md = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(md)
    learner = AutoModelForCausalLM.from_pretrained(md, dtype=torch.float32)
    evals = rl_tasks.eval_set("add", 64)
    exclude = {p.question for p in evals}
    calib = rl_tasks.train_problems("add", step=-1, n=32, seed=0 + 7, exclude=exclude)
    texts = builtin_texts() + [tok.decode(ids) for ids in prompt_ids(tok, calib, "plain", "Answer:")]
    bf = copy.deepcopy(learner).to(torch.bfloat16).eval()
    budgets = {}
    # one calibration pass (what calibrate_channel_sets runs, with its 512 rows for the error target),
    # then the k of every level from the same statistics
    from foursight import schema
    from foursight.calibration import collect_stats
    from foursight.channels import choose_k_levels
    from foursight.schema import find_linears

    names = find_linears(bf, schema.FourSightConfig(ignore=["lm_head"]))
    groups = collect_stats(bf, tok, texts, names, batch_size=8, max_length=256, keep_rows=512, progress=False)
    print(f"calibrated ({time.time() - t0:.0f} s)", flush=True)

    def chans(kfn):
        return channels_by_layer(groups, kfn)

    ch2 = chans(lambda g: schema.parse_channel_budget("2%", g.in_features, layer=g.members[0]))
    budgets["channels 2%"] = channel_summary(bf, ch2)
    targets = [float(x) for x in a.targets.split(",")]
    kt = {g.key: choose_k_levels(g, [bf.get_submodule(n).weight.detach() for n in g.members], targets, 256) for g in groups.values()}
    for t in targets:
        ch = chans(lambda g, t=t: kt[g.key][t])
        budgets[f"error-target {t}"] = channel_summary(bf, ch)
        print(f"error target {t}: {budgets[f'error-target {t}']} ({time.time() - t0:.0f} s)", flush=True)
    del bf
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"budgets": budgets, "partial": "rollouts not measured yet"}, indent=2))  # kept if stopped later
    eng = HFRollout(learner, tok, "foursight", ch2)
    seq_max = []
    n_tok = 0
    abs_sum = 0.0
    for step in range(1, a.samples_steps + 1):
        probs = rl_tasks.train_problems("add", step, 8, seed=0, exclude=exclude)
        ids = prompt_ids(tok, probs, "plain", "Answer:")
        samples = eng.generate(ids, 8, 8, seed=step)
        with torch.no_grad(), torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            lp, _ = teacher_forced_logprobs(learner, [s.prompt_ids for s in samples], [s.token_ids for s in samples])
        for b, s in enumerate(samples):
            if not s.token_ids:
                continue
            r = (lp[b, : len(s.token_ids)].double() - torch.tensor(s.logprobs, dtype=torch.float64)).abs()
            seq_max.append(float(r.max()))
            n_tok += len(s.token_ids)
            abs_sum += float(r.sum())
        print(f"step {step}: {len(seq_max)} sequences", flush=True)
    sm = torch.tensor(seq_max)
    taus = [math.log(3), 1.5, 2.0, 2.5, 3.0, 4.0]
    res = {
        "command": "python benchmarks/rl/rl_choose.py " + f"--samples-steps {a.samples_steps} --targets {a.targets}",
        "budgets": budgets,
        "foursight_2pct_rollouts": {
            "sequences": len(seq_max), "tokens": n_tok, "mean_abs_r": abs_sum / max(n_tok, 1),
            "seq_max_abs_r_quantiles": {f"p{int(q * 100)}": float(torch.quantile(sm, q)) for q in (0.5, 0.7, 0.8, 0.9, 0.95)},
            "max_token_drop_fraction": {f"{t:.4g}": float((sm > t).double().mean()) for t in taus},
        },
        "seconds": time.time() - t0,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
