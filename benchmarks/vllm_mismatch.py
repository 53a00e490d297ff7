"""Training-inference mismatch in the vLLM engine: BF16 vs FourSight vs plain NVFP4, same tokens.

1. Builds (or reuses) two checkpoints of the model with ``foursight.checkpoint.quantize_model``:
   FourSight with ``--channels`` BF16 channels, and plain NVFP4 (``channels=0``).
2. Makes fixed sequences: chat-formatted prompts from ``foursight.models.builtin_texts()`` plus
   a sampled continuation (temperature 1, per-request seed) from the BF16 engine (rollout-like).
3. Teacher-forces the three engines (vLLM, in-process, one after the other) on exactly those
   tokens (``prompt_logprobs``) and prints mean / p99 / max |Δ logprob| of FourSight and NVFP4
   against the BF16 engine, plus the FourSight engine against the PyTorch reference model of
   its checkpoint (``foursight.hf.load_reference_model``).

Run (CPU, about 3-4 minutes for SmolLM2 on 2 cores)::

    .venv/bin/python benchmarks/vllm_mismatch.py            # SmolLM2-135M, k=32
    .venv/bin/python benchmarks/vllm_mismatch.py --model DIR --channels 2% --num-seqs 16

Results are also written to ``benchmarks/results/vllm_mismatch.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def stats(a, b) -> dict:
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
    from vllm import LLM

    return LLM(model=model, quantization=quantization, enforce_eager=True, max_model_len=512, dtype="bfloat16", seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="BF16 HF folder (default: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--channels", default="32", help="FourSight BF16 channels per layer: K or P%% (default 32)")
    ap.add_argument("--work-dir", default=None, help="where the checkpoints are cached (default ~/.cache/foursight/vllm_mismatch)")
    ap.add_argument("--num-seqs", type=int, default=12)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "vllm_mismatch.json"))
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from foursight.checkpoint import quantize_model
    from foursight.hf import load_reference_model
    from foursight.models import builtin_texts, cache_dir, prepare_smollm2
    from foursight.quant_methods.vllm_eval import engine_prompt_logprobs, hf_prompt_logprobs

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
        msgs = [{"role": "user", "content": t}]
        prompts.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]

    from vllm import TokensPrompt

    llm = engine(str(model))
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        [SamplingParams(max_tokens=args.gen_tokens, temperature=1.0, seed=i) for i in range(len(prompts))],
        use_tqdm=False,
    )
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    lp = {"bf16": engine_prompt_logprobs(llm, seqs)}
    del llm
    gc.collect()
    for tag in ("foursight", "nvfp4"):
        llm = engine(str(ck[tag]), "foursight")
        lp[tag] = engine_prompt_logprobs(llm, seqs)
        del llm
        gc.collect()
    ref = hf_prompt_logprobs(load_reference_model(ck["foursight"]), seqs)

    res = {
        "model": model.name,
        "channels": args.channels,
        "sequences": len(seqs),
        "tokens_per_seq_mean": sum(len(s) for s in seqs) / len(seqs),
        "vs_bf16_engine": {"foursight": stats(lp["foursight"], lp["bf16"]), "nvfp4": stats(lp["nvfp4"], lp["bf16"])},
        "foursight_engine_vs_reference": stats(lp["foursight"], ref),
        "seconds": round(time.time() - t0, 1),
    }
    print()
    print(f"model {model.name}, FourSight channels={args.channels}, {len(seqs)} sequences, {res['vs_bf16_engine']['nvfp4']['tokens']} teacher-forced tokens")
    print(f"{'engine vs vLLM BF16':<28}{'mean |Δ|':>10}{'p99 |Δ|':>10}{'max |Δ|':>10}{'>0.1':>8}")
    for tag in ("foursight", "nvfp4"):
        s = res["vs_bf16_engine"][tag]
        print(f"{'vLLM ' + tag:<28}{s['mean_abs']:>10.4f}{s['p99_abs']:>10.4f}{s['max_abs']:>10.4f}{s['frac_gt_0.1']:>8.3f}")
    s = res["foursight_engine_vs_reference"]
    print(f"{'FourSight engine vs PyTorch reference':<28}  mean {s['mean_abs']:.4f}  p99 {s['p99_abs']:.4f}  max {s['max_abs']:.4f}")
    ok = res["vs_bf16_engine"]["foursight"]["mean_abs"] < res["vs_bf16_engine"]["nvfp4"]["mean_abs"]
    print(f"FourSight between BF16 and NVFP4: {ok}   ({res['seconds']} s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
