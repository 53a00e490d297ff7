"""Plot and summarise `foursight rl` JSONL logs (docs/rl.md's figures and table).

    python benchmarks/rl/rl_plot.py benchmarks/results/rl/h200 [--ref bf16]

Reads every ``*.jsonl`` in the folder (one run each, named by file stem), writes
``curves.png`` (eval accuracy, training reward, mean |r|, filtered fraction vs step),
``step_time.png`` (mean step time split into sync / rollout / score / update) and
``summary.json`` + ``summary.md`` (final/best eval accuracy, steps to reach the reference run's
final eval accuracy, mean TIM and filtered fraction, mean step times) into the same folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ORDER = ["bf16", "nvfp4", "foursight", "comp_only", "filter_only"]
LABELS = {"bf16": "BF16 rollouts", "nvfp4": "NVFP4 (k=0)", "foursight": "FourSight (comp. + filter)",
          "comp_only": "compensation only", "filter_only": "filter only (NVFP4)"}
PHASES = ["time/sync", "time/rollout", "time/score", "time/update"]


def load(path: Path) -> dict:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"config": next((r for r in recs if r["type"] == "config"), {}),
            "steps": [r for r in recs if r["type"] == "step"],
            "evals": [r for r in recs if r["type"] == "eval"]}


def smooth(xs: list[float], w: int = 5) -> list[float]:
    out = []
    for i in range(len(xs)):
        seg = xs[max(0, i - w + 1): i + 1]
        out.append(sum(seg) / len(seg))
    return out


def steps_to_reach(evals: list[dict], target: float) -> int | None:
    """First evaluated step whose eval accuracy is ≥ target (None if never)."""
    for e in evals:
        if e["eval_acc"] >= target - 1e-12:
            return int(e["step"])
    return None


def summarise(runs: dict[str, dict], ref: str) -> dict:
    target = runs[ref]["evals"][-1]["eval_acc"] if ref in runs and runs[ref]["evals"] else None
    out = {"reference": ref, "target_eval_acc": target, "runs": {}}
    for name, r in runs.items():
        st, ev = r["steps"], r["evals"]
        n = len(st)
        mean = lambda k: sum(s[k] for s in st) / n if n else float("nan")  # noqa: E731
        # skip the first 3 steps (Triton compile, allocator warm-up) in the timing means
        warm = st[3:] if n > 6 else st
        tmean = {k: (sum(s[k] for s in warm) / len(warm) if warm else float("nan")) for k in PHASES + ["time/step"]}
        out["runs"][name] = {
            "steps": n,
            "eval_acc_initial": ev[0]["eval_acc"] if ev else None,
            "eval_acc_final": ev[-1]["eval_acc"] if ev else None,
            "eval_acc_best": max(e["eval_acc"] for e in ev) if ev else None,
            "steps_to_target": steps_to_reach(ev, target) if target is not None else None,
            "reward_mean_last10": sum(s["reward"] for s in st[-10:]) / max(len(st[-10:]), 1),
            "abs_log_ratio_mean": mean("tim/abs_log_ratio_mean"),
            "k3_mean": mean("tim/k3_mean"),
            "tail_token_fraction": mean("tim/tail_token_fraction"),
            "filtered_fraction": mean("filtered_fraction"),
            **{k.replace("time/", "t_"): v for k, v in tmean.items()},
            "channels_k": r["config"].get("channels_k"),
            "wall_s": st[-1]["wall_s"] if st else None,
        }
    return out


def plot(runs: dict[str, dict], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    for name, r in runs.items():
        lab = LABELS.get(name, name)
        ax[0, 0].plot([e["step"] for e in r["evals"]], [e["eval_acc"] for e in r["evals"]], marker="o", ms=3, label=lab)
        s = [x["step"] for x in r["steps"]]
        ax[0, 1].plot(s, smooth([x["reward"] for x in r["steps"]]), label=lab)
        ax[1, 0].plot(s, smooth([x["tim/abs_log_ratio_mean"] for x in r["steps"]]), label=lab)
        ax[1, 1].plot(s, smooth([x["filtered_fraction"] for x in r["steps"]]), label=lab)
    for a, t in zip(ax.flat, ["held-out eval accuracy (greedy, learner)", "training reward (5-step mean)",
                              "mean |r| = |logp_train - logp_rollout| (5-step mean)", "filtered sequence fraction (5-step mean)"]):
        a.set_title(t)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    ax[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "curves.png", dpi=110)
    plt.close(fig)

    summ = summarise(runs, "bf16")
    names = list(runs)
    fig, a = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(names)
    for ph in PHASES:
        vals = [summ["runs"][n][ph.replace("time/", "t_")] for n in names]
        a.bar([LABELS.get(n, n) for n in names], vals, bottom=bottom, label=ph.replace("time/", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    a.set_ylabel("seconds per step (mean, steps 4+)")
    a.legend()
    a.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(folder / "step_time.png", dpi=110)
    plt.close(fig)


def to_markdown(s: dict) -> str:
    cols = ["steps", "eval_acc_initial", "eval_acc_final", "eval_acc_best", "steps_to_target", "abs_log_ratio_mean",
            "tail_token_fraction", "filtered_fraction", "t_sync", "t_rollout", "t_score", "t_update", "t_step"]
    lines = [f"reference run: {s['reference']}, target eval accuracy = its final value {s['target_eval_acc']}", "",
             "| run | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    fmt = lambda v: "n/a" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))  # noqa: E731
    for name, r in s["runs"].items():
        lines.append(f"| {name} | " + " | ".join(fmt(r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--ref", default="bf16", help="reference run (file stem) for steps-to-accuracy")
    a = ap.parse_args()
    files = sorted(a.folder.glob("*.jsonl"), key=lambda p: ORDER.index(p.stem) if p.stem in ORDER else 99)
    if not files:
        raise SystemExit(f"no *.jsonl in {a.folder}")
    runs = {p.stem: load(p) for p in files}
    plot(runs, a.folder)
    s = summarise(runs, a.ref)
    (a.folder / "summary.json").write_text(json.dumps(s, indent=2))
    (a.folder / "summary.md").write_text(to_markdown(s))
    print(to_markdown(s))


if __name__ == "__main__":
    main()
