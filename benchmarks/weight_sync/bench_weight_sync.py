"""Weight-sync time of a FourSight vLLM engine against a BF16 one, same model, in process.

What a colocated trainer pays per RL step to push its BF16 weights into the rollout engine:
every tensor of the model (HF names), in memory, through

* ``apply_weight_update(model, named_tensors)`` (:mod:`foursight.quant_methods.vllm_weight_sync`,
  the documented colocated path; the BF16 engine needs it too on vLLM's CPU build, whose
  pre-packed linear weights a plain ``load_weights`` cannot write), and
* TRL colocate's own loop, ``model.load_weights([(name, tensor)])`` once per tensor with no
  post-load step (FourSight engines only: see above).

Each engine is built in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``enforce_eager``),
one at a time; each sync is timed inside the worker (``llm.apply_model``) after one warm-up,
as wall time and as this process's CPU time (less sensitive to other load on a shared machine;
both are written). A rollout of a fixed small batch is timed too, to give the share of a step.

    python benchmarks/weight_sync/bench_weight_sync.py --out benchmarks/results/weight_sync_cpu.json

Defaults: the packaged SmolLM2-135M-Instruct, FourSight checkpoint with 32 channels made by
``foursight quantize`` (cached), online mode with that checkpoint's channels file. CPU figures
only: the GPU sync is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "quant_methods", "foursight_engine", "benchmarks/weight_sync/bench_weight_sync.py"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def _timed_in_worker(llm, fn) -> dict:
    def run(model):
        import torch

        w0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            fn(model)
        return {"wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0}

    (out,) = llm.apply_model(run)
    return out


def measure(model_path: str, quantization: str | None, weights: list, routes: list[str], repeats: int, prompts: list) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    from foursight.quant_methods.vllm_weight_sync import apply_weight_update

    llm = LLM(model=model_path, quantization=quantization, enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0)
    out: dict = {}
    try:
        def per_tensor(model):
            for name, t in weights:
                model.load_weights([(name, t)])

        fns = {"apply_weight_update": lambda m: apply_weight_update(m, weights), "trl_per_tensor_load_weights": per_tensor}
        for route in routes:
            _timed_in_worker(llm, fns[route])  # warm-up
            runs = [_timed_in_worker(llm, fns[route]) for _ in range(repeats)]
            out[route] = {"runs": runs, "best_wall_s": min(r["wall_s"] for r in runs), "best_cpu_s": min(r["cpu_s"] for r in runs)}
        sp = SamplingParams(max_tokens=32, temperature=1.0, seed=0, ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        llm.generate(batch, sp, use_tqdm=False)  # warm-up
        w0, c0 = time.perf_counter(), time.process_time()
        llm.generate(batch, sp, use_tqdm=False)
        out["rollout"] = {"prompts": len(prompts), "max_tokens": 32, "wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0}
    finally:
        del llm
        import gc

        gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="BF16 HF folder (default: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--ckpt", default=None, help="FourSight checkpoint of that model (default: quantize with --channels 32, cached)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/weight_sync_cpu.json")
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from foursight.models import builtin_texts, cache_dir, prepare_smollm2

    model = Path(args.model) if args.model else prepare_smollm2()
    ckpt = Path(args.ckpt) if args.ckpt else cache_dir() / "bench" / "smollm2-fs32"
    if not (ckpt / "config.json").exists():
        from foursight.checkpoint import quantize_model

        quantize_model(model, ckpt, channels="32", force=True, progress=False)
    g = torch.Generator().manual_seed(0)
    weights = []
    for n, t in load_file(str(model / "model.safetensors")).items():  # a learner step: every tensor moved
        f = t.float()
        weights.append((n, (f + 0.01 * f.std() * torch.randn(t.shape, generator=g)).to(t.dtype).contiguous()))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok(t)["input_ids"][:48] for t in builtin_texts()[:8]]

    commit = _git_commit()  # the code measured: read before the run, not after
    results = {"bf16": measure(str(model), None, weights, ["apply_weight_update"], args.repeats, prompts)}
    results["foursight_checkpoint"] = measure(str(ckpt), "foursight", weights, ["apply_weight_update", "trl_per_tensor_load_weights"], args.repeats, prompts)
    os.environ["FOURSIGHT_CHANNELS_FILE"] = str(ckpt / "foursight_channels.json")
    results["foursight_online"] = measure(str(model), "foursight", weights, ["apply_weight_update", "trl_per_tensor_load_weights"], args.repeats, prompts)

    base = results["bf16"]["apply_weight_update"]
    ratios = {}
    for eng in ("foursight_checkpoint", "foursight_online"):
        for route, r in results[eng].items():
            if route == "rollout":
                continue
            ratios[f"{eng}/{route}"] = {"wall_vs_bf16": r["best_wall_s"] / base["best_wall_s"], "cpu_vs_bf16": r["best_cpu_s"] / base["best_cpu_s"],
                                        "share_of_sync_plus_rollout": r["best_wall_s"] / (r["best_wall_s"] + results[eng]["rollout"]["wall_s"])}
    doc = {
        "what": "full in-memory weight sync (every tensor, HF names) into an in-process vLLM CPU engine; best of repeats after a warm-up",
        "commit": commit,
        "model": str(model.name), "tensors": len(weights), "params": sum(t.numel() for _, t in weights),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                 "loadavg_at_end": list(os.getloadavg()), "python": sys.version.split()[0]},
        "versions": {"torch": torch.__version__, "vllm": __import__("vllm").__version__},
        "results": results, "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
