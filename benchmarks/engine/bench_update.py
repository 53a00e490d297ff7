"""A trainer's weight update into vLLM on one GPU, 8B-shaped: FourSight against BF16, the same tensors, one process each.

    python benchmarks/engine/bench_update.py --out DIR                 # bf16 and fs128
    python benchmarks/engine/bench_update.py --rows fs128 --out DIR

The update is what a colocated trainer does after each step (TRL colocate, verl): every HF-named BF16 tensor of
the model, already on the GPU, through vLLM's own ``model.load_weights`` in the engine's process
(``llm.apply_model``), in two styles: TRL's (one call per tensor, no post-load step) and verl's (one call with every
tensor, then vLLM's ``process_weights_after_loading``). FourSight re-quantizes every linear layer it receives
(``quantization="foursight"`` online, ``FOURSIGHT_CHANNEL_BUDGET`` 128); BF16 copies. Both engines start on
vLLM's dummy weights (``benchmarks/engine/llama-3.1-8b-config.json``) with vLLM's defaults (compile, CUDA graphs),
``gpu_memory_utilization`` 0.45 so that the update's 16 GB of source tensors fit beside the engine.
FourSight re-quantizes a layer that ``load_weights`` wrote before that layer's next forward (TRL's road has no
post-load step), so every timed update ends with one forward: a 1-token generation of one 32-token prompt. The
same forward alone, without an update, is timed too and subtracted ("update s"). Each style: one warm-up, then
the minimum and the median of ``--reps`` timed updates (``torch.cuda.synchronize`` around each). Then the engine
generates 8 tokens, so an update that broke the graphs would show.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# an engine as users run it: the autotuner's choices kept on disk, so that a second start on this card skips the timing
os.environ.setdefault("FOURSIGHT_TUNE_CACHE", str(Path.home() / ".cache" / "foursight" / "autotune"))
sys.path.insert(0, str(HERE.parent))
from common import git_commit, kernels_sha256  # noqa: E402

ROWS = {"bf16": None, "fs128": "128", "fs0": "0"}


def hf_tensors(cfg: dict, device: str = "cuda") -> dict:
    """Random BF16 tensors under the HF names and shapes of a Llama config (a learner's state dict)."""
    import torch

    h, inter, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, q), p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    g = torch.Generator(device=device).manual_seed(7)
    return {n: (torch.randn(s, generator=g, device=device) * (0.02 if len(s) == 2 else 1.0)).to(torch.bfloat16) for n, s in shapes.items()}


def child(row: str, reps: int, json_out: str, work: str) -> None:
    import torch

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the trainer's load_weights reaches the model in this process
    if ROWS[row] is not None:
        os.environ["FOURSIGHT_CHANNEL_BUDGET"] = ROWS[row]
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    cfg = json.loads((HERE / "llama-3.1-8b-config.json").read_text())
    d = Path(work) / "model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    kw = dict(model=str(d), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=1024,
              gpu_memory_utilization=0.45, max_num_seqs=64)
    if ROWS[row] is not None:
        kw["quantization"] = "foursight"
    llm = LLM(**kw)
    new = hf_tensors(cfg)
    items = list(new.items())
    model_config = llm.llm_engine.vllm_config.model_config

    def trl(model):
        for n, t in items:
            model.load_weights([(n, t)])

    def verl(model):
        model.load_weights(iter(items))
        process_weights_after_loading(model, model_config, torch.device("cuda"))

    res = {"row": row, "tensors": len(items), "gib": sum(t.numel() * t.element_size() for t in new.values()) / 2**30}
    one = [TokensPrompt(prompt_token_ids=list(range(200, 232)))]
    sp1 = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def forward() -> None:
        llm.reset_prefix_cache()
        llm.generate(one, sp1, use_tqdm=False)

    def timed(fn) -> list[float]:
        times = []
        for i in range(reps + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            if fn is not None:
                llm.apply_model(fn)
            forward()
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t)
        return times

    base = min(timed(None))
    res["forward_alone_s"] = base
    for style, fn in (("trl_per_tensor", trl), ("verl_all_then_post_load", verl)):
        times = [x - base for x in timed(fn)]
        res[style] = {"min_s": min(times), "median_s": statistics.median(times), "all_s": times}
        print(f"[{row}] {style}: {res[style]}", flush=True)
    llm.reset_prefix_cache()
    out = llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 132)))], SamplingParams(max_tokens=8, temperature=0.0, detokenize=False),
                       use_tqdm=False)
    res["generated_after"] = len(out[0].outputs[0].token_ids)
    Path(json_out).write_text(json.dumps(res, indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="bf16,fs128")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="out/engine-update")
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args.reps, args.json, args.work)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    results = []
    for row in args.rows.split(","):
        with tempfile.TemporaryDirectory() as work:
            js, log = Path(work) / "r.json", out / f"update_{row}.log"
            with open(log, "w") as f:
                try:
                    rc = subprocess.run([sys.executable, __file__, "--child", row, "--reps", str(args.reps), "--json", str(js), "--work", work],
                                        stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout_s).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            results.append(json.loads(js.read_text()) if js.exists() else {"row": row, "error": f"exit {rc}: "
                           + " ".join(log.read_text(errors="replace").strip().splitlines()[-3:])})
            print(json.dumps(results[-1])[:600], flush=True)
    head = f"card {card}, commit {git_commit()}, kernels sha256 {kernels_sha256()[:16]}; Llama-3.1-8B-shaped, vLLM compile + CUDA graphs"
    lines = [head, "", "| row | TRL per tensor min / median s | verl all + post-load min / median s | vs BF16 (TRL, min) | vs BF16 (verl, min) |",
             "|---|---:|---:|---:|---:|"]
    base = next((r for r in results if r["row"] == "bf16" and "error" not in r), None)
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | failed: {r['error'][:150]} | | | |")
            continue
        t, v = r["trl_per_tensor"], r["verl_all_then_post_load"]
        rt = f"{t['min_s'] / base['trl_per_tensor']['min_s']:.2f}x" if base else "—"
        rv = f"{v['min_s'] / base['verl_all_then_post_load']['min_s']:.2f}x" if base else "—"
        lines.append(f"| {r['row']} | {t['min_s']:.3f} / {t['median_s']:.3f} | {v['min_s']:.3f} / {v['median_s']:.3f} | {rt} | {rv} |")
    (out / "update.json").write_text(json.dumps({"header": head, "rows": results}, indent=1))
    (out / "update.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
