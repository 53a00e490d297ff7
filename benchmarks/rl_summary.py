"""Summarise the RL study (benchmarks/rl_study.py logs): curves with seed bands and the table of issue 16.

    python benchmarks/rl_summary.py DIR [--ref bf16] [--base nvfp4] [--frac 0.9] [--no-plot]

Reads ``DIR/<config>_s<seed>.jsonl`` (one ``foursight rl`` log per run) and writes into DIR:

* ``summary.json`` / ``summary.md``, per configuration over its seeds (mean ± spread, spread =
  sample standard deviation over seeds, n-1):
  - ``steps_to_target``: the first evaluated step whose held-out accuracy is ≥ ``frac`` x the
    reference configuration's final accuracy (the mean over its seeds of each seed's last eval);
    seeds that never reach it are counted in ``reached`` and left out of the mean;
  - ``ratio_vs_base``: mean steps of ``base`` (plain NVFP4) / mean steps of this configuration
    (> 1: fewer steps than NVFP4); when ``base`` never reached the target, a lower bound
    (its last step / this configuration's mean), flagged ``ratio_is_lower_bound``;
  - ``final_acc``, ``tim_abs_log_ratio`` (mean |r| per step, averaged over steps), ``k3``,
    ``filtered_fraction``, ``channels_k_fraction``, and the mean time per phase (steps 4 onward);
* ``curves.png``: eval accuracy, reward (5-step mean), mean |r| and filtered fraction against step,
  the mean over seeds with a ± spread band; ``step_time.png``: time per step by phase.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

ORDER = ["bf16", "fp8", "nvfp4", "fs_comp", "fs_filter", "fs_budget", "w4a16"]
LABELS = {"bf16": "BF16", "fp8": "FP8 rowwise W8A8", "nvfp4": "NVFP4 (k=0)", "fs_comp": "FourSight (comp. only)",
          "fs_filter": "FourSight + filter", "fs_budget": "FourSight error budget", "w4a16": "FourSight W4A16"}
PHASES = ["time/sync", "time/rollout", "time/score", "time/update", "time/step"]
WARMUP = 3
_NAME = re.compile(r"^(?P<cfg>.+)_s(?P<seed>\d+)$")


def read_log(path: Path) -> dict:
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line of a killed run
    evals: dict[int, float] = {}
    for r in recs:
        if r.get("type") == "eval":
            evals[int(r["step"])] = float(r["eval_acc"])  # a resumed run re-evaluates: the last one counts
    return {"config": next((r for r in recs if r.get("type") == "config"), {}),
            "steps": [r for r in recs if r.get("type") == "step"],
            "evals": sorted(evals.items()),
            "done": bool(recs) and recs[-1].get("type") == "done"}


def load_runs(folder: Path) -> dict[str, dict[int, dict]]:
    """config -> seed -> run, from ``<config>_s<seed>.jsonl``."""
    out: dict[str, dict[int, dict]] = {}
    for p in sorted(folder.glob("*.jsonl")):
        m = _NAME.match(p.stem)
        if not m:
            continue
        out.setdefault(m["cfg"], {})[int(m["seed"])] = read_log(p)
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
        row["ratio_vs_base"], row["ratio_is_lower_bound"] = None, False
        if b is None or not row["steps_to_target_mean"]:  # never reached, or reached at step 0 (no ratio)
            continue
        if b["steps_to_target_mean"] is not None and b["reached"] == len(b["seeds"]):
            row["ratio_vs_base"] = b["steps_to_target_mean"] / row["steps_to_target_mean"]
        else:  # some or all base seeds never reached the target: their steps are > last_step
            bs = [v if v is not None else b["last_step"] for v in b["steps_to_target_per_seed"].values()]
            row["ratio_vs_base"] = (sum(bs) / len(bs)) / row["steps_to_target_mean"]
            row["ratio_is_lower_bound"] = True
    return res


def _pm(m, s, fmt="{:.3f}") -> str:
    if m is None:
        return "n/a"
    return fmt.format(m) + (" ± " + fmt.format(s) if s is not None else "")


def to_markdown(s: dict) -> str:
    lines = [f"Target: {s['frac']:.0%} of {s['reference']}'s final held-out accuracy ({s['ref_final_acc']:.3f}, mean over seeds) "
             f"= **{s['target_acc']:.3f}**. ± is the {s['spread']}. Ratio = {s['base']} steps / configuration steps "
             "(> 1: fewer steps than NVFP4; ≥ marks a lower bound because NVFP4 did not reach the target in some seeds, "
             "whose steps are counted as the last step).", "",
             "| configuration | seeds done | steps to target | reached | ratio vs NVFP4 | final acc | mean \\|r\\| per step | k3 | filtered | k/K | "
             "t sync | t rollout | t score | t update | t step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for cfg, r in s["configs"].items():
        ratio = "n/a" if r["ratio_vs_base"] is None else ("≥ " if r["ratio_is_lower_bound"] else "") + f"{r['ratio_vs_base']:.2f}x"
        kf = "—" if not r["channels_k_fraction"] else f"{r['channels_k_fraction']:.1%}"
        t = " | ".join("n/a" if r[k] is None else f"{r[k]:.2f}" for k in ("t_sync", "t_rollout", "t_score", "t_update", "t_step"))
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
    a = ap.parse_args()
    runs = load_runs(a.folder)
    if not runs:
        raise SystemExit(f"no <config>_s<seed>.jsonl in {a.folder}")
    s = summarise(runs, a.ref, a.base, a.frac)
    (a.folder / "summary.json").write_text(json.dumps(s, indent=2))
    (a.folder / "summary.md").write_text(to_markdown(s))
    if not a.no_plot:
        plot(runs, s, a.folder)
    print(to_markdown(s))


if __name__ == "__main__":
    main()
