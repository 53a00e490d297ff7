"""Metrics, plots and the report of ``foursight compare``."""

from __future__ import annotations

from pathlib import Path

import torch

from foursight.compare.spec import LEARNER


def pad(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad float64 sequences to [B, T] with a bool mask."""
    t = max((len(s) for s in seqs), default=0)
    out = torch.zeros(len(seqs), max(t, 1), dtype=torch.float64)
    mask = torch.zeros(len(seqs), max(t, 1), dtype=torch.bool)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
        mask[i, : len(s)] = True
    return out, mask


def engine_metrics(learner: list[torch.Tensor], engine: list[torch.Tensor], tail_threshold: float) -> dict[str, float]:
    """TIM metrics of ``engine`` against the learner (reused from the trainer bridge) + |Δ| quantiles."""
    from foursight.trainer_bridge.metrics import abs_diff_summary, compute_tim_metrics

    lt, m = pad(learner)
    le, _ = pad(engine)
    out = compute_tim_metrics(lt, le, m, tail_threshold=tail_threshold)
    s = abs_diff_summary(learner, engine)
    if s["tokens"]:
        out.update({f"abs_dlogp_{q}": s[q] for q in ("p50", "p90", "p99")})
    return out


SUMMARY_KEYS = [
    ("tim/abs_log_ratio_mean", "mean |Δlogp|"),
    ("abs_dlogp_p99", "p99 |Δlogp|"),
    ("tim/abs_log_ratio_max", "max |Δlogp|"),
    ("tim/k3_mean", "mean k3"),
    ("tim/seq_max_abs_log_ratio_mean", "mean seq max |Δ|"),
    ("tim/tail_token_fraction", "tail tokens"),
    ("tim/tail_seq_fraction", "tail seqs"),
    ("tim/tail_share_worst_5pct", "tail share worst 5%"),
]


def _fmt(key: str, v: float) -> str:
    if "fraction" in key or "share" in key:
        return f"{v:.2%}"
    return f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"


def _save(fig, out: Path, name: str, keep: dict | None = None) -> str:
    """Lay out, write ``out/name`` (120 dpi) and close ``fig`` (or put it in ``keep[name]``); returns ``name``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=120, bbox_inches="tight")
    if keep is None:
        plt.close(fig)
    else:
        keep[name] = fig
    return name


def write_plots(out: Path, learner: list[torch.Tensor], scores: dict[str, list[torch.Tensor]], tail_threshold: float,
                figures: dict | None = None) -> list[str]:
    """Write the three report plots into ``out``; returns their file names. With ``figures`` (a
    dict) the matplotlib figures are kept there by file name instead of being closed (tests)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in scores if n != LEARNER]
    files = []
    # 1. CDF of |Δlogp|
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for n in names:
        d = torch.cat([(a - b).abs() for a, b in zip(learner, scores[n])]).clamp(min=1e-7).sort().values
        if d.numel():
            ax.plot(d.numpy(), torch.linspace(0, 1, d.numel()).numpy(), label=n)
    ax.set_xscale("log")
    ax.set_xlabel("|Δlogp| vs learner (HF BF16), per token")
    ax.set_ylabel("CDF")
    ax.axvline(tail_threshold, color="grey", ls="--", lw=0.8)
    ax.legend()
    ax.grid(alpha=0.3)
    files.append(_save(fig, out, "cdf_abs_dlogp.png", figures))
    # 2. per-sequence max |Δ| histogram, tails marked
    fig, axes = plt.subplots(len(names), 1, figsize=(6.4, 1.9 * len(names) + 0.6), sharex=True, squeeze=False)
    allmax = [torch.stack([(a - b).abs().max() if len(a) else torch.tensor(0.0, dtype=torch.float64)
                           for a, b in zip(learner, scores[n])]) for n in names]
    hi = max(float(m.max()) for m in allmax) if allmax else 1.0
    bins = torch.linspace(0, max(hi, tail_threshold) * 1.05, 40).numpy()
    for ax, n, mx in zip(axes[:, 0], names, allmax):
        tail = mx > tail_threshold
        ax.hist(mx[~tail].numpy(), bins=bins, color="tab:blue", label="within τ")
        ax.hist(mx[tail].numpy(), bins=bins, color="tab:red", label=f"tail (> τ={tail_threshold:.4g}): {int(tail.sum())}")
        ax.set_title(n, fontsize=9)
        ax.set_ylabel("sequences")
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("per-sequence max |Δlogp|")
    files.append(_save(fig, out, "seq_max_hist.png", figures))
    # 3. mismatch against position
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for n in names:
        d, m = pad([(a - b).abs() for a, b in zip(learner, scores[n])])
        cnt = m.sum(0)
        mean = (d * m).sum(0) / cnt.clamp(min=1)
        keep = cnt >= max(2, int(0.2 * len(learner)))
        ax.plot(torch.arange(d.shape[1])[keep].numpy(), mean[keep].numpy(), label=n)
    ax.set_yscale("log")
    ax.set_xlabel("position in completion (tokens)")
    ax.set_ylabel("mean |Δlogp| vs learner")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)  # beside the axes, never over the curves
    ax.grid(alpha=0.3)
    files.append(_save(fig, out, "dlogp_vs_position.png", figures))
    return files


def pairwise(scores: dict[str, list[torch.Tensor]]) -> dict[str, dict[str, float]]:
    """Mean |Δlogp| of every pair of engines over the same tokens (:func:`abs_diff_summary`)."""
    from foursight.trainer_bridge.metrics import abs_diff_summary

    names = list(scores)
    return {a: {b: abs_diff_summary(scores[a], scores[b])["mean"] for b in names} for a in names}


def _md(text: str) -> str:
    """Escape the pipes of ``|Δlogp|`` for Markdown table cells."""
    return text.replace("|", "\\|")


def k3_note(generator: str) -> str:
    """What the ``mean k3`` column is for tokens drawn by ``generator`` (it is a KL estimate only on the engine's own samples)."""
    return (
        f"`mean k3` is the mean of e^r − 1 − r with r = logp_learner − logp_engine. It estimates KL(engine ‖ learner) only on "
        f"tokens the engine itself sampled; these tokens were sampled by **{generator}**, so for every other engine it is not a KL "
        "(with a BF16 generator, whose samples follow the learner, its expectation is χ²(learner ‖ engine) − KL(learner ‖ engine)). "
        "It ranks engines by drift, but read it as a mismatch score, not as a divergence."
    )


def write_report(out: Path, result: dict, plots: list[str]) -> None:
    lines = [
        "# FourSight mismatch report",
        "",
        f"Model: `{result['config']['model']}` · {result['config']['n']} rollouts of up to {result['config']['max_tokens']} tokens "
        f"generated by **{result['config']['generator']}** (temperature {result['config']['temperature']}, seed {result['config']['seed']}) · "
        f"{result['num_tokens']} scored completion tokens · learner reference **{LEARNER}** · tail threshold τ = {result['config']['tail_threshold']:.4g}.",
        "",
        f"Command: `{result['config']['command']}`",
        "",
        "## Mismatch against the learner (HF BF16)",
        "",
        "| engine | " + " | ".join(_md(lbl) for _, lbl in SUMMARY_KEYS) + " |",
        "|---|" + "---:|" * len(SUMMARY_KEYS),
    ]
    for name, m in result["engines"].items():
        lines.append(f"| {name} | " + " | ".join(_fmt(k, m.get(k, float('nan'))) for k, _ in SUMMARY_KEYS) + " |")
    lines += ["", k3_note(result["config"]["generator"])]
    names = list(result["pairwise"])
    lines += ["", "## Pairwise mean |Δlogp| between engines", "", "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for a in names:
        lines.append(f"| {a} | " + " | ".join(f"{result['pairwise'][a][b]:.4f}" for b in names) + " |")
    lines += ["", "## Plots", ""]
    for p in plots:
        lines.append(f"![{p}]({p})")
        lines.append("")
    if result.get("attribution"):
        att = result["attribution"]
        lines += ["## Per-layer attribution (HF engine)", "",
                  f"Starting from plain NVFP4 (mean |Δlogp| = {att['nvfp4_mean']:.4f} vs the learner on {att['n']} rollouts), "
                  "each group of layers is restored to BF16 alone; *recovered* is the share of the NVFP4 mismatch that disappears. "
                  f"*k needed* is the smallest BF16 channel count (of 0, 16, 32, …) that brings each layer's relative output error on calibration "
                  f"activations to ≤ {att['error_target']} (256 means the search cap was reached).", "",
                  "| rank | restored to BF16 | mean \\|Δlogp\\| | recovered | k needed (median / max over its layers) |", "|---:|---|---:|---:|---|"]
        for i, row in enumerate(att["rows"], 1):
            lines.append(f"| {i} | {row['group']} | {row['mean']:.4f} | {row['recovered']:.1%} | {row['k_needed']} |")
        lines.append("")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Mismatch vs learner ({LEARNER}), {result['num_tokens']} tokens")
    t.add_column("engine", no_wrap=True)
    for _, lbl in SUMMARY_KEYS:
        t.add_column(lbl, justify="right", no_wrap=True)
    for name, m in result["engines"].items():
        t.add_row(name, *(_fmt(k, m.get(k, float("nan"))) for k, _ in SUMMARY_KEYS))
    Console(width=max(Console().width, 150)).print(t)
