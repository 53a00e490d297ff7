"""Weight-sync time of a FourSight vLLM engine against a BF16 one, same model, in process, on the CPU.

What a colocated trainer pays per RL step to push its BF16 weights into the rollout engine: every
tensor of the model (HF names), in memory, through the trainers' own loops:

* ``trl``: TRL colocate, ``model.load_weights([(name, tensor)])`` once per tensor, no post-load step;
* ``verl``: verl, ``model.load_weights(bucket)`` per bucket (``--buckets``, cutting through fused
  layers), then vLLM's ``process_weights_after_loading`` once;
* ``apply_weight_update``: the documented in-memory route (:mod:`foursight.quant_methods.vllm_weight_update`);
* ``file``: the ``/collective_rpc`` route, ``FourSightWorkerExtension.foursight_update_weights`` of a safetensors
  file holding the same tensors (written once before the runs, so it is in the page cache): the file read, the
  checks and the load, as an engine's worker runs them for the bridge.

The BF16 engine is measured the way it really syncs on vLLM's CPU build. Its linear layers'
weights are pre-packed for oneDNN after loading (the parameter is emptied), so a plain
``load_weights`` cannot write them; vLLM's own weight-transfer engines wrap the load in its
layerwise reload (``initialize_layerwise_reload`` ... ``finalize_layerwise_reload``, which re-packs),
and that is what the ``trl`` and ``verl`` rows of the BF16 engine do. The row
``load_weights_only`` is the plain per-tensor copy without the reload (what a GPU engine does); on
vLLM's CPU build it fails at the first emptied linear weight, and the file records that error.

Every FourSight sync ends with every layer re-quantized (the TRL loop re-quantizes a layer when its
last shard arrives; the verl loop in the post-load step): the time includes the quantization.

Each engine is built in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``enforce_eager``), one
at a time; each sync is timed inside the worker (``llm.apply_model``) after one warm-up, ``--repeats``
times; the file keeps every run (wall and CPU time, the user/system split, page faults, the 1-minute
load average it started in), the median and the minimum, as wall time and as this process's CPU time. Run it
alone, holding the engine lock, and read ``host.loadavg_*`` (other jobs on a shared machine inflate
wall time):

    flock /tmp/fs-engine.lock python benchmarks/weight_sync/bench_weight_sync.py --out benchmarks/results/weight_sync_cpu.json

Defaults: the packaged SmolLM2-135M-Instruct, FourSight checkpoint with 32 channels made by
``foursight quantize`` (cached), online mode with that checkpoint's channels file. CPU figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import cpu_model  # noqa: E402  (benchmarks/common.py)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def run_summary(runs: list[dict]) -> dict:
    """The timed repeats of one arm (each with ``wall_s`` and ``cpu_s``) with their medians and minima."""
    return {"runs": runs, "median_wall_s": statistics.median(r["wall_s"] for r in runs), "min_wall_s": min(r["wall_s"] for r in runs),
            "median_cpu_s": statistics.median(r["cpu_s"] for r in runs), "min_cpu_s": min(r["cpu_s"] for r in runs)}


def _git_commit() -> tuple[str, list[str]]:
    """HEAD (with ``-dirty`` when the measured folders differ from it) and the differing paths."""
    try:
        root = Path(__file__).resolve().parents[2]
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "quant_methods", "foursight_engine", "benchmarks/weight_sync"],
                               cwd=root, capture_output=True, text=True).stdout.split("\n")
        dirty = [d.strip() for d in dirty if d.strip()]
        return sha + ("-dirty" if dirty else ""), dirty
    except Exception:
        return "unknown", []


def _timed_in_worker(llm, fn) -> dict:
    def run(model):
        import resource

        import torch

        load = os.getloadavg()[0]
        r0, w0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.process_time()
        with torch.no_grad():
            fn(model)
        w1, c1, r1 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        # user/sys split, page faults (fresh memory the sync touched) and the load the run started in
        return {"wall_s": w1 - w0, "cpu_s": c1 - c0, "user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime,
                "minor_faults": r1.ru_minflt - r0.ru_minflt, "major_faults": r1.ru_majflt - r0.ru_majflt, "loadavg_1m_before": load}

    (out,) = llm.apply_model(run)
    return out


def _profile_in_worker(llm, fn, top: int = 12) -> dict:
    """One more sync under ``torch.profiler``: the number of tensor operations it ran and the
    operations that took the most CPU time (where a sync's time goes)."""
    def run(model):
        import torch
        from torch.profiler import ProfilerActivity, profile

        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(model)
        ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ev)
        return {"aten_calls": sum(e.count for e in ev if e.key.startswith("aten::")),
                "self_cpu_s_total": total / 1e6,
                "top": [{"op": e.key, "calls": e.count, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 4)} for e in ev[:top]]}

    (out,) = llm.apply_model(run)
    return out


def _file_route(path: str):
    """fn(model): the worker extension's file update of ``path`` (the ``/collective_rpc`` route) on ``model``."""
    def fn(model):
        from foursight.quant_methods.vllm_weight_sync import FourSightWorkerExtension

        class Worker(FourSightWorkerExtension):  # the worker's model is the one apply_model hands over
            def _foursight_model(self):
                return model

        Worker().foursight_update_weights(path, 1)

    return fn


def _routes(llm, weights: list, buckets: int, bf16: bool, file: str) -> dict:
    """route name -> fn(model), the trainers' loops and the file route (module docstring)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from foursight.quant_methods.vllm_weight_update import apply_weight_update

    model_config = llm.llm_engine.vllm_config.model_config
    step = -(-len(weights) // buckets)

    def trl(model):
        for item in weights:
            model.load_weights([item])

    def verl(model):
        import torch

        for i in range(0, len(weights), step):
            model.load_weights(iter(weights[i : i + step]))
        process_weights_after_loading(model, model_config, torch.device("cpu"))

    if not bf16:
        return {"trl": trl, "verl": verl, "apply_weight_update": lambda m: apply_weight_update(m, weights), "file": _file_route(file)}
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    def reloading(loop):
        def fn(model):
            initialize_layerwise_reload(model)
            for i in range(0, len(weights), loop):
                model.load_weights(iter(weights[i : i + loop]))
            finalize_layerwise_reload(model, model_config)

        return fn

    return {"trl": reloading(1), "verl": reloading(step), "load_weights_only": trl,
            "apply_weight_update": lambda m: apply_weight_update(m, weights), "file": _file_route(file)}


def measure(model_path: str, quantization: str | None, weights: list, repeats: int, buckets: int, file: str,
            routes: list[str] | None = None) -> dict:
    from vllm import LLM

    llm = LLM(model=model_path, quantization=quantization, enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0)
    out: dict = {}
    try:
        for route, fn in _routes(llm, weights, buckets, bf16=quantization is None, file=file).items():
            if routes and route not in routes:
                continue
            try:
                _timed_in_worker(llm, fn)  # warm-up
            except Exception as e:  # noqa: BLE001 - a road this engine build cannot take: recorded, not timed
                out[route] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"{model_path} {quantization} {route}: {out[route]['error']}", flush=True)
                continue
            runs = [_timed_in_worker(llm, fn) for _ in range(repeats)]
            if route == "trl" or (routes and "trl" not in routes and route == routes[0]):  # one profiled road per engine
                out[f"profile_{route}"] = _profile_in_worker(llm, fn)
            out[route] = {**run_summary(runs), "loadavg_after": list(os.getloadavg())}
            print(f"{model_path} {quantization} {route}: median {out[route]['median_wall_s']:.3f} s wall, "
                  f"min {out[route]['min_wall_s']:.3f} s", flush=True)
    finally:
        del llm
        import gc

        gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="BF16 HF folder (default: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--ckpt", default=None, help="FourSight checkpoint of that model (default: quantize with --channels 32, cached)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--buckets", type=int, default=4, help="verl's buckets per sync")
    ap.add_argument("--routes", default="", help="comma-separated roads to time (default: all; e.g. apply_weight_update,file "
                                                  "on a loaded machine, where a full pass takes long)")
    ap.add_argument("--out", default="benchmarks/results/weight_sync_cpu.json")
    args = ap.parse_args()
    routes = [r for r in args.routes.split(",") if r]

    import torch
    from safetensors.torch import load_file

    from foursight.cache import cache_dir
    from foursight.models import prepare_smollm2

    model = Path(args.model) if args.model else prepare_smollm2()
    ckpt = Path(args.ckpt) if args.ckpt else cache_dir() / "bench" / "smollm2-fs32"
    if not (ckpt / "config.json").exists():
        from foursight.checkpoint import quantize_model
        from foursight.quantize_config import QuantizeConfig

        quantize_model(model, ckpt, QuantizeConfig(channels="32", force=True), progress=False)
    g = torch.Generator().manual_seed(0)
    weights = []
    for n, t in load_file(str(model / "model.safetensors")).items():  # a learner step: every tensor moved
        f = t.float()
        weights.append((n, (f + 0.01 * f.std() * torch.randn(t.shape, generator=g)).to(t.dtype).contiguous()))

    import tempfile

    from safetensors.torch import save_file

    commit, dirty = _git_commit()  # the code measured: read before the run, not after
    load_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="fs-bench-sync-") as tmp:
        file = str(Path(tmp) / "update.safetensors")  # the file route's update: the same tensors
        save_file(dict(weights), file)
        results = {"bf16": measure(str(model), None, weights, args.repeats, args.buckets, file, routes)}
        results["foursight_checkpoint"] = measure(str(ckpt), "foursight", weights, args.repeats, args.buckets, file, routes)
        os.environ["FOURSIGHT_CHANNELS_FILE"] = str(ckpt / "foursight_channels.json")
        results["foursight_online"] = measure(str(model), "foursight", weights, args.repeats, args.buckets, file, routes)

    ratios = {}
    for eng in ("foursight_checkpoint", "foursight_online"):
        for route, r in results[eng].items():
            base = results["bf16"].get(route, {})
            if "median_wall_s" in r and "median_wall_s" in base:
                ratios[f"{eng}/{route}"] = {"wall_vs_bf16": r["median_wall_s"] / base["median_wall_s"],
                                            "cpu_vs_bf16": r["median_cpu_s"] / base["median_cpu_s"],
                                            "min_wall_vs_bf16": r["min_wall_s"] / base["min_wall_s"],
                                            "min_cpu_vs_bf16": r["min_cpu_s"] / base["min_cpu_s"]}
    doc = {
        "what": "full in-memory weight sync (every tensor, HF names) into an in-process vLLM CPU engine, through TRL's per-tensor "
                "loop, verl's bucketed loop, apply_weight_update and the worker's file route; median and min of repeats after a warm-up; FourSight rows include "
                "the re-quantization of every layer; the BF16 trl/verl rows run inside vLLM's layerwise reload (module docstring)",
        "commit": commit, "uncommitted_paths": dirty,
        "model": str(model.name), "tensors": len(weights), "params": sum(t.numel() for _, t in weights),
        "repeats": args.repeats, "buckets": args.buckets, "routes": routes or "all",
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FOURSIGHT_") and k != "FOURSIGHT_CHANNELS_FILE"},
        "host": {"platform": platform.platform(), "cpu": cpu_model(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                 "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()), "python": sys.version.split()[0],
                 "note": "a CPU machine shared with other jobs: loadavg says how loaded it was"},
        "versions": {"torch": torch.__version__, "vllm": __import__("vllm").__version__},
        "results": results, "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
