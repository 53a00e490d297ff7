"""The fidelity table of issue 16 (docs/fidelity.md): one fixed set of sampled completions,
teacher-forced by every rollout configuration, against the HF BF16 learner.

    python benchmarks/fidelity/fidelity_table.py [--n 32] [--max-tokens 96] [--out benchmarks/results/fidelity]

1. **Rollouts once**: the vLLM CPU engine in BF16 (``foursight compare``'s backend,
   :func:`foursight.compare.launch.open_engine` / ``drive``) samples ``--n`` completions of the
   built-in chat prompts (temperature 1, rollout i with seed ``--seed`` + i) and teacher-forces
   them: that is the **BF16 engine floor** (its |Δlogp| against the learner; vLLM returns no full
   distribution, so no exact KL for it).
2. **Every configuration** is built in this process on the same BF16 weights from one calibration
   (:func:`foursight.calibration.collect_stats` on the default calibration texts, exactly what
   ``foursight quantize`` uses): plain NVFP4 (k = 0); FourSight W4A4 with k in ``--ks`` (a count,
   or a percentage of K as ``--channels 2%`` reads it: rounded up to 16-channel blocks per layer);
   FourSight with ``--error-target`` at ``--targets`` (per-group k as ``foursight quantize
   --error-target`` chooses it; the table reports the mean k / K); W4A16 FourSight
   (``--w4a16-k``); FP8 rowwise W8A8 (:mod:`foursight.fp8`); with ``--bf16-layers`` (repeatable),
   NVFP4 with those whole layers kept in BF16 (:mod:`foursight.bf16_layers`, the practitioners'
   carve-out; every row reports its BF16 weight share). Each teacher-forces the same tokens in
   the HF reference model (:func:`foursight.hf.quantize_hf_model`; on CPU the layers run
   :func:`foursight.layer.reference_linear`), which gives the full distribution per token.
3. **Cross-check**: the vLLM CPU engine serving the FourSight k = 32 checkpoint
   (``foursight quantize --channels 32``) scores the same tokens; the table reports how far its
   logprobs are from the HF reference's (they should agree to rounding), so the HF rows stand for
   what the vLLM CPU engine would serve.
4. Per configuration (:func:`foursight.compare.engine_metrics` for the TIM metrics): mean and p99
   |Δlogp|, the exact KL(learner ‖ config) over the full vocabulary (mean per token), tail-token and
   tail-sequence fractions (τ = ln 3), and the share of sequences each filter of
   :mod:`foursight.trainer_bridge.filters` would keep (defaults: max_token τ = ln 3, tail_count n = 2,
   geo_mean [0.999, 1.001], quantile q = 0.02; and max_token at τ = 2.5, the RL study's setting).

A smaller table: ``--ks ''``, ``--targets ''``, ``--w4a16-k 0`` and ``--no-fp8`` leave those rows out.
Writes ``OUT.json`` and ``OUT.md``; both name the commit measured on and the machine (host, CPU,
threads, load average at the start and the end).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import REPO, add_sampling_args, channels_by_layer, git_commit  # noqa: E402  (benchmarks/common.py)

FILTERS = [("max_token", {}), ("max_token", {"tau": 2.5}), ("tail_count", {}), ("geo_mean", {}), ("quantile", {})]


def full_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """float32 [n, V]: log-softmax of the float32 logits at the completion positions (one unpadded forward)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)].float()
    return torch.log_softmax(logits, -1)


def score_full(model, rollouts) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per rollout: sampled-token logprobs (float64 [n]) and the full log-distribution (float32 [n, V])."""
    samp, full = [], []
    for r in rollouts:
        lp = full_logprobs(model, r.prompt_ids, r.token_ids)
        full.append(lp)
        samp.append(lp.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0].double())
    return samp, full


def exact_kl(learner_full: list[torch.Tensor], cfg_full: list[torch.Tensor]) -> float:
    """Mean over tokens of KL(p_learner ‖ p_config) = Σ_v p_l (log p_l − log p_c), in float64."""
    tot, n = 0.0, 0
    for a, b in zip(learner_full, cfg_full):
        a64, b64 = a.double(), b.double()
        tot += float((a64.exp() * (a64 - b64)).sum())
        n += a.shape[0]
    return tot / max(n, 1)


def filter_keeps(learner: list[torch.Tensor], cfg: list[torch.Tensor]) -> dict[str, float]:
    from foursight.compare.report import pad
    from foursight.trainer_bridge.filters import FilterConfig, keep_mask

    lt, m = pad(learner)
    le, _ = pad(cfg)
    out = {}
    for pol, kw in FILTERS:
        keep, _ = keep_mask(lt, le, m, FilterConfig(policy=pol, **kw))
        name = pol + (f"(τ={kw['tau']})" if kw else "")
        out[name] = float(keep.double().mean())
    return out


def choose_k_levels(groups, model, targets: list[float]) -> dict[str, dict[float, int]]:
    """Per group and target, the k ``foursight quantize --error-target t`` picks (no ``--max-k``),
    each candidate's error computed once for all targets (:func:`foursight.channels.choose_k_levels`)."""
    from foursight.channels import choose_k_levels as levels

    return {g.key: levels(g, [model.get_submodule(n).weight.detach() for n in g.members], targets) for g in groups.values()}


def k_rows(ks: str) -> list[str]:
    """The ``--ks`` entries: counts (``"16"``) and percentages of K (``"2%"``); ``""`` gives none."""
    from foursight import schema

    out = [x.strip() for x in ks.split(",") if x.strip()]
    for x in out:
        schema.check_channel_spec(x)
    return out


def k_row_name(spec: str) -> str:
    """``foursight k=16`` for a count, ``foursight 2%`` for a percentage of K (per-layer k)."""
    return f"foursight {spec}" if spec.endswith("%") else f"foursight k={int(spec)}"


def machine() -> dict:
    """Where the measurement ran: host, CPU model, cores, torch threads and the 1/5/15-minute load."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "loadavg_start": list(os.getloadavg())}


def uncommitted() -> list[str]:
    """Tracked files of the code the table runs (the package folders and benchmarks/) that differ from
    the commit at run time (``git status --porcelain``), so a result says whether it was measured on
    exactly that commit."""
    paths = ["foursight_engine", "kernels", "quant_methods", "trainer_bridge", "benchmarks/common.py", "benchmarks/fidelity"]
    try:
        return subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *paths], capture_output=True, text=True,
                              check=True, cwd=REPO, timeout=10).stdout.splitlines()
    except Exception:  # noqa: BLE001 - no git (a device copy): nothing to say
        return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sampling_args(ap, n=32, max_tokens=96)
    ap.add_argument("--ks", default="16,32,64,128", help="FourSight rows: k per layer, a count or a percentage of K (2%%); '' = none")
    ap.add_argument("--targets", default="0.1,0.2,0.3", help="FourSight --error-target rows; '' = none")
    ap.add_argument("--w4a16-k", type=int, default=32, help="the W4A16 FourSight row's k; 0 = no W4A16 row")
    ap.add_argument("--no-fp8", action="store_true", help="no FP8 rowwise row")
    ap.add_argument("--no-vllm", action="store_true", help="HF BF16 samples the rollouts; no floor row, no cross-check")
    ap.add_argument("--no-cross-check", action="store_true", help="skip the vLLM CPU FourSight k=32 cross-check (saves a quantize + server start)")
    ap.add_argument("--bf16-layers", action="append", default=[],
                    help="add a row: NVFP4 with these layers in BF16 (attention, first:N, last:N, & ...; repeatable)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/fidelity"))
    a = ap.parse_args()
    ks = k_rows(a.ks)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight import schema
    from foursight.calibration import collect_stats, load_calibration_texts
    from foursight.schema import find_linears
    from foursight.compare.launch import drive, open_engine
    from foursight.compare.prompts import load_prompts
    from foursight.compare.report import engine_metrics
    from foursight.compare.run import ensure_checkpoints
    from foursight.compare.spec import EngineSpec
    from foursight.hf import quantize_hf_model, quantize_hf_model_fp8
    from foursight.models import resolve_model
    from foursight.trainer_bridge.backends.hf import HFEngine
    from foursight.trainer_bridge.metrics import DEFAULT_TAIL_THRESHOLD

    t0 = time.time()
    where = machine()
    commit, dirty = git_commit(), uncommitted()
    torch.manual_seed(0)
    md = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(md)
    prompts = load_prompts("builtin", a.n, tok)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "foursight-fidelity"  # checkpoints and logs: outside the repo
    timings: dict[str, float] = {}
    # 1. rollouts once (vLLM CPU BF16: also the engine floor)
    floor = None
    if a.no_vllm:
        gen_engine = HFEngine(md)
        rollouts, _ = asyncio.run(drive(gen_engine, "hf:bf16", 1, prompts, a.max_tokens, 1.0, a.seed, None))
        generator = "hf:bf16"
    else:
        eng, srv = open_engine(EngineSpec("vllm", "bf16"), {"bf16": md}, {}, work / "logs", "", 1024)
        try:
            rollouts, floor = asyncio.run(drive(eng, "vllm:bf16", 8, prompts, a.max_tokens, 1.0, a.seed, None))
        finally:
            srv.stop()
        generator = "vllm:bf16"
    timings["rollouts"] = time.time() - t0
    print(f"{len(rollouts)} rollouts, {sum(len(r.token_ids) for r in rollouts)} tokens ({timings['rollouts']:.0f} s)", flush=True)
    # 2. the learner and one calibration
    base = AutoModelForCausalLM.from_pretrained(md, dtype=torch.bfloat16).eval()
    learner, learner_full = score_full(base, rollouts)
    names = find_linears(base, schema.FourSightConfig())
    groups = collect_stats(base, tok, load_calibration_texts(None), names, progress=False)
    in_f = {n: base.get_submodule(n).in_features for n in names}

    def chans(k_of_group) -> dict[str, torch.Tensor]:
        return channels_by_layer(groups, k_of_group)

    configs: list[tuple[str, dict]] = [("nvfp4", {"channels": {}})]
    for spec in ks:
        configs.append((k_row_name(spec), {"channels": chans(lambda g, spec=spec: schema.parse_channel_budget(spec, g.in_features, g.members[0]))}))
    targets = [float(x) for x in a.targets.split(",") if x.strip()]
    if targets:
        t1 = time.time()
        kt = choose_k_levels(groups, base, targets)
        timings["error_target_k"] = time.time() - t1
    for t in targets:
        configs.append((f"foursight error-target {t}", {"channels": chans(lambda g, t=t: kt[g.key][t])}))
    if a.w4a16_k:
        configs.append((f"w4a16 foursight k={a.w4a16_k}", {"channels": chans(lambda g: a.w4a16_k), "act_quant": False}))
    if not a.no_fp8:
        configs.append(("fp8 rowwise", {"fp8": True}))
    from foursight.bf16_layers import bf16_layer_patterns, model_bf16_share, num_blocks_of

    carve = bf16_layer_patterns(a.bf16_layers, num_blocks_of(base)) if a.bf16_layers else []
    if carve:
        configs.insert(1, ("nvfp4 + bf16 " + " + ".join(a.bf16_layers), {"channels": {}, "carve": carve}))
    rows: dict[str, dict] = {}
    scores: dict[str, list[torch.Tensor]] = {}
    for name, c in configs:
        t1 = time.time()
        m = copy.deepcopy(base)
        if c.get("fp8"):
            quantize_hf_model_fp8(m)
        else:
            quantize_hf_model(m, c["channels"], ignore=("lm_head", *c.get("carve", [])), act_quant=c.get("act_quant", True))
        samp, full = score_full(m, rollouts)
        del m
        scores[name] = samp
        met = engine_metrics(learner, samp, DEFAULT_TAIL_THRESHOLD)
        ks = [int(c["channels"][n].numel()) if c.get("channels") else 0 for n in names] if not c.get("fp8") else None
        rows[name] = {
            "source": "HF reference (in process)",
            "mean_abs_dlogp": met["tim/abs_log_ratio_mean"], "p99_abs_dlogp": met.get("abs_dlogp_p99"),
            "exact_kl": exact_kl(learner_full, full), "k3": met["tim/k3_mean"],
            "tail_token_fraction": met["tim/tail_token_fraction"], "tail_seq_fraction": met["tim/tail_seq_fraction"],
            "filters_keep": filter_keeps(learner, samp),
            "k_mean": None if ks is None else sum(ks) / len(ks),
            "k_fraction": None if ks is None else sum(k / in_f[n] for k, n in zip(ks, names)) / len(names),
            "bf16_weight_share": None if c.get("fp8") else model_bf16_share(base, ["lm_head"], c.get("carve", []), c["channels"])["bf16_weight_share"],
            "seconds": time.time() - t1,
        }
        del full
        print(f"{name}: mean |Δ| {rows[name]['mean_abs_dlogp']:.4f}, KL {rows[name]['exact_kl']:.4f}, "
              f"k/K {rows[name]['k_fraction']} ({rows[name]['seconds']:.0f} s)", flush=True)
    cross = None
    if floor is not None:
        met = engine_metrics(learner, floor, DEFAULT_TAIL_THRESHOLD)
        rows = {"bf16 engine (vLLM CPU)": {
            "source": "vLLM CPU engine", "mean_abs_dlogp": met["tim/abs_log_ratio_mean"], "p99_abs_dlogp": met.get("abs_dlogp_p99"),
            "exact_kl": None, "k3": met["tim/k3_mean"], "tail_token_fraction": met["tim/tail_token_fraction"],
            "tail_seq_fraction": met["tim/tail_seq_fraction"], "filters_keep": filter_keeps(learner, floor),
            "k_mean": None, "k_fraction": None}, **rows}
    if floor is not None and not a.no_cross_check and "foursight k=32" in scores:
        # 3. the vLLM CPU engine on the FourSight k=32 checkpoint, same tokens
        t1 = time.time()
        dirs = ensure_checkpoints(md, {"foursight"}, "32", work / "checkpoints", None, None)
        eng, srv = open_engine(EngineSpec("vllm", "foursight"), dirs, {}, work / "logs", "", 1024)
        try:
            _, vfs = asyncio.run(drive(eng, "vllm:foursight", 8, None, a.max_tokens, 1.0, a.seed, rollouts))
        finally:
            srv.stop()
        d = torch.cat([(x - y).abs() for x, y in zip(vfs, scores["foursight k=32"])])
        mv = engine_metrics(learner, vfs, DEFAULT_TAIL_THRESHOLD)
        cross = {"config": "foursight k=32", "checkpoint": str(dirs["foursight"]), "vllm_vs_hf_mean_abs": float(d.mean()),
                 "vllm_vs_hf_max_abs": float(d.max()), "vllm_mean_abs_dlogp": mv["tim/abs_log_ratio_mean"],
                 "hf_mean_abs_dlogp": rows["foursight k=32"]["mean_abs_dlogp"], "seconds": time.time() - t1}
        print(f"cross-check: {cross}", flush=True)
    res = {"command": "python benchmarks/fidelity/fidelity_table.py " + (f"--model {a.model} " if a.model else "") + f"--n {a.n} --max-tokens {a.max_tokens} --seed {a.seed} --ks '{a.ks}' "
                      f"--targets '{a.targets}' --w4a16-k {a.w4a16_k}" + (" --no-fp8" if a.no_fp8 else "") + (" --no-vllm" if a.no_vllm else "")
                      + (" --no-cross-check" if a.no_cross_check else "") + "".join(f" --bf16-layers '{x}'" for x in a.bf16_layers),
           "model": str(md), "generator": generator, "n": len(rollouts), "tokens": sum(len(r.token_ids) for r in rollouts),
           "max_tokens": a.max_tokens, "tail_threshold": DEFAULT_TAIL_THRESHOLD, "rows": rows, "vllm_cross_check": cross,
           "seconds": time.time() - t0, "timings": timings, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "commit": commit, "uncommitted_at_run": dirty, "machine": {**where, "loadavg_end": list(os.getloadavg())},
           "finished_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    a.out.with_suffix(".md").write_text(to_markdown(res))
    print(to_markdown(res))


def to_markdown(res: dict) -> str:
    fl = [f"{p}" + (f"(τ={kw['tau']})" if kw else "") for p, kw in FILTERS]
    f = lambda v, fmt="{:.4f}": "—" if v is None else fmt.format(v)  # noqa: E731
    lines = [f"{res['n']} completions ({res['tokens']} tokens, ≤ {res['max_tokens']} each) of the built-in prompts, sampled once by "
             f"**{res['generator']}** and teacher-forced by every configuration; reference: the HF BF16 learner. "
             f"Tail: |Δlogp| > τ = ln 3. Filters: share of sequences kept.", "",
             f"Command: `{res['command']}` ({res['seconds'] / 60:.1f} min, {res['threads']} CPU threads).", ""]
    if res.get("commit"):
        m = res["machine"]
        lines += [f"Measured on commit `{res['commit']}`" + (f" (plus uncommitted changes: {', '.join(x.split()[-1] for x in res['uncommitted_at_run'])})"
                                                            if res.get("uncommitted_at_run") else "")
                  + f", {res['finished_utc']}, host `{m['host']}` ({m['cpu']}, {m['cores']} cores), load average "
                  f"{m['loadavg_start'][0]:.1f} at the start and {m['loadavg_end'][0]:.1f} at the end.", ""]
    lines += ["| configuration | source | mean k / K | BF16 weight share | mean \\|Δlogp\\| | p99 \\|Δlogp\\| | exact KL | tail tokens | tail seqs | "
              + " | ".join(f"keep {x}" for x in fl) + " |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(fl)]
    for name, r in res["rows"].items():
        kf = "—" if r["k_fraction"] is None else f"{r['k_fraction']:.1%}"
        sh = "—" if r.get("bf16_weight_share") is None else f"{r['bf16_weight_share']:.2%}"
        lines.append(f"| {name} | {r['source']} | {kf} | {sh} | {f(r['mean_abs_dlogp'])} | {f(r['p99_abs_dlogp'])} | {f(r['exact_kl'])} | "
                     f"{r['tail_token_fraction']:.2%} | {r['tail_seq_fraction']:.2%} | "
                     + " | ".join(f"{r['filters_keep'][x]:.0%}" for x in fl) + " |")
    c = res.get("vllm_cross_check")
    if c:
        lines += ["", f"Cross-check: the vLLM CPU engine serving the {c['config']} checkpoint, on the same tokens, differs from the HF "
                      f"reference by {c['vllm_vs_hf_mean_abs']:.2e} mean / {c['vllm_vs_hf_max_abs']:.2e} max |logp| "
                      f"(its mean |Δlogp| vs the learner: {c['vllm_mean_abs_dlogp']:.4f}; HF reference: {c['hf_mean_abs_dlogp']:.4f})."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
