#!/usr/bin/env python
"""Expected (not measured) speed of the FourSight W4A4 layer on a B200 (sm_100), from the bytes it moves
and the FP4 rate: a roofline at NVIDIA's datasheet peaks, against the same roofline for a BF16 GEMM.

Per layer ``Y[M, N] = X[M, K] · Wᵀ`` with k BF16 channels:

* BF16 GEMM: bytes ``2NK + 2MK + 2MN``, FLOPs ``2MNK`` at the BF16 rate;
* FourSight on the native FP4 path: the activation quantization (reads ``2MK``, writes
  ``MK/2 + MK/16 + 2Mk``) and the GEMM (reads ``NK/2 + NK/16`` FP4 weight and scales, ``2Nk`` of
  ``W[:, S]``, the quantized activation, writes ``2MN``); FLOPs ``2MNK`` at the FP4 rate plus
  ``2MNk`` at the BF16 rate (the BF16 term).

Each part's time is ``max(bytes / bandwidth, FLOPs / rate)``; the two FourSight parts add (two launches).
No launch overhead, no efficiency below peak: real kernels reach less, and decode GEMVs reach a smaller
fraction of peak bandwidth than large GEMMs. These are the figures docs/blackwell.md quotes as "expected".

Usage: ``python benchmarks/kernels/blackwell_expected.py --out benchmarks/results/blackwell_expected.md``
"""

from __future__ import annotations

import argparse
import subprocess

#: NVIDIA B200 datasheet (HGX/DGX B200, per GPU, dense): FP4 9 PFLOP/s, BF16 2.25 PFLOP/s, HBM3e 8 TB/s.
B200 = {"fp4": 9.0e15, "bf16": 2.25e15, "bw": 8.0e12}
SHAPES = [(8192, 8192), (14336, 4096), (4096, 14336)]
MS = [1, 16, 64, 256, 1024, 4096]


def bf16_time(m: int, n: int, k_dim: int, hw=B200) -> float:
    return max((2 * n * k_dim + 2 * m * k_dim + 2 * m * n) / hw["bw"], 2 * m * n * k_dim / hw["bf16"])


def foursight_time(m: int, n: int, k_dim: int, k: int, hw=B200) -> float:
    quant = (2 * m * k_dim + m * k_dim / 2 + m * k_dim / 16 + 2 * m * k) / hw["bw"]
    gemm_bytes = n * k_dim / 2 + n * k_dim / 16 + 2 * n * k + m * k_dim / 2 + m * k_dim / 16 + 2 * m * k + 2 * m * n
    gemm = max(gemm_bytes / hw["bw"], 2 * m * n * k_dim / hw["fp4"] + 2 * m * n * k / hw["bf16"])
    return quant + gemm


def table(k: int = 128) -> str:
    lines = [f"| N×K | M | BF16 µs (expected) | FourSight W4A4 k={k} µs (expected) | speed-up over BF16 (expected) | k=0 speed-up (expected) |",
             "|---|---|---|---|---|---|"]
    for n, k_dim in SHAPES:
        for m in MS:
            b = bf16_time(m, n, k_dim)
            f = foursight_time(m, n, k_dim, k)
            f0 = foursight_time(m, n, k_dim, 0)
            lines.append(f"| {n}×{k_dim} | {m} | {b * 1e6:.1f} | {f * 1e6:.1f} | {b / f:.2f}x | {b / f0:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description="expected B200 roofline of the FourSight layer")
    ap.add_argument("--out")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    text = (f"# Expected (not measured) B200 per-layer times: roofline at datasheet peaks\n\n"
            f"Computed by `python benchmarks/kernels/blackwell_expected.py --out benchmarks/results/blackwell_expected.md` at commit `{commit}`; "
            f"peaks {B200['fp4'] / 1e15:g} PFLOP/s FP4, {B200['bf16'] / 1e15:g} PFLOP/s BF16, {B200['bw'] / 1e12:g} TB/s (NVIDIA B200 datasheet, dense). "
            "Model in the script's docstring. Nothing here ran on a GPU.\n\n" + table() + "\n")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
