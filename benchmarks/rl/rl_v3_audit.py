"""Recompute, from study v3's raw logs, every figure issue 51 asks the docs to correct.

    .venv/bin/python benchmarks/rl/rl_v3_audit.py [benchmarks/results/rl/study-v3]

Writes ``audit.json`` and ``audit.md`` into the folder, each naming the commit it was computed at (``git
rev-parse HEAD``; ``+dirty`` when the tree had uncommitted changes), so that docs/rl.md and the README
quote numbers from a committed file and not from memory.

Why a separate script: ``rl_summary.py``'s v3 output is the pre-registered analysis and must stay as it
was (its printed command regenerates the committed ``summary.md`` byte for byte), and these are
post-hoc readings of the same logs:

* **the mismatch at identical weights**: at step 1 every arm's learner holds the initial weights and
  sees the same problems and sampling seeds, so step 1's mean |r| (``tim/abs_log_ratio_mean``), k3
  and tail statistics compare the engines alone. The run average (what v3's docs quoted, 2.8x)
  also depends on where each policy went: accurate policies have smaller mismatch;
* **the contrasts' uncertainty**: the t interval next to the percentile bootstrap (which under-covers
  with six points), the exact sign-flip p, the power of that test at the observed effect and the
  effect it detects with 80 % power (with 6 seeds it rejects at 0.05 only when all six agree:
  :func:`rl_summary.sign_flip_power_closed6`);
* **the step-30 count** (carve-out ahead of FourSight-only): the exact sign-flip p of the paired
  step-30 differences, the two-sided sign test, and the margins in questions (128 per eval);
* **the filter's dose**: the share each filter arm dropped at step 1 (designed: about 10 %);
* **the task's start**: greedy held-out accuracy at step 0 and BF16's sampled accuracy at step 1;
* **the ceiling**: BF16's lowest eval from step 9 on, the BF16 - NVFP4 AUC gap, and (post hoc) the
  AUC of steps 0-12 and the mean of evals 15-30.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_summary as rs  # noqa: E402

ARMS = ("bf16", "nvfp4", "nvfp4_carve", "nvfp4_filter", "fs_comp", "fs_filter")
#: study v3's four pre-registered contrasts (rl_summary.CONTRASTS) and the two v4 pre-registers
CONTRASTS = rs.CONTRASTS + (("fs_filter", "nvfp4"), ("fs_filter", "nvfp4_carve"))
QUESTIONS = 128  # held-out questions per eval: one question is 1/128 = 0.0078
STEP1 = {"abs_r": "tim/abs_log_ratio_mean", "k3": "tim/k3_mean", "tail_seq_fraction": "tim/tail_seq_fraction",
         "tail_share_worst_5pct": "tim/tail_share_worst_5pct", "filtered_fraction": "filtered_fraction", "accuracy": "accuracy"}


def commit() -> str:
    """HEAD of this checkout, ``+dirty`` with uncommitted changes to tracked files."""
    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True).stdout
    return head + ("+dirty" if dirty.strip() else "")


def step_rec(run: dict, step: int) -> dict:
    return next(s for s in run["steps"] if s["step"] == step)


def evals_from(run: dict, first: int, last: int) -> list[float]:
    return [a for s, a in run["evals"] if first <= s <= last]


def audit(folder: Path) -> dict:
    runs = rs.load_runs(folder, finished_only=True)
    missing = [f"{a}_s{s}" for a in ARMS for s in range(6) if s not in runs.get(a, {})]
    if missing:
        raise SystemExit(f"{folder}: unfinished or missing runs {missing}")
    seeds = sorted(runs["bf16"])
    root = Path(__file__).resolve().parents[2]
    shown = folder.resolve().relative_to(root) if folder.resolve().is_relative_to(root) else folder
    out: dict = {"folder": str(shown), "commit": commit(), "command": "python benchmarks/rl/rl_v3_audit.py " + " ".join(sys.argv[1:]),
                 "seeds": seeds}

    # --- the mismatch at step 1 (identical weights) and averaged over the run
    s1: dict = {}
    for a in ARMS:
        row = {}
        for name, key in STEP1.items():
            per = [step_rec(runs[a][sd], 1)[key] for sd in seeds]
            row[name] = {"mean": sum(per) / len(per), "per_seed": per}
        row["run_mean_abs_r"] = {"per_seed": [rs._step_mean(runs[a][sd]["steps"], "tim/abs_log_ratio_mean") for sd in seeds]}
        row["run_mean_abs_r"]["mean"] = sum(row["run_mean_abs_r"]["per_seed"]) / len(seeds)
        for name, key in (("run_mean_k3", "tim/k3_mean"), ("run_tail_share_worst_5pct", "tim/tail_share_worst_5pct")):
            per = [rs._step_mean(runs[a][sd]["steps"], key) for sd in seeds]
            row[name] = {"mean": sum(per) / len(per), "per_seed": per}
        s1[a] = row
    out["mismatch"] = s1
    nv, fs = s1["nvfp4"], s1["fs_comp"]
    out["mismatch_ratio"] = {
        "step1_abs_r": nv["abs_r"]["mean"] / fs["abs_r"]["mean"],
        "step1_abs_r_per_seed": [x / y for x, y in zip(nv["abs_r"]["per_seed"], fs["abs_r"]["per_seed"])],
        "step1_k3": nv["k3"]["mean"] / fs["k3"]["mean"],
        "run_abs_r": nv["run_mean_abs_r"]["mean"] / fs["run_mean_abs_r"]["mean"],
        "run_abs_r_per_seed": [x / y for x, y in zip(nv["run_mean_abs_r"]["per_seed"], fs["run_mean_abs_r"]["per_seed"])],
        "run_k3": nv["run_mean_k3"]["mean"] / fs["run_mean_k3"]["mean"],
        # the same step-1 rollouts in both FourSight arms and in both plain NVFP4 arms (the filter acts after them)
        "step1_same_in_filter_arms": all(
            step_rec(runs[x][sd], 1)["tim/abs_log_ratio_mean"] == step_rec(runs[y][sd], 1)["tim/abs_log_ratio_mean"]
            for x, y in (("fs_comp", "fs_filter"), ("nvfp4", "nvfp4_filter")) for sd in seeds),
    }

    # --- the contrasts: AUC 0-30 (v3's primary) and 0-12 (the rise), with their uncertainty
    # 80 % power with 6 seeds in standard deviations of the paired difference: Phi(d)^6 = 0.8 in closed form,
    # and by Monte Carlo as a check of rl_summary.detectable_effect
    lo, hi = 0.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rs.sign_flip_power_closed6(mid) < 0.8 else (lo, mid)
    d80 = out["detectable_80_in_sd_closed_form"] = hi
    out["detectable_80_in_sd"] = rs.detectable_effect(1.0, len(seeds), rs.ALPHA, 0.8)
    con: dict = {}
    for upto in (30, 12):
        for a, b in CONTRASTS:
            d = [rs.auc(runs[a][sd]["evals"], upto) - rs.auc(runs[b][sd]["evals"], upto) for sd in seeds]
            m, sd_ = rs.mean_spread(d)
            con[f"{a} - {b} (AUC 0-{upto})"] = {
                "per_seed": d, "mean": m, "sd": sd_, "positive_seeds": sum(x > 0 for x in d), "n": len(d),
                "bootstrap_ci": rs.bootstrap_ci(d), "t_ci": rs.t_interval(d), "sign_flip_p": rs.sign_flip_p(d),
                "power_at_observed": rs.sign_flip_power_closed6(m / sd_) if sd_ else None,
                "detectable_80": d80 * sd_}
    out["contrasts"] = con

    # --- the step-30 count: carve-out against FourSight-only
    a30 = {a: [dict(runs[a][sd]["evals"])[30] for sd in seeds] for a in ARMS}
    d30 = [c - f for c, f in zip(a30["nvfp4_carve"], a30["fs_comp"])]
    ahead = sum(x > 0 for x in d30)
    n_nz = sum(x != 0 for x in d30)
    sign_p = min(1.0, 2 * sum(math.comb(n_nz, k) for k in range(max(ahead, n_nz - ahead), n_nz + 1)) / 2**n_nz)
    out["step30_carve_vs_fs_comp"] = {
        "carve": a30["nvfp4_carve"], "fs_comp": a30["fs_comp"], "diff": d30, "diff_questions": [round(x * QUESTIONS) for x in d30],
        "carve_ahead": ahead, "mean": sum(d30) / len(d30), "sign_flip_p": rs.sign_flip_p(d30), "sign_test_p": sign_p,
        "t_ci": rs.t_interval(d30), "bootstrap_ci": rs.bootstrap_ci(d30)}

    # --- the filter's dose, the task's start, the ceiling
    out["filter_dose"] = {a: {"step1": s1[a]["filtered_fraction"],
                              "run_mean": sum(rs._step_mean(runs[a][sd]["steps"], "filtered_fraction") for sd in seeds) / len(seeds)}
                          for a in ("nvfp4_filter", "fs_filter")}
    ev0 = sorted({dict(r["evals"])[0] for a in ARMS for r in runs[a].values()})
    bf_correct = [round(step_rec(runs["bf16"][sd], 1)["accuracy"] * 128) for sd in seeds]  # 16 x 8 samples per step
    out["start"] = {"greedy_step0_values": ev0, "greedy_step0_questions": [round(x * QUESTIONS) for x in ev0],
                    "bf16_sampled_step1_per_seed": s1["bf16"]["accuracy"]["per_seed"], "bf16_sampled_step1_mean": s1["bf16"]["accuracy"]["mean"],
                    "bf16_sampled_step1_correct": sum(bf_correct), "bf16_sampled_step1_samples": 128 * len(seeds),
                    # the share of the 16 groups of 8 with a reward signal (not every sample equal) at step 1
                    "bf16_groups_with_signal_step1": 1 - sum(step_rec(runs["bf16"][sd], 1)["adv_zero_groups"] for sd in seeds) / len(seeds)}
    auc30 = {a: [rs.auc(runs[a][sd]["evals"], 30) for sd in seeds] for a in ARMS}
    out["ceiling"] = {
        "bf16_min_eval_from_step9": min(a for r in runs["bf16"].values() for s, a in r["evals"] if s >= 9),
        "auc30_mean": {a: sum(v) / len(v) for a, v in auc30.items()},
        "bf16_minus_nvfp4_auc30": sum(auc30["bf16"]) / 6 - sum(auc30["nvfp4"]) / 6,
        "late_mean_15_30": {a: sum(sum(evals_from(runs[a][sd], 15, 30)) / len(evals_from(runs[a][sd], 15, 30)) for sd in seeds) / len(seeds)
                            for a in ARMS},
        "late_collapse": {a: [sd for sd in seeds if max(evals_from(runs[a][sd], 0, 29)) >= 0.97 and dict(runs[a][sd]["evals"])[30] < 0.9]
                          for a in ARMS}}
    return out


def _f(x, fmt="{:.3f}"):
    return "n/a" if x is None else fmt.format(x)


def markdown(r: dict) -> str:
    mm, mr = r["mismatch"], r["mismatch_ratio"]
    L = [f"# Study v3 audit (issue 51): figures recomputed from the logs in `{r['folder']}`", "",
         f"Computed at commit `{r['commit']}` by `{r['command'].strip()}`. Seeds {r['seeds'][0]}-{r['seeds'][-1]}, finished runs only.", "",
         "## The mismatch: at identical weights (step 1) and averaged over the run", "",
         "At step 1 every arm's learner holds the initial weights and sees the same problems and sampling seeds; the run "
         "average also depends on where each policy went.", "",
         "| arm | mean \\|r\\| step 1 | k3 step 1 | seqs with a tail token, step 1 | tail share of the worst 5 %, step 1 | "
         "mean \\|r\\| run | k3 run | tail share of the worst 5 %, run |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for a, row in mm.items():
        L.append(f"| {a} | {row['abs_r']['mean']:.3f} | {row['k3']['mean']:.3f} | {row['tail_seq_fraction']['mean']:.1%} | "
                 f"{row['tail_share_worst_5pct']['mean']:.1%} | {row['run_mean_abs_r']['mean']:.3f} | {row['run_mean_k3']['mean']:.3f} | "
                 f"{row['run_tail_share_worst_5pct']['mean']:.1%} |")
    ps1 = ", ".join(f"{x:.2f}" for x in mr["step1_abs_r_per_seed"])
    psr = ", ".join(f"{x:.2f}" for x in mr["run_abs_r_per_seed"])
    L += ["", f"NVFP4 / FourSight (fs_comp): mean |r| **{mr['step1_abs_r']:.2f}x at step 1** (per seed {ps1}), k3 {mr['step1_k3']:.2f}x; "
          f"averaged over the run {mr['run_abs_r']:.2f}x (per seed {psr}), k3 {mr['run_k3']:.2f}x. "
          f"Step 1 is the same in the filter arms as in their unfiltered twins: {mr['step1_same_in_filter_arms']}.", "",
          "## The contrasts", "",
          f"Per-seed paired differences of the AUC (trapezoid over the evals / steps). p: exact two-sided sign-flip. Power: of that "
          f"test at 0.05 to detect the observed mean in its direction, normal differences with the observed sd (6 seeds: "
          f"Phi(|mean|/sd)^6). Detectable: the effect with 80 % power, {r['detectable_80_in_sd_closed_form']:.2f} sd of the paired "
          f"difference (closed form; {r['detectable_80_in_sd']:.2f} sd by rl_summary's Monte Carlo).", "",
          "| contrast | per seed | mean | sd | positive | 95 % bootstrap | 95 % t | p | power at observed | detectable (80 %) |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, c in r["contrasts"].items():
        per = " / ".join(f"{x:+.3f}" for x in c["per_seed"])
        L.append(f"| {k} | {per} | {c['mean']:+.3f} | {c['sd']:.3f} | {c['positive_seeds']}/{c['n']} | "
                 f"[{c['bootstrap_ci'][0]:+.3f}, {c['bootstrap_ci'][1]:+.3f}] | [{c['t_ci'][0]:+.3f}, {c['t_ci'][1]:+.3f}] | "
                 f"{c['sign_flip_p']:.3f} | {_f(c['power_at_observed'], '{:.0%}')} | {_f(c['detectable_80'])} |")
    s = r["step30_carve_vs_fs_comp"]
    L += ["", "## Step 30: the carve-out against FourSight-only", "",
          f"Step-30 held-out accuracy, carve-out {' / '.join(f'{x:.3f}' for x in s['carve'])}, FourSight-only "
          f"{' / '.join(f'{x:.3f}' for x in s['fs_comp'])}; difference in questions (of 128): "
          f"{' / '.join(f'{x:+d}' for x in s['diff_questions'])}. Carve-out ahead in {s['carve_ahead']} of 6; mean {s['mean']:+.3f}, "
          f"t interval [{s['t_ci'][0]:+.3f}, {s['t_ci'][1]:+.3f}], bootstrap [{s['bootstrap_ci'][0]:+.3f}, {s['bootstrap_ci'][1]:+.3f}]; "
          f"exact sign-flip p **{s['sign_flip_p']:.3f}**, two-sided sign test p {s['sign_test_p']:.3f}.", "",
          "## The filter's dose (designed: about 10 % at step 0)", "", "| arm | dropped at step 1 (per seed) | mean | mean over the run |",
          "|---|---|---:|---:|"]
    for a, d in r["filter_dose"].items():
        L.append(f"| {a} | {' / '.join(f'{x:.1%}' for x in d['step1']['per_seed'])} | {d['step1']['mean']:.1%} | {d['run_mean']:.1%} |")
    st, ce = r["start"], r["ceiling"]
    L += ["", "## The task's start and the ceiling", "",
          f"- Greedy held-out accuracy at step 0, every run: {', '.join(f'{x:.4f}' for x in st['greedy_step0_values'])} "
          f"({', '.join(str(x) for x in st['greedy_step0_questions'])} of 128).",
          f"- BF16's sampled accuracy at step 1 (T = 1, 16 x 8 samples): {st['bf16_sampled_step1_mean']:.1%} "
          f"({st['bf16_sampled_step1_correct']} of {st['bf16_sampled_step1_samples']}; per seed "
          f"{' / '.join(f'{x:.1%}' for x in st['bf16_sampled_step1_per_seed'])}); groups of 8 with a reward signal at step 1: "
          f"{st['bf16_groups_with_signal_step1']:.1%}.",
          f"- BF16's lowest eval from step 9 on, over all seeds: {ce['bf16_min_eval_from_step9']:.3f}. BF16 - NVFP4 AUC 0-30: "
          f"{ce['bf16_minus_nvfp4_auc30']:.3f}.",
          "- Mean AUC 0-30 / mean of evals 15-30 / late collapses (>= 0.97 earlier, < 0.9 at step 30; seeds):"]
    for a in ce["auc30_mean"]:
        L.append(f"  - {a}: {ce['auc30_mean'][a]:.3f} / {ce['late_mean_15_30'][a]:.3f} / {ce['late_collapse'][a] or 'none'}")
    return "\n".join(L) + "\n"


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "results" / "rl" / "study-v3")
    r = audit(folder)
    (folder / "audit.json").write_text(json.dumps(r, indent=2) + "\n")
    md = markdown(r)
    (folder / "audit.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
