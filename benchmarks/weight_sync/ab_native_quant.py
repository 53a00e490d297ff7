"""The native CPU quantizer against the eager one, interleaved in the same engine (same process, same minute).

On a shared CPU machine a FourSight sync's time follows the other jobs' load more than the code
(docs/weight-sync.md, "Cost"), so two passes of ``bench_weight_sync.py`` taken minutes apart compare loads as
much as code. This script builds one FourSight engine per mode (checkpoint, online; SmolLM2-135M, as the
benchmark does) and alternates ``apply_weight_update`` of the same perturbed weights with the native quantizer
on and off (``FOURSIGHT_NATIVE_CPU_QUANT``) ``--repeats`` times after a warm-up of each; every run's wall and
CPU time and the load it started in are kept, with the median and minimum per arm:

    flock /tmp/fs-engine.lock python benchmarks/weight_sync/ab_native_quant.py --out benchmarks/results/weight_sync_ab_native.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_weight_sync import _git_commit, run_summary  # noqa: E402  (sets the in-process engine's environment)
from common import cpu_model  # noqa: E402


def measure(model_path: str, weights: list, repeats: int) -> dict:
    from vllm import LLM

    llm = LLM(model=model_path, quantization="foursight", enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0)

    def run(model):
        import torch

        from foursight import nvfp4_cpu
        from foursight.quant_methods.vllm_weight_update import apply_weight_update

        runs: dict[str, list] = {"native": [], "eager": []}
        for i in range(repeats + 1):
            for arm in runs:
                os.environ[nvfp4_cpu.ENV_NATIVE_CPU_QUANT] = "1" if arm == "native" else "0"
                load = os.getloadavg()[0]
                w0, c0 = time.perf_counter(), time.process_time()
                with torch.no_grad():
                    apply_weight_update(model, weights)
                if i:  # the first round is the warm-up (the native library is built or loaded there)
                    runs[arm].append({"wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0, "loadavg_1m_before": load})
        os.environ.pop(nvfp4_cpu.ENV_NATIVE_CPU_QUANT)
        return {arm: run_summary(r) for arm, r in runs.items()}

    try:
        (out,) = llm.apply_model(run)
    finally:
        del llm
        import gc

        gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/weight_sync_ab_native.json")
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    from foursight.cache import cache_dir
    from foursight.models import prepare_smollm2

    model = prepare_smollm2()
    ckpt = cache_dir() / "bench" / "smollm2-fs32"
    if not (ckpt / "config.json").exists():
        from foursight.checkpoint import quantize_model

        quantize_model(model, ckpt, channels="32", force=True, progress=False)
    g = torch.Generator().manual_seed(0)
    weights = []
    for n, t in load_file(str(model / "model.safetensors")).items():  # the same learner step as bench_weight_sync.py
        f = t.float()
        weights.append((n, (f + 0.01 * f.std() * torch.randn(t.shape, generator=g)).to(t.dtype).contiguous()))
    commit, dirty = _git_commit()
    load_start = list(os.getloadavg())
    results = {"foursight_checkpoint": measure(str(ckpt), weights, args.repeats)}
    os.environ["FOURSIGHT_CHANNELS_FILE"] = str(ckpt / "foursight_channels.json")
    results["foursight_online"] = measure(str(model), weights, args.repeats)
    for eng, r in results.items():
        r["native_vs_eager"] = {k: r["native"][k] / r["eager"][k] for k in ("median_wall_s", "min_wall_s", "median_cpu_s", "min_cpu_s")}
        print(eng, json.dumps(r["native_vs_eager"]))
    doc = {"what": "apply_weight_update of every SmolLM2-135M tensor into an in-process vLLM CPU engine, native CPU quantizer on and "
                   "off alternately in the same engine, after one warm-up round",
           "commit": commit, "uncommitted_paths": dirty, "repeats": args.repeats,
           "host": {"platform": platform.platform(), "cpu": cpu_model(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()), "python": sys.version.split()[0],
                    "note": "a CPU machine shared with other jobs: loadavg says how loaded it was"},
           "versions": {"torch": torch.__version__, "vllm": __import__("vllm").__version__},
           "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
