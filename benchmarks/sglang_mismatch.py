"""Training-inference mismatch in the SGLang engine: BF16 vs FourSight vs plain NVFP4, same tokens.

The SGLang twin of ``benchmarks/vllm_mismatch.py`` (same checkpoints, prompts, metrics, table):

1. Builds (or reuses) two checkpoints of the model with ``foursight.checkpoint.quantize_model``:
   FourSight with ``--channels`` BF16 channels, and plain NVFP4 (``channels=0``). The default
   work dir is the vLLM script's, so both engines are measured on the very same checkpoints.
2. Makes fixed sequences: chat-formatted prompts from ``foursight.models.builtin_texts()`` plus
   a sampled continuation (temperature 1, per-request seed) from the SGLang BF16 engine.
3. Teacher-forces the three SGLang engines (``sglang.Engine`` on CPU, one after the other) on
   exactly those tokens (``/generate`` semantics: ``return_logprob=True, logprob_start_len=0``)
   and prints mean / p99 / max |Δ logprob| of FourSight and NVFP4 against the BF16 engine, plus
   the FourSight engine against the PyTorch reference model of its checkpoint
   (``foursight.hf.load_reference_model``), and that reference's own BF16 noise floor (the same
   reference with eager instead of SDPA attention).

All engines run the LM head in float32 (``enable_fp32_lm_head``), as does the reference.

Run in the SGLang venv (CPU; about 5 minutes for SmolLM2 on 2 cores)::

    .venv-sglang/bin/python benchmarks/sglang_mismatch.py            # SmolLM2-135M, k=32
    .venv-sglang/bin/python benchmarks/sglang_mismatch.py --model DIR --channels 2% --num-seqs 16

Results are also written to ``benchmarks/results/sglang_mismatch.json``. The side-by-side table
of docs/sglang.md (vLLM next to SGLang, from both JSON files; no engine needed, any venv)::

    python benchmarks/sglang_mismatch.py --side-by-side
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENGINE_KW = dict(
    device="cpu",
    attention_backend="torch_native",
    log_level="error",
    mem_fraction_static=0.5,
    max_total_tokens=4096,
    disable_cuda_graph=True,
    random_seed=0,
    enable_fp32_lm_head=True,
)


def stats(a, b) -> dict:
    """Same metrics as benchmarks/vllm_mismatch.py."""
    import torch

    d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
    return {
        "mean_abs": float(d.mean()),
        "p99_abs": float(torch.quantile(d, 0.99)),
        "max_abs": float(d.max()),
        "frac_gt_0.1": float((d > 0.1).double().mean()),
        "tokens": int(d.numel()),
    }


def engine(model: str, quantization: str | None = None):
    import sglang as sgl

    return sgl.Engine(model_path=model, quantization=quantization, **ENGINE_KW)


def engine_prompt_logprobs(eng, seqs):
    """``log p(seq[t] | seq[:t])`` for t ≥ 1, teacher-forced, from an ``sglang.Engine`` (float64 tensors)."""
    import torch

    outs = eng.generate(input_ids=[list(s) for s in seqs], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                        return_logprob=True, logprob_start_len=0)
    res = []
    for s, o in zip(seqs, outs):
        lp = o["meta_info"]["input_token_logprobs"]
        assert len(lp) == len(s) and lp[0][0] is None, (len(lp), len(s), lp[:2])
        assert [int(x[1]) for x in lp] == list(s)
        res.append(torch.tensor([float(x[0]) for x in lp[1:]], dtype=torch.float64))
    return res


def hf_prompt_logprobs(model, seqs):
    """The same from an HF causal LM: BF16 body, float32 LM head and softmax."""
    import torch

    head = model.get_output_embeddings()
    res = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([list(s)])
            h = model.model(input_ids=ids).last_hidden_state[0]
            lp = torch.log_softmax((h.float() @ head.weight.float().t())[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            res.append(lp.double())
    return res


def side_by_side(results_dir: Path) -> str:
    """Markdown table of benchmarks/results/{vllm,sglang}_mismatch.json, one column pair per engine."""
    res = {}
    for eng in ("vllm", "sglang"):
        f = results_dir / f"{eng}_mismatch.json"
        if f.exists():
            res[eng] = json.loads(f.read_text())
    if not res:
        raise SystemExit(f"no results in {results_dir}; run benchmarks/vllm_mismatch.py / sglang_mismatch.py first")
    engs = list(res)
    head = "| teacher-forced \\|Δ logprob\\| | " + " | ".join(f"{e} mean | {e} p99 | {e} max | {e} >0.1" for e in engs) + " |"
    sep = "| --- |" + " --- | --- | --- | --- |" * len(engs)
    rows = []
    for label, get in (
        ("FourSight vs BF16 engine", lambda r: r["vs_bf16_engine"]["foursight"]),
        ("plain NVFP4 vs BF16 engine", lambda r: r["vs_bf16_engine"]["nvfp4"]),
        ("FourSight engine vs PyTorch reference", lambda r: r["foursight_engine_vs_reference"]),
        ("reference SDPA vs eager (noise floor)", lambda r: r.get("reference_sdpa_vs_eager")),
    ):
        cells = []
        for e in engs:
            st = get(res[e])
            cells.append(" | ".join(f"{st[k]:.4f}" if k != "frac_gt_0.1" else f"{st[k]:.3f}" for k in ("mean_abs", "p99_abs", "max_abs", "frac_gt_0.1")) if st else "- | - | - | -")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    meta = "; ".join(f"{e}: {r['model']}, k={r['channels']}, {r['sequences']} sequences, {r['vs_bf16_engine']['nvfp4']['tokens']} tokens" for e, r in res.items())
    return "\n".join([head, sep, *rows, "", meta])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side-by-side", action="store_true", help="only print the vLLM/SGLang markdown table from the results JSON files")
    ap.add_argument("--model", default=None, help="BF16 HF folder (default: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--channels", default="32", help="FourSight BF16 channels per layer: K or P%% (default 32)")
    ap.add_argument("--work-dir", default=None, help="where the checkpoints are cached (default: shared with vllm_mismatch.py, ~/.cache/foursight/vllm_mismatch)")
    ap.add_argument("--num-seqs", type=int, default=12)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sglang_mismatch.json"))
    args = ap.parse_args()
    if args.side_by_side:
        print(side_by_side(Path(args.out).parent))
        return

    from transformers import AutoTokenizer

    from foursight.checkpoint import quantize_model
    from foursight.hf import load_reference_model
    from foursight.models import builtin_texts, cache_dir, prepare_smollm2

    t0 = time.time()
    model = Path(args.model) if args.model else prepare_smollm2()
    work = Path(args.work_dir) if args.work_dir else cache_dir() / "vllm_mismatch"
    ck = {}
    for tag, ch in (("foursight", args.channels), ("nvfp4", "0")):
        d = work / f"{model.name}-{tag}-{str(ch).replace('%', 'pct')}"
        if not (d / "config.json").exists():
            print(f"quantizing {model.name} with channels={ch} -> {d}", flush=True)
            quantize_model(model, d, channels=ch, force=True, progress=False)
        ck[tag] = d

    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for t in builtin_texts()[: args.num_seqs]:
        p = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(p["input_ids"]) if hasattr(p, "keys") else list(p))

    eng = engine(str(model))
    outs = eng.generate(
        input_ids=prompts,
        sampling_params=[{"max_new_tokens": args.gen_tokens, "temperature": 1.0, "sampling_seed": i} for i in range(len(prompts))],
    )
    seqs = [p + list(o["output_ids"]) for p, o in zip(prompts, outs)]
    lp = {"bf16": engine_prompt_logprobs(eng, seqs)}
    eng.shutdown()
    del eng
    gc.collect()
    for tag in ("foursight", "nvfp4"):
        eng = engine(str(ck[tag]), "foursight")
        lp[tag] = engine_prompt_logprobs(eng, seqs)
        eng.shutdown()
        del eng
        gc.collect()
    ref_model = load_reference_model(ck["foursight"])
    ref = hf_prompt_logprobs(ref_model, seqs)
    ref_model.set_attn_implementation("eager")
    ref_eager = hf_prompt_logprobs(ref_model, seqs)

    res = {
        "engine": "sglang",
        "model": model.name,
        "channels": args.channels,
        "sequences": len(seqs),
        "tokens_per_seq_mean": sum(len(s) for s in seqs) / len(seqs),
        "vs_bf16_engine": {"foursight": stats(lp["foursight"], lp["bf16"]), "nvfp4": stats(lp["nvfp4"], lp["bf16"])},
        "foursight_engine_vs_reference": stats(lp["foursight"], ref),
        "reference_sdpa_vs_eager": stats(ref, ref_eager),
        "seconds": round(time.time() - t0, 1),
    }
    print()
    print(f"model {model.name}, FourSight channels={args.channels}, {len(seqs)} sequences, {res['vs_bf16_engine']['nvfp4']['tokens']} teacher-forced tokens")
    print(f"{'engine vs SGLang BF16':<28}{'mean |Δ|':>10}{'p99 |Δ|':>10}{'max |Δ|':>10}{'>0.1':>8}")
    for tag in ("foursight", "nvfp4"):
        s = res["vs_bf16_engine"][tag]
        print(f"{'SGLang ' + tag:<28}{s['mean_abs']:>10.4f}{s['p99_abs']:>10.4f}{s['max_abs']:>10.4f}{s['frac_gt_0.1']:>8.3f}")
    s = res["foursight_engine_vs_reference"]
    print(f"{'FourSight engine vs PyTorch reference':<28}  mean {s['mean_abs']:.4f}  p99 {s['p99_abs']:.4f}  max {s['max_abs']:.4f}")
    s = res["reference_sdpa_vs_eager"]
    print(f"{'reference SDPA vs eager (BF16 noise floor)':<28}  mean {s['mean_abs']:.4f}  p99 {s['p99_abs']:.4f}  max {s['max_abs']:.4f}")
    ok = res["vs_bf16_engine"]["foursight"]["mean_abs"] < res["vs_bf16_engine"]["nvfp4"]["mean_abs"]
    print(f"FourSight between BF16 and NVFP4: {ok}   ({res['seconds']} s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
