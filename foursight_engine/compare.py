"""``foursight compare``: training–inference mismatch across engines and precisions.

1. Rollouts are generated once by a reference engine (by default the first of ``--engines``).
2. The *identical* token sequences are scored, teacher-forced, by every engine and by the
   learner reference, HF BF16.

Every engine is a backend of :mod:`foursight.trainer_bridge.engines` (``generate`` and ``score``:
vLLM ``prompt_logprobs``, SGLang ``input_token_logprobs``, HF
:func:`~foursight.trainer_bridge.scoring.teacher_forced_logprobs`); rollouts are
:class:`~foursight.trainer_bridge.protocol.Rollout` records.
3. The TIM metrics of :mod:`foursight.trainer_bridge.metrics` are computed for every engine
   against the learner, plus a pairwise matrix of mean |Δlogp| between engines.
4. ``report.md``, ``metrics.json`` and PNG plots are written; a rich table is printed.
5. ``--attribute``: in the HF engine, layers of the plain-NVFP4 model are restored to BF16 one
   group at a time, and the share of the NVFP4 mismatch that disappears is ranked.

Engines are started and stopped by the tool (vLLM and SGLang as HTTP servers on 127.0.0.1, HF
in-process), or reached at ``--engine-url KIND:PRECISION=URL`` when already running.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import typer

from foursight.cli_util import guarded
from foursight.trainer_bridge.metrics import DEFAULT_TAIL_THRESHOLD
from foursight.trainer_bridge.protocol import Rollout

PRECISIONS = ("bf16", "foursight", "nvfp4")
KINDS = ("hf", "vllm", "sglang")
LEARNER = "hf:bf16"

BUILTIN_PROMPTS = [
    "What is 37 + 48? Answer with the number.",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers larger than 50.",
    "Write a Python function that reverses a string.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Translate 'good morning, how are you?' into French.",
    "Give me a short tip for writing clear emails.",
    "Sort these numbers: 42, 7, 19, 3, 88.",
    "What does GPU stand for?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "How many legs does a spider have?",
    "Compute 12 times 13 step by step.",
    "Name two benefits of regular exercise.",
    "What is the boiling point of water in Fahrenheit?",
    "Write a SQL query that counts rows in a table named users.",
]


class CompareError(ValueError):
    """Bad ``compare`` arguments (names the flag)."""


@dataclass(frozen=True)
class EngineSpec:
    kind: str
    precision: str

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.precision}"

    @classmethod
    def parse(cls, s: str) -> "EngineSpec":
        kind, _, prec = s.strip().partition(":")
        if kind not in KINDS or prec not in PRECISIONS:
            raise CompareError(f"--engines: {s!r} is not KIND:PRECISION with KIND in {KINDS} and PRECISION in {PRECISIONS}")
        return cls(kind, prec)


def parse_engines(spec: str) -> list[EngineSpec]:
    out = [EngineSpec.parse(s) for s in spec.split(",") if s.strip()]
    if not out:
        raise CompareError("--engines: no engine given")
    if len({e.name for e in out}) != len(out):
        raise CompareError(f"--engines: repeated engine in {spec!r}")
    return out


def parse_engine_urls(items: Sequence[str]) -> dict[str, str]:
    urls = {}
    for it in items:
        name, eq, url = it.partition("=")
        if not eq or not url.startswith("http"):
            raise CompareError(f"--engine-url: {it!r} is not KIND:PRECISION=http://HOST:PORT")
        urls[EngineSpec.parse(name).name] = url.rstrip("/")
    return urls


# ---------------------------------------------------------------------------------------------
# prompts and rollouts


def load_prompts(source: str, n: int, tokenizer) -> list[list[int]]:
    """Chat-templated prompt token ids: ``builtin`` or a JSONL file (``prompt``/``text`` or ``messages`` per line)."""
    if source == "builtin":
        convs = [[{"role": "user", "content": p}] for p in BUILTIN_PROMPTS]
    else:
        convs = []
        for i, line in enumerate(Path(source).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise CompareError(f"--prompts {source}:{i}: invalid JSON ({e.msg})") from None
            if isinstance(rec.get("messages"), list):
                convs.append(rec["messages"])
            elif isinstance(rec.get("prompt", rec.get("text")), str):
                convs.append([{"role": "user", "content": rec.get("prompt", rec.get("text"))}])
            else:
                raise CompareError(f"--prompts {source}:{i}: expected 'prompt', 'text' or 'messages'")
    if not convs:
        raise CompareError(f"--prompts {source}: no prompts")
    out = []
    for i in range(n):
        conv = convs[i % len(convs)]
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer("\n".join(m["content"] for m in conv))["input_ids"]
        out.append(list(ids))
    return out


# ---------------------------------------------------------------------------------------------
# engines: the trainer bridge's backends, driven directly


async def _drive(engine, desc: str, concurrency: int, prompts: list[list[int]] | None, max_tokens: int, temperature: float,
                 seed: int, rollouts: list[Rollout] | None) -> tuple[list[Rollout], list[torch.Tensor]]:
    """Start ``engine``; sample ``prompts`` (when given, prompt ``i`` with seed ``seed + i``) and
    then teacher-force score the rollouts (the sampled ones, or ``rollouts``); stop it."""
    from tqdm.auto import tqdm

    from foursight.trainer_bridge.protocol import SamplingParams

    sem = asyncio.Semaphore(concurrency)

    async def each(items, fn, what):
        bar = tqdm(total=len(items), desc=f"{what} {desc}", unit="seq")

        async def one(i, it):
            async with sem:
                out = await fn(i, it)
                bar.update(1)
                return out

        try:
            return await asyncio.gather(*(one(i, it) for i, it in enumerate(items)))
        finally:
            bar.close()

    await engine.start()
    try:
        if prompts is not None:
            sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=1.0)
            rollouts = [r for r in await each(prompts, lambda i, p: engine.generate(p, sp, max_tokens, seed + i), "generate") if r.token_ids]
            if not rollouts:
                raise RuntimeError(f"{desc} generated no tokens")
        scores = await each(rollouts, lambda i, r: engine.score(r.prompt_ids, r.token_ids), "score")
    finally:
        await engine.aclose()
    return rollouts, [torch.tensor(v, dtype=torch.float64) for v in scores]


def default_sglang_python() -> str:
    """The SGLang venv's python (``$FOURSIGHT_SGLANG_PYTHON``, else ``.venv-sglang`` beside the repo)."""
    env = os.environ.get("FOURSIGHT_SGLANG_PYTHON")
    if env:
        return env
    repo = Path(__file__).resolve().parent.parent
    return str(repo / ".venv-sglang" / "bin" / "python")


def open_engine(spec: EngineSpec, model_dirs: dict[str, Path], urls: dict[str, str], logs: Path, sglang_python: str,
                max_model_len: int):
    """Start (or connect to) one engine: ``(backend, server or None)``."""
    from foursight.trainer_bridge.engines import HFEngine, SGLangHTTPEngine, VLLMHTTPEngine

    src = model_dirs[spec.precision]
    if spec.kind == "hf":
        return HFEngine(src), None
    backend = VLLMHTTPEngine if spec.kind == "vllm" else SGLangHTTPEngine
    if spec.name in urls:
        return backend(urls[spec.name]), None
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{spec.kind}-{spec.precision}.log"
    extra = ["--quantization", "foursight"] if spec.precision != "bf16" else []
    if spec.kind == "vllm":
        from foursight.trainer_bridge.launch import VLLMServer

        srv = VLLMServer(src, max_model_len=max_model_len, extra_args=extra, log_path=log).start()
    else:
        if not Path(sglang_python).exists():
            raise CompareError(f"--sglang-python {sglang_python} does not exist (run scripts/setup.sh, or pass --engine-url)")
        from foursight.trainer_bridge.launch import SGLangServer

        srv = SGLangServer(src, sglang_python, log_path=log, extra_args=extra).start(timeout_s=300)
    return backend(srv.url), srv


# ---------------------------------------------------------------------------------------------
# metrics and report


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
    from foursight.trainer_bridge.metrics import compute_tim_metrics

    lt, m = pad(learner)
    le, _ = pad(engine)
    out = compute_tim_metrics(lt, le, m, tail_threshold=tail_threshold)
    d = (lt - le).abs()[m]
    if d.numel():
        for q in (0.5, 0.9, 0.99):
            out[f"abs_dlogp_p{int(q * 100)}"] = float(torch.quantile(d, q))
    return out


SUMMARY_KEYS = [
    ("tim/abs_log_ratio_mean", "mean |Δlogp|"),
    ("abs_dlogp_p99", "p99 |Δlogp|"),
    ("tim/abs_log_ratio_max", "max |Δlogp|"),
    ("tim/k3_mean", "k3 KL"),
    ("tim/seq_max_abs_log_ratio_mean", "mean seq max |Δ|"),
    ("tim/tail_token_fraction", "tail tokens"),
    ("tim/tail_seq_fraction", "tail seqs"),
    ("tim/tail_share_worst_5pct", "tail share worst 5%"),
]


def _fmt(key: str, v: float) -> str:
    if "fraction" in key or "share" in key:
        return f"{v:.2%}"
    return f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"


def write_plots(out: Path, learner: list[torch.Tensor], scores: dict[str, list[torch.Tensor]], tail_threshold: float) -> list[str]:
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
    fig.tight_layout()
    fig.savefig(out / "cdf_abs_dlogp.png", dpi=120)
    plt.close(fig)
    files.append("cdf_abs_dlogp.png")
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
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("per-sequence max |Δlogp|")
    fig.tight_layout()
    fig.savefig(out / "seq_max_hist.png", dpi=120)
    plt.close(fig)
    files.append("seq_max_hist.png")
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
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "dlogp_vs_position.png", dpi=120)
    plt.close(fig)
    files.append("dlogp_vs_position.png")
    return files


def pairwise(scores: dict[str, list[torch.Tensor]]) -> dict[str, dict[str, float]]:
    names = list(scores)
    return {a: {b: float(torch.cat([(x - y).abs() for x, y in zip(scores[a], scores[b])]).mean()) for b in names} for a in names}


def _md(text: str) -> str:
    """Escape the pipes of ``|Δlogp|`` for Markdown table cells."""
    return text.replace("|", "\\|")


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


# ---------------------------------------------------------------------------------------------
# attribution


def attribute_layers(model_dir: Path, rollouts: list[Rollout], learner: list[torch.Tensor], by: str = "type",
                     error_target: float = 0.05, max_k: int = 256) -> dict:
    """Restore groups of layers of a plain-NVFP4 HF model to BF16 and rank the recovered mismatch.

    Args:
        by: ``"type"`` (q_proj, k_proj, ... across all blocks) or ``"block"`` (each decoder layer).
    Returns:
        {"nvfp4_mean", "n", "error_target", "rows": [{"group", "mean", "recovered", "k_needed"}]}.
    """
    import re

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.calibration import budget_candidates, collect_stats, load_calibration_texts, select_channels
    from foursight.checkpoint import _layer_error, find_linears
    from foursight.hf import quantize_hf_model, restore_bf16
    from foursight.layer import quantize_weight
    from foursight.schema import FourSightConfig
    from foursight.trainer_bridge.scoring import teacher_forced_logprobs

    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    names = find_linears(bf16, FourSightConfig())
    weights = {n: (bf16.get_submodule(n).weight.detach().clone(), None if bf16.get_submodule(n).bias is None else bf16.get_submodule(n).bias.detach().clone()) for n in names}
    groups = collect_stats(bf16, tok, load_calibration_texts(None), names, progress=False)
    k_needed: dict[str, int] = {}
    for g in groups.values():
        for n in g.members:
            w = weights[n][0]
            k_needed[n] = budget_candidates(g.in_features, max_k)[-1]
            for k in budget_candidates(g.in_features, max_k):
                if _layer_error(g.rows, w, quantize_weight(w, select_channels(g.stats.variance, k))) <= error_target:
                    k_needed[n] = k
                    break
    model = quantize_hf_model(bf16, {})

    def mean_mismatch() -> float:
        with torch.no_grad():
            d = [(teacher_forced_logprobs(model, [r.prompt_ids], [r.token_ids])[0][0, : len(r.token_ids)].double() - lp).abs()
                 for r, lp in zip(rollouts, learner)]
        return float(torch.cat(d).mean())

    base = mean_mismatch()
    key = (lambda n: n.rsplit(".", 1)[-1]) if by == "type" else (lambda n: (re.search(r"layers\.(\d+)\.", n) or [None, "other"])[1])
    grouped: dict[str, list[str]] = {}
    for n in names:
        grouped.setdefault(str(key(n)), []).append(n)
    rows = []
    from tqdm.auto import tqdm

    for gname, members in tqdm(list(grouped.items()), desc="attribution", unit="group"):
        removed = {n: restore_bf16(model, n, *weights[n]) for n in members}
        m = mean_mismatch()
        for n, mod in removed.items():  # put the FP4 layers back
            parent, _, child = n.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, mod)
        ks = sorted(k_needed[n] for n in members)
        label = gname if by == "type" else f"layers.{gname}"
        rows.append({"group": label, "mean": m, "recovered": 1 - m / base if base > 0 else 0.0,
                     "k_needed": f"{ks[len(ks) // 2]} / {ks[-1]}"})
    rows.sort(key=lambda r: -r["recovered"])
    return {"nvfp4_mean": base, "n": len(rollouts), "error_target": error_target, "by": by, "rows": rows}


# ---------------------------------------------------------------------------------------------
# driver


def ensure_checkpoints(model_dir: Path, precisions: set[str], channels: str, workdir: Path,
                       foursight_ckpt: Optional[Path], nvfp4_ckpt: Optional[Path]) -> dict[str, Path]:
    """BF16 folder and the FourSight / plain-NVFP4 checkpoints the engines need (quantized once, reused)."""
    from foursight.checkpoint import quantize_model

    dirs = {"bf16": model_dir}
    for prec, given, ch in (("foursight", foursight_ckpt, channels), ("nvfp4", nvfp4_ckpt, "0")):
        if prec not in precisions:
            continue
        if given is not None:
            dirs[prec] = given
            continue
        dst = workdir / f"{model_dir.name}-{prec}-k{ch.replace('%', 'pct')}"
        if not (dst / "config.json").exists():
            quantize_model(model_dir, dst, channels=ch, progress=True)
        dirs[prec] = dst
    return dirs


def run_compare(model_dir: Path, engines: list[EngineSpec], out: Path, prompts: str = "builtin", n: int = 64,
                max_tokens: int = 128, temperature: float = 1.0, seed: int = 0, generator: Optional[str] = None,
                channels: str = "32", engine_urls: Sequence[str] = (), foursight_ckpt: Optional[Path] = None,
                nvfp4_ckpt: Optional[Path] = None, tail_threshold: float = DEFAULT_TAIL_THRESHOLD, attribute: bool = False,
                attribute_by: str = "type", attribute_n: int = 16, sglang_python: Optional[str] = None,
                max_model_len: int = 1024, command: str = "") -> dict:
    """Run the whole comparison and write the report; returns the metrics dict."""
    from transformers import AutoTokenizer

    urls = parse_engine_urls(engine_urls)
    gen = EngineSpec.parse(generator) if generator else engines[0]
    if gen.name not in {e.name for e in engines}:
        engines = [gen, *engines]
    specs = list(engines)
    if LEARNER not in {e.name for e in specs}:
        specs.append(EngineSpec("hf", "bf16"))
    out.mkdir(parents=True, exist_ok=True)
    dirs = ensure_checkpoints(model_dir, {e.precision for e in specs}, channels, out / "checkpoints", foursight_ckpt, nvfp4_ckpt)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = load_prompts(prompts, n, tok)
    sglang_python = sglang_python or default_sglang_python()

    t0 = time.time()
    order = [gen] + [e for e in specs if e != gen]
    scores: dict[str, list[torch.Tensor]] = {}
    rollouts: list[Rollout] = []
    for spec in order:
        engine, srv = open_engine(spec, dirs, urls, out / "logs", sglang_python, max_model_len)
        try:
            rollouts, scores[spec.name] = asyncio.run(_drive(engine, spec.name, 1 if spec.kind == "hf" else 8,
                                                             prompt_ids if spec == gen else None, max_tokens, temperature, seed,
                                                             rollouts))
        finally:
            if srv is not None:
                srv.stop()
    learner = scores[LEARNER]
    result = {
        "config": {"model": str(model_dir), "engines": [e.name for e in engines], "generator": gen.name, "n": len(rollouts),
                   "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "channels": channels,
                   "tail_threshold": tail_threshold, "checkpoints": {k: str(v) for k, v in dirs.items()}, "command": command},
        "num_tokens": int(sum(len(s) for s in learner)),
        "engines": {e.name: engine_metrics(learner, scores[e.name], tail_threshold) for e in engines if e.name != LEARNER},
        "pairwise": pairwise({e.name: scores[e.name] for e in specs}),
        "generator_self_check": {},
        "seconds": 0.0,
    }
    if any(r.logprobs for r in rollouts):
        # the generator's own sampling logprobs against its own teacher-forced scoring (should be ~0)
        d = torch.cat([(torch.tensor(r.logprobs, dtype=torch.float64) - s).abs() for r, s in zip(rollouts, scores[gen.name]) if r.logprobs])
        if d.numel():
            result["generator_self_check"] = {"mean_abs": float(d.mean()), "max_abs": float(d.max())}
    if attribute:
        k = min(attribute_n, len(rollouts))
        result["attribution"] = attribute_layers(model_dir, rollouts[:k], learner[:k], by=attribute_by)
    result["seconds"] = time.time() - t0
    plots = write_plots(out, learner, {e.name: scores[e.name] for e in specs}, tail_threshold)
    (out / "metrics.json").write_text(json.dumps(result, indent=2))
    torch.save({"rollouts": [r.model_dump() for r in rollouts], "scores": scores}, out / "scores.pt")
    write_report(out, result, plots)
    print_table(result)
    return result


@guarded
def compare_command(
    model: Optional[str] = typer.Option(None, "--model", help="BF16 HF model folder (default: the packaged SmolLM2-135M-Instruct)."),
    engines: str = typer.Option("hf:bf16,vllm:bf16,vllm:foursight,vllm:nvfp4", "--engines",
                                help="Comma list of KIND:PRECISION (KIND hf|vllm|sglang, PRECISION bf16|foursight|nvfp4)."),
    prompts: str = typer.Option("builtin", "--prompts", help="Prompt source: 'builtin' or a JSONL file (prompt/text or messages per line)."),
    n: int = typer.Option(64, "--n", min=1, help="Number of rollouts (prompts are cycled)."),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1, help="Completion length cap."),
    out: Path = typer.Option(Path("report"), "--out", help="Report folder (report.md, metrics.json, plots)."),
    generator: Optional[str] = typer.Option(None, "--generator", help="KIND:PRECISION that samples the rollouts (default: the first of --engines)."),
    channels: str = typer.Option("32", "--channels", help="BF16 channels per input of the FourSight checkpoint: a count or a percentage of K."),
    temperature: float = typer.Option(1.0, "--temperature", min=0.0),
    seed: int = typer.Option(0, "--seed", help="Rollout i is sampled with seed + i."),
    engine_url: Optional[list[str]] = typer.Option(None, "--engine-url", help="KIND:PRECISION=URL of a running server (repeatable)."),
    foursight_ckpt: Optional[Path] = typer.Option(None, "--foursight-ckpt", help="Use this FourSight checkpoint instead of quantizing."),
    nvfp4_ckpt: Optional[Path] = typer.Option(None, "--nvfp4-ckpt", help="Use this plain-NVFP4 (k=0) checkpoint instead of quantizing."),
    tail_threshold: float = typer.Option(DEFAULT_TAIL_THRESHOLD, "--tail-threshold", min=0.0,
                                         help="τ in nats: a token is a tail token when |Δlogp| > τ (default ln 3, as the filters)."),
    attribute: bool = typer.Option(False, "--attribute", help="Rank layer groups by the NVFP4 mismatch they cause (HF engine)."),
    attribute_by: str = typer.Option("type", "--attribute-by", help="type (q_proj, ... across blocks) or block."),
    attribute_n: int = typer.Option(16, "--attribute-n", min=1, help="Rollouts used by --attribute."),
    sglang_python: Optional[str] = typer.Option(None, "--sglang-python", help="Python of the SGLang venv (default .venv-sglang)."),
    max_model_len: int = typer.Option(1024, "--max-model-len", min=16),
):
    """Measure training-inference mismatch across engines and precisions; write report.md, metrics.json and plots.

    The first of --engines generates the rollouts unless --generator is given; every engine and the
    learner (HF BF16) then score the identical tokens teacher-forced. FourSight/NVFP4 checkpoints are
    made with `foursight quantize` (--channels) unless given.
    """
    from foursight.models import resolve_model

    specs = parse_engines(engines)
    if attribute_by not in ("type", "block"):
        raise CompareError("--attribute-by must be 'type' or 'block'")
    src = resolve_model(model)
    run_compare(src, specs, out, prompts=prompts, n=n, max_tokens=max_tokens, temperature=temperature, seed=seed,
                generator=generator, channels=channels, engine_urls=engine_url or [], foursight_ckpt=foursight_ckpt,
                nvfp4_ckpt=nvfp4_ckpt, tail_threshold=tail_threshold, attribute=attribute, attribute_by=attribute_by,
                attribute_n=attribute_n, sglang_python=sglang_python, max_model_len=max_model_len,
                command="foursight compare " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 and sys.argv[1] == "compare" else "")
    print(f"report: {out / 'report.md'}")
