"""Summarise the RL study (benchmarks/rl/rl_study.py logs): curves with seed bands, the table, and the statistics.

    python benchmarks/rl/rl_summary.py DIR [--ref bf16] [--base nvfp4] [--frac 0.9] [--no-plot]

Reads ``DIR/<config>_s<seed>.jsonl`` (one ``foursight rl`` log per run; ``<config>_t<seed>.jsonl``
are isolated timing runs) and writes into DIR:

* ``summary.json`` / ``summary.md``, per configuration over its seeds (mean ± spread, spread =
  sample standard deviation over seeds, n-1):
  - ``steps_to_target``: the first evaluated step whose held-out accuracy is ≥ ``frac`` x the
    reference configuration's final accuracy (the mean over its seeds of each seed's last eval);
    seeds that never reach it are counted in ``reached`` and left out of the mean;
  - ``ratio_vs_base``: mean steps of ``base`` (plain NVFP4) / mean steps of this configuration
    (> 1: fewer steps than NVFP4); None (n/a) unless every seed of both reached the target;
  - ``final_acc``, ``tim_abs_log_ratio`` (mean |r| per step, averaged over steps), ``k3``,
    ``filtered_fraction``, ``channels_k_fraction``, and the mean time per phase (steps 4 onward);
* the statistics of study v2 (``stats`` in summary.json, the second table of summary.md), per
  configuration: AUC of the eval curve (trapezoid over the evaluated steps up to the last step
  every run of the folder reached, divided by that span: the mean held-out accuracy over the run)
  and the accuracy at that common step, each with a 95 % percentile bootstrap interval over seeds
  (:data:`BOOT` resamples, fixed RNG); per-seed paired differences (same seed, so the same
  problem stream and the same step-1 sampling seed) against ``bf16``, ``nvfp4`` and
  ``nvfp4_carve`` with the bootstrap interval of their mean; verl-style health metrics (mean over
  steps: ``rollout_corr/kl``, ``chi2_token``, ``chi2_seq``, the TIS effective sample size), the
  BF16 weight share, the rollout-follows-learner metrics (``follow/code_flip_fraction``,
  ``follow/cos``), and the reward of the kept and the dropped sequences;
* ``primary`` (study v3's pre-registered analysis, docs/rl.md): for each contrast of
  :data:`CONTRASTS` the per-seed paired difference of the AUC over steps 0-``--upto`` (30), its mean
  with the bootstrap interval, the seeds with a positive difference, and the exact two-sided paired
  sign-flip test (:func:`sign_flip_p`; with n seeds the smallest possible p is 2 / 2^n) and its
  pre-registered reading (:func:`reading`);
  ``secondary``: steps to the target (n/a where a seed never reaches it), the seeds that end below
  their own step-0 accuracy, the tail concentration of the mismatch, the kept and dropped reward and
  answer length;
* only finished runs (logs ending in ``done``) count; the others are listed as ``unfinished``;
* ``timing`` (from ``_t`` logs): the median time per phase over steps after the first
  :data:`WARMUP`, and the sync's share of the step;
* ``curves.png``: eval accuracy, reward (5-step mean), mean |r| and filtered fraction against step,
  the mean over seeds with a ± spread band; ``step_time.png``: time per step by phase.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
from pathlib import Path

ORDER = ["bf16", "fp8", "nvfp4", "nvfp4_carve", "nvfp4_filter", "fs_comp", "fs_filter", "fs_budget", "w4a16", "bf16_nobonus",
         "nvfp4_nobonus", "bf16_bonus", "nvfp4_bonus"]
LABELS = {"bf16": "BF16", "fp8": "FP8 rowwise W8A8", "nvfp4": "NVFP4 (k=0)", "nvfp4_carve": "NVFP4 + BF16 carve-out",
          "fs_comp": "FourSight (comp. only)", "fs_filter": "FourSight + filter", "fs_budget": "FourSight error budget",
          "w4a16": "FourSight W4A16", "bf16_nobonus": "BF16, format bonus 0", "nvfp4_nobonus": "NVFP4, format bonus 0",
          "nvfp4_filter": "NVFP4 + filter", "bf16_bonus": "BF16, format bonus 0.1", "nvfp4_bonus": "NVFP4, format bonus 0.1"}
#: the pre-registered primary contrasts of study v3 (docs/rl.md): (arm, minus arm)
CONTRASTS = (("fs_comp", "nvfp4"), ("fs_comp", "nvfp4_carve"), ("fs_filter", "fs_comp"), ("nvfp4_filter", "nvfp4"))
#: the pre-registered reading of a contrast (docs/rl.md): supported / contradicted when its mean is > 0 / < 0
#: and the sign-flip p <= ALPHA, not resolved otherwise; the study plans PLANNED_SEEDS seeds
ALPHA = 0.05
PLANNED_SEEDS = 6
#: the phases of a step (v2 names); older logs' names map onto them (:data:`PHASE_ALIASES`)
PHASES = ["time/sync", "time/generate", "time/score", "time/filter", "time/learn", "time/step"]
PHASE_ALIASES = {"time/generate": "time/rollout", "time/learn": "time/update"}
WARMUP = 3
#: bootstrap resamples and the interval
BOOT, CI = 10_000, 0.95
#: the configurations every other one is paired with, per seed
PAIR_WITH = ("bf16", "nvfp4", "nvfp4_carve")
HEALTH = {"kl": "rollout_corr/kl", "chi2_token": "rollout_corr/chi2_token", "chi2_seq": "rollout_corr/chi2_seq",
          "ess": "rollout_corr/rollout_is_eff_sample_size", "code_flip_fraction": "follow/code_flip_fraction",
          "follow_cos": "follow/cos", "reward_kept": "reward_kept", "reward_dropped": "reward_dropped",
          "response_len": "response_len", "adv_zero_groups": "adv_zero_groups",
          "response_len_kept": "response_len_kept", "response_len_dropped": "response_len_dropped",
          "tail_seq_fraction": "tim/tail_seq_fraction", "tail_share_worst_5pct": "tim/tail_share_worst_5pct",
          "peak_reserved_gib": "mem/peak_reserved_gib"}
_NAME = re.compile(r"^(?P<cfg>.+)_s(?P<seed>\d+)$")
_TIMING = re.compile(r"^(?P<cfg>.+)_t(?P<seed>\d+)$")


def read_log(path: Path) -> dict:
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line of a killed run
    for r in recs:  # v1 phase names -> v2
        for new, old in PHASE_ALIASES.items():
            if old in r and new not in r:
                r[new] = r[old]
    evals: dict[int, float] = {}
    eval_recs: dict[int, dict] = {}
    for r in recs:
        if r.get("type") == "eval":
            evals[int(r["step"])] = float(r["eval_acc"])  # a resumed run re-evaluates: the last one counts
            eval_recs[int(r["step"])] = r
    return {"config": next((r for r in recs if r.get("type") == "config"), {}),
            "steps": [r for r in recs if r.get("type") == "step"],
            "evals": sorted(evals.items()), "eval_recs": dict(sorted(eval_recs.items())),
            "done": bool(recs) and recs[-1].get("type") == "done"}


def load_runs(folder: Path, pattern: re.Pattern = _NAME, finished_only: bool = False,
              unfinished: list[str] | None = None) -> dict[str, dict[int, dict]]:
    """config -> seed -> run, from ``<config>_s<seed>.jsonl`` (``_TIMING``: ``<config>_t<seed>.jsonl``).
    ``finished_only``: only logs that end in ``done``; the names of the others go to ``unfinished``."""
    out: dict[str, dict[int, dict]] = {}
    for p in sorted(folder.glob("*.jsonl")):
        m = pattern.match(p.stem)
        if not m:
            continue
        run = read_log(p)
        if finished_only and not run["done"]:
            if unfinished is not None:
                unfinished.append(p.stem)
            continue
        out.setdefault(m["cfg"], {})[int(m["seed"])] = run
    return dict(sorted(out.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else 99))


def mean_spread(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n-1; 0 for one value); (None, None) for none."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def steps_to(evals: list[tuple[int, float]], target: float) -> int | None:
    for s, acc in evals:
        if acc >= target - 1e-12:
            return s
    return None


def _step_mean(steps: list[dict], key: str, skip: int = 0) -> float | None:
    vals = [s[key] for s in steps[skip:] if key in s and s[key] is not None]
    return sum(vals) / len(vals) if vals else None


def summarise(runs: dict[str, dict[int, dict]], ref: str = "bf16", base: str = "nvfp4", frac: float = 0.9) -> dict:
    if ref not in runs:
        raise SystemExit(f"reference configuration {ref!r} has no logs (have {sorted(runs)})")
    ref_final, _ = mean_spread([r["evals"][-1][1] for r in runs[ref].values() if r["evals"]])
    target = frac * ref_final
    res: dict = {"reference": ref, "base": base, "frac": frac, "ref_final_acc": ref_final, "target_acc": target,
                 "spread": "sample standard deviation over seeds (n-1)", "configs": {}}
    for cfg, seeds in runs.items():
        reach = {s: steps_to(r["evals"], target) for s, r in seeds.items()}
        st_m, st_s = mean_spread([v for v in reach.values() if v is not None])
        fin_m, fin_s = mean_spread([r["evals"][-1][1] for r in seeds.values() if r["evals"]])
        row = {
            "seeds": sorted(seeds), "done": sum(r["done"] for r in seeds.values()),
            "steps_run": [len(r["steps"]) for r in seeds.values()],
            "last_step": max((r["evals"][-1][0] for r in seeds.values() if r["evals"]), default=0),
            "steps_to_target_per_seed": {str(s): v for s, v in reach.items()},
            "reached": sum(v is not None for v in reach.values()),
            "steps_to_target_mean": st_m, "steps_to_target_spread": st_s,
            "final_acc_mean": fin_m, "final_acc_spread": fin_s,
            "channels_k_fraction": next(iter(seeds.values()))["config"].get("channels_k_fraction"),
        }
        for key, name in (("tim/abs_log_ratio_mean", "tim_abs_log_ratio"), ("tim/k3_mean", "k3"), ("filtered_fraction", "filtered_fraction"),
                          ("reward", "reward")):
            row[f"{name}_mean"], row[f"{name}_spread"] = mean_spread([_step_mean(r["steps"], key) for r in seeds.values()])
        for ph in PHASES:
            row[ph.replace("time/", "t_")], _ = mean_spread([_step_mean(r["steps"], ph, WARMUP if len(r["steps"]) > 2 * WARMUP else 0)
                                                            for r in seeds.values()])
        res["configs"][cfg] = row
    b = res["configs"].get(base)
    for cfg, row in res["configs"].items():
        # defined only where every seed of both reached the target after step 0; otherwise n/a (a seed
        # that never reached it has no step count, and a bound read off the last step is not a ratio)
        row["ratio_vs_base"] = None
        if (b is None or not row["steps_to_target_mean"] or row["reached"] < len(row["seeds"])
                or not b["steps_to_target_mean"] or b["reached"] < len(b["seeds"])):
            continue
        row["ratio_vs_base"] = b["steps_to_target_mean"] / row["steps_to_target_mean"]
    return res


def sign_flip_p(diffs: list[float]) -> float | None:
    """Exact two-sided paired sign-flip (permutation) test of "the mean difference is 0": the share of
    the 2^n assignments of signs to the n per-seed differences whose |mean| is at least the observed
    |mean|. With n seeds the smallest possible p is 2 / 2^n (0.25 for 3 seeds, 0.031 for 6). None
    for no seeds."""
    n = len(diffs)
    if n == 0:
        return None
    obs = abs(sum(diffs))
    hits = sum(abs(sum(s * d for s, d in zip(signs, diffs))) >= obs - 1e-12 for signs in itertools.product((1, -1), repeat=n))
    return hits / 2**n


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (Lentz's method)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)), -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def _betai(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1 - math.exp(lbt) * _betacf(b, a, 1 - x) / b


def t_cdf(t: float, df: int) -> float:
    """Student's t distribution function with ``df`` degrees of freedom."""
    tail = 0.5 * _betai(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t > 0 else tail


def t_quantile(q: float, df: int) -> float:
    """Student's t quantile (bisection on :func:`t_cdf`; no SciPy needed)."""
    lo, hi = -1e4, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


def t_interval(xs: list[float], ci: float = CI) -> tuple[float | None, float | None]:
    """The ``ci`` t interval of the mean of ``xs``: mean ± t(n-1) · sd / sqrt(n). With few seeds it is wider than
    the percentile bootstrap, which under-covers there (issue 51: six points); (None, None) for fewer than 2."""
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None, None
    m, sd = mean_spread(xs)
    half = t_quantile(1 - (1 - ci) / 2, len(xs) - 1) * sd / math.sqrt(len(xs))
    return m - half, m + half


def holm(pvals: dict[str, float | None]) -> dict[str, float | None]:
    """Holm's step-down adjusted p values over the family ``pvals`` (None: not tested, left out of the family):
    the i-th smallest p times (m - i), made monotone, capped at 1. A contrast is rejected at family level
    alpha when its adjusted p <= alpha."""
    tested = sorted(((p, k) for k, p in pvals.items() if p is not None), key=lambda x: x[0])
    m, out, run = len(tested), {k: None for k in pvals}, 0.0
    for i, (p, k) in enumerate(tested):
        run = max(run, min(1.0, (m - i) * p))
        out[k] = run
    return out


def _sign_patterns(n: int):
    """The 2^(n-1) sign assignments with the first sign +: |sum| is the same for a pattern and its negation."""
    import numpy as np

    rows = np.array(list(itertools.product((1.0, -1.0), repeat=n - 1)), dtype=np.float64).reshape(-1, n - 1)
    return np.hstack([np.ones((rows.shape[0], 1)), rows])


def sign_flip_p_batch(diffs):
    """:func:`sign_flip_p` of every row of ``diffs`` [reps, n] at once (the same rule: the share of sign
    assignments whose |sum| is at least the observed |sum|)."""
    import numpy as np

    d = np.asarray(diffs, dtype=np.float64)
    s = _sign_patterns(d.shape[1])
    obs = np.abs(d.sum(1))
    out = np.empty(d.shape[0])
    for i in range(0, d.shape[0], 256):
        sums = np.abs(s @ d[i : i + 256].T)  # [patterns, chunk]
        out[i : i + 256] = (sums >= obs[i : i + 256] - 1e-12).mean(0)
    return out


def sign_flip_power(effect: float, sd: float, n: int, alpha: float, reps: int = 4000, seed: int = 0) -> float:
    """Monte Carlo power of the exact two-sided sign-flip test at level ``alpha`` to detect ``effect`` in its own
    direction: the share of ``reps`` draws of ``n`` normal paired differences (mean ``effect``, sd ``sd``)
    with p <= alpha and a mean of the effect's sign. Fixed RNG, so it is a function of its arguments."""
    import numpy as np

    z = np.random.default_rng(seed).standard_normal((reps, n))
    return _power_of(z, effect, sd, alpha)


def _power_of(z, effect: float, sd: float, alpha: float) -> float:
    d = effect + sd * z
    p = sign_flip_p_batch(d)
    sign = 1.0 if effect >= 0 else -1.0
    return float(((p <= alpha + 1e-12) & (sign * d.mean(1) > 0)).mean())


def sign_flip_power_closed6(d: float) -> float:
    """The power of :func:`sign_flip_power` with 6 seeds at alpha 0.05, in closed form: the test rejects only when
    all six differences share a sign (p = 2/64; the next value, 4/64, is above 0.05), so the power to detect an
    effect of ``d`` standard deviations in its own direction is Phi(|d|)^6."""
    return (0.5 * (1 + math.erf(abs(d) / math.sqrt(2)))) ** 6


def detectable_effect(sd: float, n: int, alpha: float, power: float = 0.8, reps: int = 4000, seed: int = 0) -> float:
    """The smallest effect the exact sign-flip test detects with ``power`` (:func:`sign_flip_power`, the same
    normal draws for every effect tried, so the power is monotone in it): bisection on [0, 10 sd]."""
    import numpy as np

    z = np.random.default_rng(seed).standard_normal((reps, n))
    lo, hi = 0.0, 10.0 * sd
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _power_of(z, mid, sd, alpha) < power else (lo, mid)
        if hi - lo < 1e-4 * sd:
            break
    return hi


def reading(mean: float | None, p: float | None, n: int, alpha: float = ALPHA, planned: int = PLANNED_SEEDS) -> str:
    """The pre-registered reading of one contrast: "supported" (mean > 0 and p <= alpha), "contradicted"
    (mean < 0 and p <= alpha), else "not resolved"; "(n of planned seeds)" is appended while seeds are
    missing, and "n/a" where no seed pairs."""
    if not n or mean is None or p is None:
        return "n/a"
    r = "supported" if p <= alpha and mean > 0 else "contradicted" if p <= alpha and mean < 0 else "not resolved"
    return r if n >= planned else f"{r} ({n} of {planned} seeds)"


def primary(runs: dict[str, dict[int, dict]], upto: int = 30, contrasts=CONTRASTS) -> dict:
    """Study v3's primary analysis: per contrast (arm, minus arm), the per-seed paired difference of
    the AUC over steps 0-``upto`` (seeds where both runs finished), mean, bootstrap interval,
    positive seeds and :func:`sign_flip_p`."""
    out: dict = {"upto": upto, "test": "exact two-sided paired sign-flip over seeds", "contrasts": {}}
    for a, b in contrasts:
        key = f"{a} - {b}"
        if a not in runs or b not in runs:
            out["contrasts"][key] = {"n": 0, "mean": None, "ci": (None, None), "p": None, "positive_seeds": 0, "per_seed": {},
                                     "reading": "n/a"}
            continue
        d = {}
        for sd in sorted(set(runs[a]) & set(runs[b])):
            xa, xb = auc(runs[a][sd]["evals"], upto), auc(runs[b][sd]["evals"], upto)
            if xa is not None and xb is not None:
                d[sd] = xa - xb
        vals = list(d.values())
        m, _ = mean_spread(vals)
        p = sign_flip_p(vals)
        out["contrasts"][key] = {"n": len(vals), "mean": m, "ci": bootstrap_ci(vals), "p": p,
                                 "positive_seeds": sum(v > 0 for v in vals), "per_seed": {str(k): v for k, v in d.items()},
                                 "reading": reading(m, p, len(vals))}
    return out


def secondary(runs: dict[str, dict[int, dict]], s: dict) -> dict:
    """Study v3's secondary statistics per arm: steps to the target per seed (None = not reached), the
    seeds whose last eval is below their own step-0 eval, and the means over steps of the tail
    concentration and of the kept / dropped reward and answer length."""
    out = {}
    for cfg, seeds in runs.items():
        below = [sd for sd, r in seeds.items() if len(r["evals"]) > 1 and r["evals"][-1][1] < r["evals"][0][1] - 1e-12]
        row = {"steps_to_target_per_seed": s["configs"][cfg]["steps_to_target_per_seed"], "seeds_below_step0": sorted(below)}
        for name in ("tail_seq_fraction", "tail_share_worst_5pct", "reward_kept", "reward_dropped", "response_len_kept",
                     "response_len_dropped"):
            row[name], _ = mean_spread([_step_mean(r["steps"], HEALTH[name]) for r in seeds.values()])
        out[cfg] = row
    return out


def primary_markdown(p: dict, sec: dict, target: float) -> str:
    def f(x, fmt="{:.3f}"):
        return "n/a" if x is None else fmt.format(x)

    lines = [f"Primary (pre-registered, docs/rl.md): paired per-seed difference of the AUC of the held-out accuracy over steps "
             f"0-{p['upto']} (area / steps); mean [95 % bootstrap interval], seeds with a positive difference, exact two-sided "
             f"paired sign-flip p, and the pre-registered reading (supported / contradicted: mean > 0 / < 0 and p <= {ALPHA}; "
             f"not resolved otherwise; {PLANNED_SEEDS} seeds planned).", "",
             "| contrast | seeds | mean ΔAUC | positive | p | reading |", "|---|---:|---:|---:|---:|---|"]
    for key, c in p["contrasts"].items():
        ci = c["ci"] if c["ci"] else (None, None)
        iv = f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci[0] is not None else ""
        lines.append(f"| {key} | {c['n']} | {f(c['mean'], '{:+.3f}')}{iv} | {c['positive_seeds']}/{c['n']} | {f(c['p'], '{:.3f}')} "
                     f"| {c['reading']} |")
    lines += ["", f"Secondary: steps to the target accuracy {target:.3f} per seed (n/a: not reached), seeds ending below their "
              "step-0 accuracy, the share of sequences holding a token with |r| > ln 3 and the share of those tail tokens held by "
              "the worst 5 % of sequences (means over steps), and the reward and answer length of the kept and dropped sequences.", "",
              "| arm | steps to target | below step 0 | seqs with a tail token | tail share of worst 5 % | reward kept / dropped | "
              "length kept / dropped |", "|---|---|---:|---:|---:|---:|---:|"]
    for cfg, r in sec.items():
        st = ", ".join("n/a" if v is None else str(v) for _, v in sorted(r["steps_to_target_per_seed"].items(), key=lambda kv: int(kv[0])))
        lines.append(f"| {LABELS.get(cfg, cfg)} | {st} | {len(r['seeds_below_step0'])} | {f(r['tail_seq_fraction'])} | "
                     f"{f(r['tail_share_worst_5pct'])} | {f(r['reward_kept'])} / {f(r['reward_dropped'])} | "
                     f"{f(r['response_len_kept'], '{:.1f}')} / {f(r['response_len_dropped'], '{:.1f}')} |")
    return "\n".join(lines) + "\n"


#: study v4's pre-registered primary contrasts (docs/rl.md, "Study v4"): (name, arm, minus arm, AUC over steps 0..upto)
V4_PRIMARY = (("P1", "fs_filter", "nvfp4", 30), ("P2", "fs_filter", "nvfp4_carve", 12))
#: v4: the planned seeds per arm, the family-wise level (Holm over P1 and P2) and the interval of each effect
#: (97.5 % t: Bonferroni over the two, so the pair covers jointly at >= 95 %)
V4_SEEDS, V4_ALPHA, V4_CI = 14, 0.05, 0.975
#: v4's descriptive secondaries: the late window of evals, and a drop = an eval this far below the run's best earlier eval
V4_LATE, V4_DROP = (15, 30), 0.10


def _series(run: dict, key: str) -> list[tuple[int, float]]:
    """(step, value) of an eval field (``eval_acc``, ``eval_sampled_acc``, ``engine_eval_acc``) where logged."""
    return [(s, float(r[key])) for s, r in run["eval_recs"].items() if r.get(key) is not None]


def primary_v4(runs: dict[str, dict[int, dict]]) -> dict:
    """Study v4's primary analysis: per contrast, the per-seed paired AUC differences (seeds where both runs finished),
    their mean, sd, 97.5 % t interval, seeds positive, the exact sign-flip p, Holm's adjusted p over P1 and P2, and the
    pre-registered reading: supported / contradicted when the adjusted p <= 0.05 with a mean > 0 / < 0, else not
    resolved, with the interval's upper end as the bound on the effect the data leave room for."""
    out: dict = {"test": "exact two-sided paired sign-flip over seeds, Holm over P1 and P2", "alpha": V4_ALPHA, "ci": V4_CI,
                 "planned_seeds": V4_SEEDS, "contrasts": {}}
    for name, a, b, upto in V4_PRIMARY:
        d = {}
        for sd in sorted(set(runs.get(a, {})) & set(runs.get(b, {}))):
            xa, xb = auc(runs[a][sd]["evals"], upto), auc(runs[b][sd]["evals"], upto)
            if xa is not None and xb is not None:
                d[sd] = xa - xb
        vals = list(d.values())
        m, sd_ = mean_spread(vals)
        out["contrasts"][name] = {"arm": a, "minus": b, "upto": upto, "n": len(vals), "per_seed": {str(k): v for k, v in d.items()},
                                  "mean": m, "sd": sd_, "ci": t_interval(vals, V4_CI), "positive_seeds": sum(v > 0 for v in vals),
                                  "p": sign_flip_p(vals)}
    adj = holm({k: c["p"] for k, c in out["contrasts"].items()})
    for k, c in out["contrasts"].items():
        c["p_holm"] = adj[k]
        if not c["n"] or c["mean"] is None or c["p_holm"] is None:
            c["reading"] = "n/a"
            continue
        r = ("supported" if c["mean"] > 0 else "contradicted") if c["p_holm"] <= V4_ALPHA else "not resolved"
        if r == "not resolved" and c["ci"][1] is not None:
            r += f" (the effect is at most {c['ci'][1]:+.3f} AUC)"
        c["reading"] = r if c["n"] >= V4_SEEDS else f"{r} ({c['n']} of {V4_SEEDS} seeds)"
    return out


def secondary_v4(runs: dict[str, dict[int, dict]]) -> dict:
    """Study v4's descriptive secondaries per arm (means over seeds): the late mean (evals 15-30), the runs with a drop
    (an eval >= 0.10 below the run's best earlier eval) and with a late collapse (>= 0.97 earlier, < 0.9 at step 30),
    the mismatch at step 1 (identical weights in every arm: the study's TIM figure), the filter's dose at step 1 and
    over the run with its τ, the engine's own greedy accuracy and the learner's sampled accuracy (AUC 0-30 and at
    step 30), and the peak GPU memory of any run (its steps' and its evals' peaks)."""
    out = {}
    for cfg, seeds in runs.items():
        late, drops, collapses = [], [], []
        for sd, r in seeds.items():
            ev = r["evals"]
            w = [x for s, x in ev if V4_LATE[0] <= s <= V4_LATE[1]]
            late.append(sum(w) / len(w) if w else None)
            if any(x < max(y for _, y in ev[:i]) - V4_DROP + 1e-12 for i, (_, x) in enumerate(ev) if i):
                drops.append(sd)
            a30 = dict(ev).get(30)
            if a30 is not None and a30 < 0.9 and any(x >= 0.97 for s, x in ev if s < 30):
                collapses.append(sd)
        first = {sd: next((x for x in r["steps"] if x.get("step") == 1), {}) for sd, r in seeds.items()}
        row: dict = {"seeds": sorted(seeds), "late_mean": mean_spread(late)[0], "drop_seeds": sorted(drops), "late_collapse_seeds": sorted(collapses)}
        for name, key in (("step1_abs_r", "tim/abs_log_ratio_mean"), ("step1_k3", "tim/k3_mean"), ("step1_tail_seq_fraction", "tim/tail_seq_fraction"),
                          ("step1_tail_share_worst_5pct", "tim/tail_share_worst_5pct"), ("step1_filtered", "filtered_fraction"),
                          ("step1_tau", "filter/tau")):
            row[name] = mean_spread([f.get(key) for f in first.values()])[0]
        row["filtered_run_mean"] = mean_spread([_step_mean(r["steps"], "filtered_fraction") for r in seeds.values()])[0]
        for name, key in (("engine", "engine_eval_acc"), ("sampled", "eval_sampled_acc")):
            ser = [_series(r, key) for r in seeds.values()]
            row[f"{name}_auc"] = mean_spread([auc(x, 30) for x in ser])[0]
            row[f"{name}_at_30"] = mean_spread([dict(x).get(30) for x in ser])[0]
        peaks = [x.get("mem/peak_reserved_gib") for r in seeds.values() for x in r["steps"] + list(r["eval_recs"].values())
                 if x.get("mem/peak_reserved_gib") is not None]
        row["peak_reserved_gib_max"] = max(peaks) if peaks else None
        out[cfg] = row
    return out


def v4_markdown(p: dict, sec: dict) -> str:
    def f(x, fmt="{:.3f}"):
        return "n/a" if x is None else fmt.format(x)

    lines = [f"Primary (pre-registered, docs/rl.md \"Study v4\"): per-seed paired difference of the AUC of the held-out greedy accuracy "
             f"(area / steps); mean [{p['ci']:.1%} t interval], seeds positive, exact two-sided sign-flip p and Holm's adjusted p over P1 "
             f"and P2; supported / contradicted: adjusted p <= {p['alpha']} with a mean > 0 / < 0; not resolved otherwise, with the "
             f"interval's upper end as the bound on the effect; {p['planned_seeds']} seeds planned.", "",
             "| contrast | seeds | mean ΔAUC [t interval] | positive | p | Holm p | reading |", "|---|---:|---:|---:|---:|---:|---|"]
    for k, c in p["contrasts"].items():
        ci = "" if c["ci"][0] is None else f" [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]"
        lines.append(f"| {k}: {c['arm']} - {c['minus']}, AUC 0-{c['upto']} | {c['n']} | {f(c['mean'], '{:+.3f}')}{ci} | "
                     f"{c['positive_seeds']}/{c['n']} | {f(c['p'])} | {f(c['p_holm'])} | {c['reading']} |")
    lines += ["", f"Secondary (descriptive): mean of evals {V4_LATE[0]}-{V4_LATE[1]}; seeds with a drop (an eval >= {V4_DROP} below the "
              "run's best earlier eval) and with a late collapse (>= 0.97 earlier, < 0.9 at step 30); at step 1 (identical weights: the "
              "TIM figure) mean |r|, k3, sequences with a tail token, the tail share of the worst 5 %, the share the filter dropped and "
              "its τ; the share dropped over the run; the engine's own greedy accuracy and the learner's sampled accuracy (AUC 0-30 / at "
              "step 30); the largest peak GPU memory of any run (GiB).", "",
              "| arm | seeds | late mean | drops | late collapses | \|r\| step 1 | k3 step 1 | tail seqs step 1 | worst-5 % share step 1 | "
              "dropped step 1 (τ) | dropped, run | engine acc AUC / 30 | sampled acc AUC / 30 | peak GiB |",
              "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for cfg, r in sec.items():
        tau = "" if r["step1_tau"] is None else f" ({r['step1_tau']:.3f})"
        lines.append(f"| {LABELS.get(cfg, cfg)} | {len(r['seeds'])} | {f(r['late_mean'])} | {r['drop_seeds'] or 'none'} | "
                     f"{r['late_collapse_seeds'] or 'none'} | {f(r['step1_abs_r'])} | {f(r['step1_k3'])} | {f(r['step1_tail_seq_fraction'], '{:.1%}')} | "
                     f"{f(r['step1_tail_share_worst_5pct'], '{:.1%}')} | {f(r['step1_filtered'], '{:.1%}')}{tau} | "
                     f"{f(r['filtered_run_mean'], '{:.1%}')} | {f(r['engine_auc'])} / {f(r['engine_at_30'])} | "
                     f"{f(r['sampled_auc'])} / {f(r['sampled_at_30'])} | {f(r['peak_reserved_gib_max'], '{:.2f}')} |")
    return "\n".join(lines) + "\n"


def study_of(folder: Path, given: str | None) -> str:
    """The study a folder holds: ``given`` (``--study``), else its ``manifest.json``'s ``study``, else v3 (whose
    manifests predate the field)."""
    if given:
        return given
    m = folder / "manifest.json"
    try:
        return json.loads(m.read_text()).get("study", "v3") if m.exists() else "v3"
    except ValueError:
        return "v3"


def bootstrap_ci(xs: list[float], n_boot: int = BOOT, ci: float = CI, seed: int = 0) -> tuple[float | None, float | None]:
    """Percentile bootstrap interval of the mean of ``xs`` (resampling the values with replacement);
    (x, x) for one value, (None, None) for none."""
    import numpy as np

    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    if len(xs) == 1:
        return xs[0], xs[0]
    rng = np.random.default_rng(seed)
    a = np.asarray(xs, dtype=np.float64)
    means = a[rng.integers(0, len(a), size=(n_boot, len(a)))].mean(1)
    lo, hi = np.quantile(means, [(1 - ci) / 2, 1 - (1 - ci) / 2])
    return float(lo), float(hi)


def auc(evals: list[tuple[int, float]], upto: int) -> float | None:
    """Trapezoid area under the eval curve over [0, ``upto``], divided by ``upto`` (the mean accuracy
    over the run); None when the evals do not reach ``upto``."""
    pts = [(s, a) for s, a in evals if s <= upto]
    if not pts or pts[-1][0] != upto or upto <= 0:
        return None
    area = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in zip(pts, pts[1:]))
    return area / upto


def acc_at(evals: list[tuple[int, float]], step: int) -> float | None:
    return dict(evals).get(step)


def common_step(runs: dict[str, dict[int, dict]]) -> int:
    """The last evaluated step that every run of the folder reached (the step the statistics compare at)."""
    lasts = [r["evals"][-1][0] for seeds in runs.values() for r in seeds.values() if r["evals"]]
    return min(lasts) if lasts else 0


def statistics(runs: dict[str, dict[int, dict]], upto: int | None = None) -> dict:
    """AUC and accuracy at the common step with bootstrap intervals, per-seed paired differences
    against :data:`PAIR_WITH`, and the health metrics (see the module docstring)."""
    upto = common_step(runs) if upto is None else upto
    out: dict = {"step": upto, "bootstrap": {"resamples": BOOT, "interval": CI, "method": "percentile, over seeds"}, "configs": {}}
    per: dict[str, dict[int, dict[str, float | None]]] = {}
    for cfg, seeds in runs.items():
        per[cfg] = {sd: {"auc": auc(r["evals"], upto), "acc": acc_at(r["evals"], upto)} for sd, r in seeds.items()}
        row: dict = {"seeds": sorted(seeds)}
        for key in ("auc", "acc"):
            vals = [v[key] for v in per[cfg].values()]
            m, sp = mean_spread(vals)
            row[key] = {"mean": m, "spread": sp, "ci": bootstrap_ci(vals), "per_seed": {str(k): v[key] for k, v in per[cfg].items()}}
        head = next(iter(seeds.values()))["config"]
        for k in ("bf16_weight_share", "bf16_layer_share", "bf16_channel_share"):
            row[k] = head.get(k)
        for name, key in HEALTH.items():
            row[name], _ = mean_spread([_step_mean(r["steps"], key) for r in seeds.values()])
        out["configs"][cfg] = row
    for cfg in runs:
        pairs = {}
        for ref in PAIR_WITH:
            if ref == cfg or ref not in per:
                continue
            for key in ("auc", "acc"):
                d = {sd: per[cfg][sd][key] - per[ref][sd][key] for sd in per[cfg]
                     if sd in per[ref] and per[cfg][sd][key] is not None and per[ref][sd][key] is not None}
                m, _ = mean_spread(list(d.values()))
                pairs[f"{key}_minus_{ref}"] = {"per_seed": {str(k): v for k, v in sorted(d.items())}, "mean": m,
                                               "ci": bootstrap_ci(list(d.values())),
                                               "positive_seeds": sum(v > 0 for v in d.values()), "n": len(d)}
        out["configs"][cfg]["paired"] = pairs
    return out


def timing(runs: dict[str, dict[int, dict]]) -> dict:
    """Isolated timing runs: the median seconds per phase over steps after :data:`WARMUP` (all
    seeds' steps pooled) and the sync's share of the step."""
    out = {}
    for cfg, seeds in runs.items():
        steps = [x for r in seeds.values() for x in (r["steps"][WARMUP:] if len(r["steps"]) > WARMUP else r["steps"])]
        row: dict = {"steps": len(steps), "device": next(iter(seeds.values()))["config"].get("device_name")}
        for ph in PHASES + ["time/follow"]:
            vals = sorted(x[ph] for x in steps if x.get(ph) is not None)
            row[ph.replace("time/", "t_")] = vals[len(vals) // 2] if vals else None
        row["sync_share"] = row["t_sync"] / row["t_step"] if row.get("t_sync") is not None and row.get("t_step") else None
        out[cfg] = row
    return out


def _ci(d: dict, fmt: str = "{:.3f}") -> str:
    if d["mean"] is None:
        return "n/a"
    lo, hi = d["ci"]
    return fmt.format(d["mean"]) + (f" [{fmt.format(lo)}, {fmt.format(hi)}]" if lo is not None else "")


def stats_markdown(st: dict) -> str:
    def f(x, fmt="{:.3f}"):
        return "n/a" if x is None else fmt.format(x)

    lines = [f"Statistics at step {st['step']} (the last step every run reached): mean [95 % percentile bootstrap interval over seeds, "
             f"{st['bootstrap']['resamples']} resamples]. AUC = area under the held-out accuracy curve / steps. Paired: per-seed "
             "difference of the final accuracy (same seed = same problem stream), mean [interval], seeds with a positive difference.", "",
             "| configuration | seeds | BF16 weight share | AUC | accuracy | − BF16 (acc) | − NVFP4 (acc) | − carve-out (acc) | KL | χ² token | ESS | "
             "code flips / sync | cos(ΔW_r, ΔW_l) | reward kept / dropped |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for cfg, r in st["configs"].items():
        pr = []
        for ref in PAIR_WITH:
            d = r["paired"].get(f"acc_minus_{ref}")
            pr.append("—" if d is None or d["mean"] is None else f"{_ci(d, '{:+.3f}')} ({d['positive_seeds']}/{d['n']})")
        share = "n/a" if r["bf16_weight_share"] is None else f"{r['bf16_weight_share']:.2%}"
        lines.append(f"| {LABELS.get(cfg, cfg)} | {len(r['seeds'])} | {share} | {_ci(r['auc'])} | {_ci(r['acc'])} | {' | '.join(pr)} | "
                     f"{f(r['kl'], '{:.4f}')} | {f(r['chi2_token'], '{:.3f}')} | {f(r['ess'], '{:.3f}')} | {f(r['code_flip_fraction'], '{:.2e}')} | "
                     f"{f(r['follow_cos'])} | {f(r['reward_kept'])} / {f(r['reward_dropped'])} |")
    return "\n".join(lines) + "\n"


def timing_markdown(t: dict) -> str:
    lines = ["Isolated step times (each configuration alone on the device; median seconds over steps after the first "
             f"{WARMUP}):", "", "| configuration | steps | sync | generate | score | filter | learn | step | sync share |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for cfg, r in t.items():
        v = " | ".join("n/a" if r[k] is None else f"{r[k]:.3f}" for k in ("t_sync", "t_generate", "t_score", "t_filter", "t_learn", "t_step"))
        sh = "n/a" if r["sync_share"] is None else f"{r['sync_share']:.1%}"
        lines.append(f"| {LABELS.get(cfg, cfg)} | {r['steps']} | {v} | {sh} |")
    return "\n".join(lines) + "\n"


def _pm(m, s, fmt="{:.3f}") -> str:
    if m is None:
        return "n/a"
    return fmt.format(m) + (" ± " + fmt.format(s) if s is not None else "")


def to_markdown(s: dict) -> str:
    lines = [f"Target: {s['frac']:.0%} of {s['reference']}'s final held-out accuracy ({s['ref_final_acc']:.3f}, mean over seeds) "
             f"= **{s['target_acc']:.3f}**. ± is the {s['spread']}. Ratio = {s['base']} steps / configuration steps "
             "(> 1: fewer steps than NVFP4; n/a unless every seed of both reached the target).", "",
             "| configuration | seeds done | steps to target | reached | ratio vs NVFP4 | final acc | mean \\|r\\| per step | k3 | filtered | k/K | "
             "t sync | t generate | t score | t filter | t learn | t step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for cfg, r in s["configs"].items():
        ratio = "n/a" if r["ratio_vs_base"] is None else f"{r['ratio_vs_base']:.2f}x"
        kf = "—" if not r["channels_k_fraction"] else f"{r['channels_k_fraction']:.1%}"
        t = " | ".join("n/a" if r[k] is None else f"{r[k]:.2f}" for k in ("t_sync", "t_generate", "t_score", "t_filter", "t_learn", "t_step"))
        lines.append(f"| {LABELS.get(cfg, cfg)} | {r['done']}/{len(r['seeds'])} | {_pm(r['steps_to_target_mean'], r['steps_to_target_spread'], '{:.1f}')} | "
                     f"{r['reached']}/{len(r['seeds'])} | {ratio} | {_pm(r['final_acc_mean'], r['final_acc_spread'])} | "
                     f"{_pm(r['tim_abs_log_ratio_mean'], r['tim_abs_log_ratio_spread'])} | {_pm(r['k3_mean'], r['k3_spread'], '{:.4f}')} | "
                     f"{_pm(r['filtered_fraction_mean'], r['filtered_fraction_spread'], '{:.2f}')} | {kf} | {t} |")
    lines += ["", "Times: seconds per step, mean over steps 4+ and seeds, all runs sharing the GPU(s) at once."]
    return "\n".join(lines) + "\n"


def _smooth(xs: list[float], w: int = 5) -> list[float]:
    return [sum(xs[max(0, i - w + 1): i + 1]) / len(xs[max(0, i - w + 1): i + 1]) for i in range(len(xs))]


def plot(runs: dict[str, dict[int, dict]], s: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(13, 8.5))

    def band(a, xs_per_seed: list[list[tuple[int, float]]], label):
        steps = sorted(set.intersection(*[{x for x, _ in xs} for xs in xs_per_seed])) if xs_per_seed else []
        if not steps:
            return
        vals = [[dict(xs)[x] for xs in xs_per_seed] for x in steps]
        ms = [mean_spread(v) for v in vals]
        m = [a_ for a_, _ in ms]
        sd = [b_ for _, b_ in ms]
        line, = a.plot(steps, m, label=label, marker="o" if a is ax[0, 0] else None, ms=3)
        a.fill_between(steps, [x - y for x, y in zip(m, sd)], [x + y for x, y in zip(m, sd)], color=line.get_color(), alpha=0.2)

    for cfg, seeds in runs.items():
        lab = f"{LABELS.get(cfg, cfg)} (n={len(seeds)})"
        band(ax[0, 0], [r["evals"] for r in seeds.values()], lab)
        for a, key in ((ax[0, 1], "reward"), (ax[1, 0], "tim/abs_log_ratio_mean"), (ax[1, 1], "filtered_fraction")):
            band(a, [list(zip([x["step"] for x in r["steps"]], _smooth([x[key] for x in r["steps"]]))) for r in seeds.values() if r["steps"]], lab)
    ax[0, 0].axhline(s["target_acc"], color="grey", ls="--", lw=0.8, label=f"target {s['target_acc']:.3f}")
    for a, t in zip(ax.flat, ["held-out eval accuracy (greedy, learner); mean ± spread over seeds", "training reward (5-step mean)",
                              "mean |r| = |logp_train − logp_rollout| (5-step mean)", "filtered sequence fraction (5-step mean)"]):
        a.set_title(t, fontsize=10)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    ax[0, 0].legend(fontsize=7)
    ax[1, 0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(folder / "curves.png", dpi=110)
    plt.close(fig)

    names = list(s["configs"])
    fig, a = plt.subplots(figsize=(9, 4))
    bottom = [0.0] * len(names)
    for ph in PHASES[:-1]:
        vals = [s["configs"][n][ph.replace("time/", "t_")] or 0.0 for n in names]
        a.bar([LABELS.get(n, n) for n in names], vals, bottom=bottom, label=ph.replace("time/", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    a.set_ylabel("seconds per step (mean, steps 4+, seeds)")
    a.legend(fontsize=8)
    a.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(folder / "step_time.png", dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--ref", default="bf16")
    ap.add_argument("--base", default="nvfp4")
    ap.add_argument("--frac", type=float, default=0.9)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--upto", type=int, default=30, help="the primary analysis' AUC runs over steps 0..UPTO")
    ap.add_argument("--all-runs", action="store_true", help="also count runs that did not finish (default: finished only)")
    ap.add_argument("--study", choices=("v3", "v4"), default=None,
                    help="the analysis: v3's (four contrasts, AUC 0-UPTO) or v4's pre-registered one (P1, P2, Holm); default: "
                         "the folder's manifest.json, else v3")
    a = ap.parse_args()
    study = study_of(a.folder, a.study)
    unfinished: list[str] = []
    runs = load_runs(a.folder, finished_only=not a.all_runs, unfinished=unfinished)
    times = load_runs(a.folder, _TIMING)
    if not runs and not times:
        raise SystemExit(f"no finished <config>_s<seed>.jsonl or <config>_t<seed>.jsonl in {a.folder} (unfinished: {unfinished})")
    md = ""
    s: dict = {}
    if runs:
        s = summarise(runs, a.ref, a.base, a.frac)
        s["unfinished"] = unfinished
        if study == "v4":
            s["study"] = "v4"
            s["primary"] = primary_v4(runs)
            s["secondary"] = secondary_v4(runs)
        else:
            s["primary"] = primary(runs, a.upto)
            s["secondary"] = secondary(runs, s)
        s["stats"] = statistics(runs)
        devices = sorted({str(r["config"].get("device_name")) for seeds in runs.values() for r in seeds.values()})
        commits = sorted({str(r["config"].get("commit")) for seeds in runs.values() for r in seeds.values()})
        md = (f"Runs: {sum(len(v) for v in runs.values())} finished ({', '.join(f'{k} x{len(v)}' for k, v in runs.items())}); "
              f"unfinished, left out: {', '.join(unfinished) or 'none'}. Device: {', '.join(devices)}. Commit: {', '.join(commits)}.\n\n")
        first = v4_markdown(s["primary"], s["secondary"]) if study == "v4" else primary_markdown(s["primary"], s["secondary"], s["target_acc"])
        md += first + "\n" + to_markdown(s) + "\n" + stats_markdown(s["stats"])
    if times:
        s["timing"] = timing(times)
        md += "\n" + timing_markdown(s["timing"])
    (a.folder / "summary.json").write_text(json.dumps(s, indent=2))
    (a.folder / "summary.md").write_text(md)
    if runs and not a.no_plot:
        plot(runs, s, a.folder)
    print(md)


if __name__ == "__main__":
    main()
