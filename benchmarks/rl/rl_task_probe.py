"""Where does the base model start on an RL task? BF16 accuracy, format rate and completion length
of the packaged SmolLM2-135M-Instruct before any training (CPU), per task / prompt style / pre-fill.

    python benchmarks/rl/rl_task_probe.py [--variants chain3:plain:,chain4:oneshot:] [--problems 32] [--samples 4]
        [--max-new-tokens 128] [--out benchmarks/results/rl/task_probe.json]

A variant is ``task:style:prefill``. For each one: greedy answers to the first ``--problems``
questions of the held-out eval set (what ``eval_acc`` at step 0 measures) and ``--samples`` sampled
completions at temperature 1 for each of the first ``--problems`` training prompts of seed 0, step 1
(what a GRPO step sees: the share of correct samples and of groups with a non-zero advantage). The
study's task is chosen from this (docs/rl.md, "Task"); the JSON names the commit it ran on.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch


def probe(model, tok, task: str, style: str, prefill: str, n: int, g: int, max_new: int, seed: int = 0) -> dict:
    from foursight.rl import tasks as rl_tasks
    from foursight.rl.evaluation import prompt_ids
    from foursight.trainer_bridge.hf_sampling import eos_ids, hf_generate

    eos = eos_ids(model, tok)
    evals = rl_tasks.eval_set(task, n)
    train = rl_tasks.train_problems(task, 1, n, seed=seed, exclude={p.question for p in rl_tasks.eval_set(task, 256)})
    out: dict = {"task": task, "style": style, "prefill": prefill, "problems": n, "samples_per_problem": g, "max_new_tokens": max_new}
    for mode, probs, temp, reps in (("greedy", evals, 0.0, 1), ("sampled", train, 1.0, g)):
        ids = [p for p in prompt_ids(tok, probs, style, prefill) for _ in range(reps)]
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            smp = hf_generate(model, ids, max_new, temperature=temp, eos_ids=eos, seed=seed)
        texts = [prefill + tok.decode(s.token_ids, skip_special_tokens=True) for s in smp]
        ps = [p for p in probs for _ in range(reps)]
        corr = [rl_tasks.is_correct(t, p) for t, p in zip(texts, ps)]
        fmt = [rl_tasks.extract_answer(t) is not None for t in texts]
        lens = sorted(len(s.token_ids) for s in smp)
        out[mode] = {"accuracy": sum(corr) / len(corr), "correct": sum(corr), "n": len(corr), "format": sum(fmt) / len(fmt),
                     "len_mean": sum(lens) / len(lens), "len_median": lens[len(lens) // 2], "len_min": lens[0], "len_max": lens[-1],
                     "truncated": sum(s.finish_reason == "length" for s in smp) / len(smp), "seconds": round(time.perf_counter() - t0, 1),
                     "examples": texts[:3]}
        if reps > 1:
            groups = [corr[i:i + reps] for i in range(0, len(corr), reps)]
            out[mode]["groups_with_signal"] = sum(0 < sum(gr) < reps for gr in groups) / len(groups)
    return out


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.models import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="chain3:plain:,chain3:oneshot:,chain4:oneshot:")
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/rl/task_probe.json"))
    a = ap.parse_args()
    torch.manual_seed(0)
    d = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"commit": commit, "model": "SmolLM2-135M-Instruct (packaged)", "device": "cpu", "variants": []}
    for v in a.variants.split(","):
        task, style, prefill = v.split(":", 2)
        r = probe(model, tok, task, style, prefill, a.problems, a.samples, a.max_new_tokens)
        res["variants"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("greedy", "sampled")}),
              {m: {k: r[m][k] for k in ("accuracy", "format", "len_mean", "truncated", "seconds")} for m in ("greedy", "sampled")}, flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
