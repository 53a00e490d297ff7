#!/usr/bin/env python
"""Locate the W4A16 prefill race: run variants of the swap-AB prefill configuration many times on one
input and count the calls whose output differs from the first (GPU only).

Variants change one thing at a time against ``("swap", 128, 128, 64, 8, 3, 0)`` on 8192 x 8192:
the pipelining depth (num_stages 1/2/3), the warps, k = 0 versus k = 128 BF16 channels, the
operand dtype (bf16 versus fp16 activations: W4A16 decodes the weight to the activation's dtype),
and W4A4 (fp16 operands). The TTGIR and PTX of the reported configuration are written to --out.

Usage: python benchmarks/kernels/race_probe.py --out DIR [--reps 60]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import foursight.kernels.api as fk
from foursight.kernels.configs import SwapConfig
from foursight.kernels.swap import swap_launch
from foursight.layer import quantize_weight


def unchecked_swap(*fields) -> SwapConfig:
    """A SwapConfig built without its validation: the two-warpgroup variants that SwapConfig now
    refuses, to show the race they have (this script is the evidence for that refusal)."""
    cfg = object.__new__(SwapConfig)
    for name, v in zip(("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k"), fields):
        object.__setattr__(cfg, name, v)
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/race")
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(7)
    N = K = 8192
    w = torch.randn(N, K, generator=g, device="cuda") * 0.02
    x_all = torch.randn(4096, K, generator=g, device="cuda")
    rows = []
    layers = {}
    for k in (0, 128):
        ch = torch.sort(torch.randperm(K, generator=g, device="cuda")[:k]).values.to(torch.int32)
        layers[k] = fk.prepare_weight(quantize_weight(w, ch))
    variants = [unchecked_swap(128, 128, 64, 8, s, 0) for s in (3, 2, 1)] + [unchecked_swap(128, 128, 64, 4, 3, 0), unchecked_swap(64, 128, 64, 8, 3, 0)]
    for cfg in variants:
        for k in (128, 0):
            for mode in ("w4a16-bf16", "w4a16-fp16", "w4a4"):
                if cfg != variants[0] and (k == 0 or mode != "w4a16-bf16"):
                    continue
                for M in (1024, 4096):
                    dt = torch.float16 if mode == "w4a16-fp16" else torch.bfloat16
                    x = x_all[:M].to(dt).contiguous()
                    aq = mode == "w4a4"
                    pw = layers[k]
                    first = fk.splice_linear(x, pw, act_quant=aq, path="prefill", config=cfg)
                    torch.cuda.synchronize()
                    bad, worst = 0, 0.0
                    for _ in range(args.reps - 1):
                        y = fk.splice_linear(x, pw, act_quant=aq, path="prefill", config=cfg)
                        if not torch.equal(y, first):
                            bad += 1
                            worst = max(worst, float((y.float() - first.float()).abs().nan_to_num(3.4e38).max()))
                    row = {"config": str(cfg), "k": k, "mode": mode, "M": M, "reps": args.reps, "differing_calls": bad,
                           "first_finite": bool(torch.isfinite(first).all()), "max_abs_diff": worst}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    # the compiled artefacts of the reported configuration (W4A16 bf16, k = 128)
    xq = x_all[:1024].bfloat16().contiguous()
    o = torch.empty(1024, N, dtype=torch.bfloat16, device="cuda")
    compiled = swap_launch(variants[0], xq, None, xq, layers[128], None, o, False, True)
    for name in ("ttgir", "ptx"):
        if name in compiled.asm:
            (out / f"race_swap_w4a16.{name}").write_text(compiled.asm[name])
    (out / "race_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
