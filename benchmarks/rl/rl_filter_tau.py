"""Fit the RL study's filter threshold τ per rollout engine, on the study's own task and answer lengths.

    python benchmarks/rl/rl_filter_tau.py [--steps 2] [--quantile 0.9] [--out benchmarks/results/rl/filter_tau.json]

Why: study v2's ``max_token`` τ = 2.5 was read off 8–12-token ``add`` answers. A sequence's max |r|
grows with its length, so on the 24–48-token ``seq1`` answers the same τ drops long, complete
answers first. The study's filter arms therefore use the length-normalised statistic, a sequence's
mean |r| (``--filter mean_abs``), with τ fitted here, before the study, by one fixed rule:

    τ(engine) = the ``--quantile`` (0.9) quantile of the per-sequence mean |r| of that engine's
    rollouts against the BF16 learner, at the initial weights, on the study's batch shape.

So each filter arm drops about the worst 10 % of its own engine's sequences at step 0; the
threshold then stays fixed, and the share it drops follows the mismatch as training moves the
weights. The rollouts come from a calibration seed (1000) that no study run uses.

Per engine (``nvfp4``: NVFP4 k = 0; ``foursight``: FourSight 2 %, channels calibrated as
``foursight rl`` does for seed 0) the file records τ, the quantiles of mean |r| and max |r|, what
``mean_abs`` at τ and study v2's ``max_token`` at 2.5 would keep (fraction, mean answer length and
reward of the kept and the dropped sequences), the rank correlation of each statistic with the
answer's length, the share of sequences holding a token with |r| > ln 3, and the tail
concentration (the share of those tail tokens held by the worst 5 % of sequences). Runs on the CPU
(real SmolLM2-135M-Instruct from the packaged wheel) on a GPU in about a minute (the CPU works, slowly: over
10 minutes per engine and batch on the shared 2-core machine, so the study's file was fitted on the device).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

COMMON_TASK = {"task": "seq1", "prompts_per_step": 16, "group_size": 8, "max_new_tokens": 64, "channels": "2%", "prefill": "Answer:"}
CALIB_SEED = 1000


def _rank_corr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation (average ranks are not needed for a rough reading: ties broken by order)."""
    ra = torch.argsort(torch.argsort(a)).double()
    rb = torch.argsort(torch.argsort(b)).double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    d = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / d if d else 0.0


def _split(keep: torch.Tensor, lens: torch.Tensor, reward: torch.Tensor) -> dict:
    def part(m):
        return {"n": int(m.sum()), "mean_len": float(lens[m].mean()) if m.any() else None,
                "mean_reward": float(reward[m].mean()) if m.any() else None}

    return {"kept_fraction": float(keep.double().mean()), "kept": part(keep), "dropped": part(~keep)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="calibration batches per engine (16 x 8 sequences each)")
    ap.add_argument("--quantile", type=float, default=0.9, help="τ = this quantile of the per-sequence mean |r|")
    ap.add_argument("--engines", default="nvfp4,foursight")
    ap.add_argument("--device", default="auto", help="auto (CUDA if available) | cpu | cuda")
    ap.add_argument("--model", default=None, help="model folder (default: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/rl/filter_tau.json"))
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.channels import calibrate_channel_sets
    from foursight.calibration import builtin_texts
    from foursight.models import resolve_model
    from foursight.rl import tasks as rl_tasks
    from foursight.rl.evaluation import prompt_ids
    from foursight.rl.loop import learner_logprobs
    from foursight.rl.records import code_commit
    from foursight.trainer_bridge.backends.hf_rollout import HFRollout
    from foursight.trainer_bridge.metrics import DEFAULT_TAIL_THRESHOLD, tail_concentration

    t0 = time.time()
    c = COMMON_TASK
    os.environ["FOURSIGHT_KERNELS_AUTOTUNE"] = "0"  # the study's fixed kernel configurations
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    torch.manual_seed(0)
    md = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(md)
    learner = AutoModelForCausalLM.from_pretrained(md, dtype=torch.float32).to(dev)
    evals = rl_tasks.eval_set(c["task"], 128)
    exclude = {p.question for p in evals}
    res: dict = {"command": "python benchmarks/rl/rl_filter_tau.py " + " ".join(sys.argv[1:]), "commit": code_commit(),
                 "machine": (torch.cuda.get_device_name(dev) if dev.type == "cuda" else
                             f"{platform.machine()} CPU, {torch.get_num_threads()} threads") + f", torch {torch.__version__}",
                 "rule": f"tau = q{a.quantile:g} of the per-sequence mean |r| (r = learner - engine logprob), initial weights, "
                         f"calibration seed {CALIB_SEED}", "settings": c, "quantile": a.quantile, "engines": {}}
    for engine in [e for e in a.engines.split(",") if e]:
        channels = None
        if engine == "foursight":  # as foursight rl's build_run does for seed 0
            calib = rl_tasks.train_problems(c["task"], step=-1, n=32, seed=0 + 7, exclude=exclude)
            texts = builtin_texts() + [tok.decode(ids) for ids in prompt_ids(tok, calib, "plain", c["prefill"])]
            bf = copy.deepcopy(learner).to(torch.bfloat16).eval()
            channels = calibrate_channel_sets(bf, tok, texts, c["channels"], ignore=("lm_head",))
            del bf
        eng = HFRollout(learner, tok, engine, channels)
        rows = []
        for step in range(1, a.steps + 1):
            probs = rl_tasks.train_problems(c["task"], step, c["prompts_per_step"], seed=CALIB_SEED, exclude=exclude)
            samples = eng.generate(prompt_ids(tok, probs, "plain", c["prefill"]), c["group_size"], c["max_new_tokens"],
                                   seed=CALIB_SEED * 1_000_003 + step)
            with torch.no_grad():
                lp = learner_logprobs(learner, samples, dev).cpu()
            group = [p for p in probs for _ in range(c["group_size"])]
            for b, (s, p) in enumerate(zip(samples, group)):
                n = len(s.token_ids)
                if not n:
                    continue
                r = lp[b, :n].double() - torch.tensor(s.logprobs, dtype=torch.float64)
                text = c["prefill"] + tok.decode(s.token_ids, skip_special_tokens=True)
                rows.append((n, float(r.abs().mean()), float(r.abs().max()), int((r.abs() > DEFAULT_TAIL_THRESHOLD).sum()),
                             float(rl_tasks.is_correct(text, p))))
            print(f"{engine}: batch {step}, {len(rows)} sequences ({time.time() - t0:.0f} s)", flush=True)
        eng.close()
        lens, mean_abs, max_abs, tail, reward = (torch.tensor(col, dtype=torch.float64) for col in zip(*rows))
        tau = float(torch.quantile(mean_abs, a.quantile))
        qs = (0.5, 0.75, 0.9, 0.95, 0.99)
        res["engines"][engine] = {
            "tau": tau, "sequences": len(rows), "tokens": int(lens.sum()), "mean_len": float(lens.mean()),
            "accuracy": float(reward.mean()),
            "mean_abs_r_quantiles": {f"q{q:g}": float(torch.quantile(mean_abs, q)) for q in qs},
            "max_abs_r_quantiles": {f"q{q:g}": float(torch.quantile(max_abs, q)) for q in qs},
            "mean_abs_filter_at_tau": _split(mean_abs <= tau, lens, reward),
            "max_token_filter_at_2.5": _split(max_abs <= 2.5, lens, reward),
            "rank_corr_with_length": {"mean_abs": _rank_corr(mean_abs, lens), "max_abs": _rank_corr(max_abs, lens)},
            "seq_with_tail_token_fraction": float((tail > 0).double().mean()),
            "tail_concentration_worst_5pct": tail_concentration(tail.long(), 0.05),
        }
        print(json.dumps({engine: res["engines"][engine]}, indent=1), flush=True)
    res["seconds"] = round(time.time() - t0, 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {a.out} ({res['seconds']} s)")


if __name__ == "__main__":
    main()
