"""Study v4's expected power and detectable effects, from study v3's variances (issue 51 item 4; docs/rl.md "Study v4").

    .venv/bin/python benchmarks/rl/rl_v4_power.py [--v3 benchmarks/results/rl/study-v3] [--reps 4000]

Writes ``benchmarks/results/rl/study-v4-plan/power.json`` and ``power.md`` (each naming the commit it was computed at),
which the pre-registration quotes. Not a v4 result: it reads only v3's logs.

The model: v4's per-seed paired differences of P1 (``fs_filter - nvfp4``, AUC 0-30) and P2 (``fs_filter -
nvfp4_carve``, AUC 0-12) are drawn from a bivariate normal with v3's means, standard deviations and correlation of the
same differences over seeds 0-5, for 14 seeds; each draw is tested as v4 pre-registers (the exact two-sided sign-flip
test of each contrast, Holm over the two at 0.05) and counted as a detection when a contrast is rejected with a mean of
the effect's sign (:func:`rl_summary.sign_flip_p_batch`, fixed RNG). Reported per contrast:

* the power under Holm at v3's mean, and at half of it (v3's means come from six seeds, and P2's window was chosen after
  looking at v3, so v3's estimate is likely optimistic: the half-effect row is the honest planning figure);
* the effect each detects with 80 % power at 0.025 (Bonferroni, what Holm's first step needs, so conservative) and at
  0.05 (Holm's second step, once the other contrast is rejected), at v3's standard deviation;
* the expected half-width of the 97.5 % t interval v4 reports (the bound stated for an unresolved contrast).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_summary as rs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
N = rs.V4_SEEDS


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout
    return head + ("+dirty" if dirty.strip() else "")


def v3_differences(folder: Path) -> dict[str, list[float]]:
    """v3's per-seed paired AUC differences of v4's two contrasts (rl_summary.V4_PRIMARY), seeds 0-5."""
    runs = rs.load_runs(folder, finished_only=True)
    out = {}
    for name, a, b, upto in rs.V4_PRIMARY:
        seeds = sorted(set(runs[a]) & set(runs[b]))
        out[name] = [rs.auc(runs[a][s]["evals"], upto) - rs.auc(runs[b][s]["evals"], upto) for s in seeds]
    return out


def holm_power(means: np.ndarray, sds: np.ndarray, corr: float, n: int, alpha: float, reps: int, seed: int = 0) -> dict:
    """Monte Carlo power of the two contrasts under Holm (see the module doc): per contrast, the share of draws in
    which it is rejected with a mean of its effect's sign, and the share in which both are."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((reps, n, 2))
    z[..., 1] = corr * z[..., 0] + math.sqrt(max(0.0, 1 - corr * corr)) * z[..., 1]
    d = means + sds * z  # [reps, n, 2]
    p = np.stack([rs.sign_flip_p_batch(d[..., k]) for k in range(2)], 1)  # [reps, 2]
    lo, hi = p.min(1, keepdims=True), p.max(1, keepdims=True)
    adj = np.where(p == lo, 2 * lo, np.maximum(2 * lo, hi))  # Holm's adjusted p for two (rl_summary.holm)
    rej = adj <= alpha + 1e-12
    right = np.sign(d.mean(1)) == np.sign(np.where(means == 0, 1.0, means))
    det = rej & right
    return {"power": det.mean(0).tolist(), "both": float(det.all(1).mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--v3", type=Path, default=ROOT / "benchmarks" / "results" / "rl" / "study-v3")
    ap.add_argument("--reps", type=int, default=4000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rl" / "study-v4-plan")
    a = ap.parse_args()
    diffs = v3_differences(a.v3)
    names = [c[0] for c in rs.V4_PRIMARY]
    x = np.array([diffs[k] for k in names]).T  # [6, 2]
    means, sds = x.mean(0), x.std(0, ddof=1)
    corr = float(np.corrcoef(x.T)[0, 1])
    res: dict = {"commit": commit(), "command": "python benchmarks/rl/rl_v4_power.py " + " ".join(sys.argv[1:]),
                 "v3_folder": str(a.v3.resolve().relative_to(ROOT)) if a.v3.resolve().is_relative_to(ROOT) else str(a.v3),
                 "seeds_v4": N, "alpha": rs.V4_ALPHA, "reps": a.reps, "correlation_p1_p2_v3": corr, "contrasts": {}}
    at_v3 = holm_power(means, sds, corr, N, rs.V4_ALPHA, a.reps)
    at_half = holm_power(means / 2, sds, corr, N, rs.V4_ALPHA, a.reps)
    tq = rs.t_quantile(1 - (1 - rs.V4_CI) / 2, N - 1)
    for i, (name, arm, minus, upto) in enumerate(rs.V4_PRIMARY):
        res["contrasts"][name] = {
            "arm": arm, "minus": minus, "upto": upto, "v3_per_seed": diffs[name], "v3_mean": float(means[i]), "v3_sd": float(sds[i]),
            "power_holm_at_v3_mean": at_v3["power"][i], "power_holm_at_half_v3_mean": at_half["power"][i],
            "power_alone_at_0.025": rs.sign_flip_power(float(means[i]), float(sds[i]), N, rs.V4_ALPHA / 2, a.reps),
            "detectable_80_at_0.025": rs.detectable_effect(float(sds[i]), N, rs.V4_ALPHA / 2, 0.8, a.reps),
            "detectable_80_at_0.05": rs.detectable_effect(float(sds[i]), N, rs.V4_ALPHA, 0.8, a.reps),
            "expected_ci_half_width": tq * float(sds[i]) / math.sqrt(N)}
    res["power_both_at_v3_means"] = at_v3["both"]
    res["power_both_at_half_v3_means"] = at_half["both"]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "power.json").write_text(json.dumps(res, indent=2) + "\n")
    L = ["# Study v4: expected power and detectable effects from study v3's variances", "",
         f"Computed at commit `{res['commit']}` by `{res['command'].strip()}` from `{res['v3_folder']}` (seeds 0-5). Model: "
         f"{N} seeds of bivariate normal paired differences with v3's means, sds and correlation ({corr:+.2f}); each draw tested "
         f"as pre-registered (exact sign-flip, Holm over P1 and P2 at {rs.V4_ALPHA}); {a.reps} draws, fixed RNG. Not a v4 result.", "",
         "| contrast | v3 per seed | v3 mean | v3 sd | power (Holm) at v3's mean | at half of it | detectable with 80 %: at 0.025 / "
         "at 0.05 | expected half-width of the 97.5 % t interval |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, c in res["contrasts"].items():
        L.append(f"| {name}: {c['arm']} - {c['minus']}, AUC 0-{c['upto']} | {' / '.join(f'{v:+.3f}' for v in c['v3_per_seed'])} | "
                 f"{c['v3_mean']:+.3f} | {c['v3_sd']:.3f} | {c['power_holm_at_v3_mean']:.0%} | {c['power_holm_at_half_v3_mean']:.0%} | "
                 f"{c['detectable_80_at_0.025']:.3f} / {c['detectable_80_at_0.05']:.3f} | {c['expected_ci_half_width']:.3f} |")
    L += ["", f"Both detected: {res['power_both_at_v3_means']:.0%} at v3's means, {res['power_both_at_half_v3_means']:.0%} at half of them."]
    (a.out / "power.md").write_text("\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()
