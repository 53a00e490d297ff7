"""Training-inference mismatch inside one engine (vLLM or SGLang): BF16 vs FourSight vs plain NVFP4, same tokens.

1. Builds (or reuses) two checkpoints of the model with ``foursight.checkpoint.quantize_model``:
   FourSight with ``--channels`` BF16 channels, and plain NVFP4 (``channels=0``), cached in
   ``~/.cache/foursight/vllm_mismatch`` for both engines (the very same checkpoints).
2. Makes fixed sequences: chat-formatted prompts from ``foursight.calibration.builtin_texts()`` plus a
   sampled continuation (temperature 1, per-request seed) from the engine's BF16 model.
3. Teacher-forces the three in-process engines (one after the other) on exactly those tokens and
   prints mean / p99 / max |Δ logprob| of FourSight and NVFP4 against the BF16 engine, plus the
   FourSight engine against the PyTorch reference model of its checkpoint
   (``foursight.hf.load_reference_model``, scored by ``foursight.trainer_bridge.scoring.sequence_logprobs``)
   and, for SGLang, that reference's own BF16 noise floor (eager instead of SDPA attention).
   SGLang runs its LM head in float32 (``enable_fp32_lm_head``), and so does its reference.

Run (CPU; vLLM about 3-4 minutes, SGLang about 5, for SmolLM2 on 2 cores)::

    .venv/bin/python benchmarks/fidelity/engine_mismatch.py --engine vllm             # writes benchmarks/results/vllm_mismatch.json
    .venv-sglang/bin/python benchmarks/fidelity/engine_mismatch.py --engine sglang    # writes benchmarks/results/sglang_mismatch.json
    python benchmarks/fidelity/engine_mismatch.py --side-by-side                      # the docs/sglang.md table from both files

``foursight compare`` compares engines on sampled rollouts against the learner; this script
measures each engine's quantized variants against its own BF16 model.
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
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).parent / "results"

SGLANG_KW = dict(device="cpu", attention_backend="torch_native", log_level="error", mem_fraction_static=0.5,
                 max_total_tokens=4096, disable_cuda_graph=True, random_seed=0, enable_fp32_lm_head=True)


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


class VLLMEngine:
    label = "vLLM"
    fp32_head = False

    def __init__(self, model: str, quantization: str | None = None):
        from vllm import LLM

        self.llm = LLM(model=model, quantization=quantization, enforce_eager=True, max_model_len=512, dtype="bfloat16", seed=0)

    def sample(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams, TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                 [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i) for i in range(len(prompts))],
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def teacher_forced(self, seqs):
        """``log p(seq[t] | seq[:t])``, t >= 1, from vLLM's ``prompt_logprobs`` (as SGLang's below from its own field)."""
        import torch
        from vllm import SamplingParams, TokensPrompt

        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in seqs], sp, use_tqdm=False)
        return [torch.tensor([o.prompt_logprobs[t][s[t]].logprob for t in range(1, len(s))], dtype=torch.float64)
                for s, o in zip(seqs, outs)]

    def close(self) -> None:
        del self.llm
        gc.collect()


class SGLangEngine:
    label = "SGLang"
    fp32_head = True

    def __init__(self, model: str, quantization: str | None = None):
        import sglang as sgl

        self.eng = sgl.Engine(model_path=model, quantization=quantization, **SGLANG_KW)

    def sample(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = self.eng.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": max_tokens, "temperature": 1.0, "sampling_seed": i}
                                                                     for i in range(len(prompts))])
        return [list(o["output_ids"]) for o in outs]

    def teacher_forced(self, seqs):
        import torch

        outs = self.eng.generate(input_ids=[list(s) for s in seqs], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                                 return_logprob=True, logprob_start_len=0)
        res = []
        for s, o in zip(seqs, outs):
            lp = o["meta_info"]["input_token_logprobs"]
            assert len(lp) == len(s) and lp[0][0] is None, (len(lp), len(s), lp[:2])
            assert [int(x[1]) for x in lp] == list(s)
            res.append(torch.tensor([float(x[0]) for x in lp[1:]], dtype=torch.float64))
        return res

    def close(self) -> None:
        self.eng.shutdown()
        del self.eng
        gc.collect()


ENGINES = {"vllm": VLLMEngine, "sglang": SGLangEngine}

ROWS = (
    ("FourSight vs BF16 engine", lambda r: r["vs_bf16_engine"]["foursight"]),
    ("plain NVFP4 vs BF16 engine", lambda r: r["vs_bf16_engine"]["nvfp4"]),
    ("FourSight engine vs PyTorch reference", lambda r: r["foursight_engine_vs_reference"]),
    ("reference SDPA vs eager (noise floor)", lambda r: r.get("reference_sdpa_vs_eager")),
)


def side_by_side(results_dir: Path) -> str:
    """Markdown table of results/{vllm,sglang}_mismatch.json, one column group per engine."""
    res = {e: json.loads((results_dir / f"{e}_mismatch.json").read_text()) for e in ENGINES if (results_dir / f"{e}_mismatch.json").exists()}
    if not res:
        raise SystemExit(f"no results in {results_dir}; run benchmarks/fidelity/engine_mismatch.py --engine vllm / sglang first")
    head = "| teacher-forced \\|Δ logprob\\| | " + " | ".join(f"{e} mean | {e} p99 | {e} max | {e} >0.1" for e in res) + " |"
    sep = "| --- |" + " --- | --- | --- | --- |" * len(res)
    rows = []
    for label, get in ROWS:
        cells = []
        for r in res.values():
            st = get(r)
            cells.append(" | ".join(f"{st[k]:.4f}" if k != "frac_gt_0.1" else f"{st[k]:.3f}" for k in ("mean_abs", "p99_abs", "max_abs", "frac_gt_0.1")) if st else "- | - | - | -")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    meta = "; ".join(f"{e}: {r['model']}, k={r['channels']}, {r['sequences']} sequences, {r['vs_bf16_engine']['nvfp4']['tokens']} tokens" for e, r in res.items())
    return "\n".join([head, sep, *rows, "", meta])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=sorted(ENGINES), default="vllm")
    ap.add_argument("--side-by-side", action="store_true", help="only print the vLLM/SGLang markdown table from the results files")
    ap.add_argument("--model", default=None, help="BF16 HF folder (default: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--channels", default="32", help="FourSight BF16 channels per layer: K or P%% (default 32)")
    ap.add_argument("--work-dir", default=None, help="where the checkpoints are cached (default ~/.cache/foursight/vllm_mismatch)")
    ap.add_argument("--num-seqs", type=int, default=12)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/<engine>_mismatch.json)")
    args = ap.parse_args()
    if args.side_by_side:
        print(side_by_side(Path(args.out).parent if args.out else RESULTS))
        return

    from transformers import AutoTokenizer

    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig
    from foursight.hf import load_reference_model
    from foursight.calibration import builtin_texts
    from foursight.cache import cache_dir
    from foursight.models import prepare_smollm2
    from foursight.trainer_bridge.scoring import sequence_logprobs

    Engine = ENGINES[args.engine]
    out = Path(args.out) if args.out else RESULTS / f"{args.engine}_mismatch.json"
    t0 = time.time()
    model = Path(args.model) if args.model else prepare_smollm2()
    work = Path(args.work_dir) if args.work_dir else cache_dir() / "vllm_mismatch"
    ck = {}
    for tag, ch in (("foursight", args.channels), ("nvfp4", "0")):
        d = work / f"{model.name}-{tag}-{str(ch).replace('%', 'pct')}"
        if not (d / "config.json").exists():
            print(f"quantizing {model.name} with channels={ch} -> {d}", flush=True)
            quantize_model(model, d, QuantizeConfig(channels=ch, force=True), progress=False)
        ck[tag] = d

    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for t in builtin_texts()[: args.num_seqs]:
        p = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p))

    eng = Engine(str(model))
    seqs = [p + c for p, c in zip(prompts, eng.sample(prompts, args.gen_tokens))]
    lp = {"bf16": eng.teacher_forced(seqs)}
    eng.close()
    for tag in ("foursight", "nvfp4"):
        eng = Engine(str(ck[tag]), "foursight")
        lp[tag] = eng.teacher_forced(seqs)
        eng.close()
    ref_model = load_reference_model(ck["foursight"])
    ref = sequence_logprobs(ref_model, seqs, fp32_head=Engine.fp32_head)

    res = {
        "engine": args.engine,
        "model": model.name,
        "channels": args.channels,
        "sequences": len(seqs),
        "tokens_per_seq_mean": sum(len(s) for s in seqs) / len(seqs),
        "vs_bf16_engine": {"foursight": stats(lp["foursight"], lp["bf16"]), "nvfp4": stats(lp["nvfp4"], lp["bf16"])},
        "foursight_engine_vs_reference": stats(lp["foursight"], ref),
    }
    if args.engine == "sglang":
        ref_model.set_attn_implementation("eager")
        res["reference_sdpa_vs_eager"] = stats(ref, sequence_logprobs(ref_model, seqs, fp32_head=True))
    res["seconds"] = round(time.time() - t0, 1)
    print()
    print(f"model {model.name}, FourSight channels={args.channels}, {len(seqs)} sequences, {res['vs_bf16_engine']['nvfp4']['tokens']} teacher-forced tokens")
    print(f"{'engine vs ' + Engine.label + ' BF16':<28}{'mean |Δ|':>10}{'p99 |Δ|':>10}{'max |Δ|':>10}{'>0.1':>8}")
    for tag in ("foursight", "nvfp4"):
        s = res["vs_bf16_engine"][tag]
        print(f"{Engine.label + ' ' + tag:<28}{s['mean_abs']:>10.4f}{s['p99_abs']:>10.4f}{s['max_abs']:>10.4f}{s['frac_gt_0.1']:>8.3f}")
    for label, get in ROWS[2:]:
        s = get(res)
        if s:
            print(f"{label:<28}  mean {s['mean_abs']:.4f}  p99 {s['p99_abs']:.4f}  max {s['max_abs']:.4f}")
    ok = res["vs_bf16_engine"]["foursight"]["mean_abs"] < res["vs_bf16_engine"]["nvfp4"]["mean_abs"]
    print(f"FourSight between BF16 and NVFP4: {ok}   ({res['seconds']} s)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
