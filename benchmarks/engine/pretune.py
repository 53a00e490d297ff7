"""Fill the SpliceGEMM autotuner's disk cache for a model's linear shapes before an engine starts on this card.

    python3 benchmarks/engine/pretune.py --budget-s 400                       # the engine benchmark's 8B shapes, k > 0 then k = 0
    python3 benchmarks/engine/pretune.py --config benchmarks/engine/smollm2-135m-config.json --budget-s 120   # SmolLM2's

A cold FourSight engine times its kernel candidates at each new (layer shape, M bucket) during vLLM's CUDA-graph
capture: on the H100 an 8B-shaped model spent about 90 s there on top of vLLM's compile, and the first device
session's FourSight row never reached its workloads (benchmarks/results/engine-h100-2026-12-07). The choices are
kept on disk per card, kernels source, Triton and torch (``foursight.kernels.tuning.DiskCache``), so the same
timing done here, outside the engine, is what the engine then reads instead of timing. Each shape runs the layer's
own call (``foursight.dispatch.prepare_linear`` and ``PreparedLinear.__call__``, as ``quant_methods.layer_state.apply_linear``
does) at one M per bucket of ``foursight.kernels.tuning.m_bucket``, so the keys are the engine's: (path, bucket,
N, K, channels > 0, W4A4, dynamic activation scale, bf16, no bias). Random weights: the choice depends on the shape,
not the values. Shapes (fused as vLLM fuses them): qkv, o, gate_up, down of the decoder config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the engine's cache folder (benchmarks/common.py turns the cache off for the kernel benchmarks; this script fills it)
os.environ.setdefault("FOURSIGHT_TUNE_CACHE", str(Path.home() / ".cache" / "foursight" / "autotune"))

#: one M per autotuner bucket, in the order vLLM meets them (profile run at max_num_batched_tokens, then the
#: CUDA-graph capture from the largest size down): the top bucket (4096) is first met at the profile run's M
M_VALUES = (8192, 2048, 1024, 512, 256, 128, 64, 32, 16, 4, 3, 2, 1)


def shapes(cfg: dict) -> list[tuple[str, int, int]]:
    """(name, N, K) of a Llama-style decoder's linears, fused as vLLM loads them."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
    return [("qkv_proj", q + 2 * kv, h), ("o_proj", h, q), ("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", help="a decoder config.json (repeatable; default: the engine benchmark's 8B)")
    ap.add_argument("--channels", default="128,0", help="BF16 channels per input to tune for, in order (the key only tells k > 0 from k = 0)")
    ap.add_argument("--m", default=",".join(map(str, M_VALUES)), help="rows per call, one per bucket")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting new shapes after this many seconds")
    ap.add_argument("--out", help="write a JSON summary here (every key tuned, its time, the cache file)")
    args = ap.parse_args(argv)

    import torch

    from foursight.dispatch import prepare_linear
    from foursight.kernels import tuning
    from foursight.layer import quantize_weight

    if not torch.cuda.is_available():
        print("pretune: no CUDA device; nothing to tune", file=sys.stderr)
        return 2
    t0 = time.time()
    configs = args.config or [str(HERE / "llama-3.1-8b-config.json")]
    ms = [int(v) for v in args.m.split(",")]
    done, skipped = [], []
    for k in [int(v) for v in args.channels.split(",")]:
        for cpath in configs:
            cfg = json.loads(Path(cpath).read_text())
            for name, n, kdim in shapes(cfg):
                if time.time() - t0 > args.budget_s:
                    skipped.append(f"{Path(cpath).name}:{name}:k={k}")
                    continue
                torch.manual_seed(0)
                w = torch.randn(n, kdim, device="cuda", dtype=torch.bfloat16) * 0.02
                ch = torch.randperm(kdim, device="cuda")[: min(k, kdim - 16)].sort().values.to(torch.int32)
                lin = prepare_linear(quantize_weight(w, ch, name=name), name)
                del w
                for m in ms:
                    t = time.time()
                    x = torch.randn(m, kdim, device="cuda", dtype=torch.bfloat16)
                    lin(x, None, None, True)
                    torch.cuda.synchronize()
                    done.append({"config": Path(cpath).name, "layer": name, "n": n, "k": kdim, "channels": k, "m": m,
                                 "s": round(time.time() - t, 2)})
                del lin
                torch.cuda.empty_cache()
                print(f"[pretune +{time.time() - t0:.0f}s] {Path(cpath).name} {name} N={n} K={kdim} k={k}: "
                      f"{sum(d['s'] for d in done if d['layer'] == name and d['channels'] == k and d['config'] == Path(cpath).name):.1f}s", flush=True)
    disk = tuning.DiskCache.for_this_device()
    summary = {"cache": str(disk.path) if disk else None, "keys_in_cache": len(disk.table) if disk else 0, "wall_s": round(time.time() - t0, 1),
               "calls": done, "skipped": skipped}
    print(f"pretune: {len(done)} calls in {summary['wall_s']}s; cache {summary['cache']} holds {summary['keys_in_cache']} keys; skipped {skipped}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
