#!/usr/bin/env python
"""Print the k = 128 summary table of docs/kernels.md from a bench_splice_gemm.py JSON.

Usage: python benchmarks/kernel_table.py [benchmarks/results/splice_gemm.json]
"""

from __future__ import annotations

import json
import sys


def main(path: str = "benchmarks/results/splice_gemm.json") -> None:
    res = json.load(open(path))
    rows = res["rows"]
    base = {(r["N"], r["K"], r["M"]): r["ours_ms"] for r in rows if r["k"] == 0}
    print("| N | K | M | kernel (k=128) | ours µs | GEMM-only µs | quant µs | cuBLAS µs | x cuBLAS (k=0) | x cuBLAS (k=128) "
          "| k=128 vs k=0 | TB/s | TFLOP/s | W4A16 µs | x naive |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["k"] != 128:
            continue
        b = base.get((r["N"], r["K"], r["M"]))
        ovh = f"{(r['ours_ms'] / b - 1) * 100:+.1f} %" if b else ""
        w = f"{r['w4a16_ms'] * 1e3:.1f}" if r.get("w4a16_ms") else ""
        nv = f"{r['naive_ms'] / r['ours_ms']:.1f}" if r.get("naive_ms") else ""
        cfg = (r["config"][0] + "(" + ",".join(r["config"][1:]) + ")") if r.get("config") else "?"
        r0 = f"{r['cublas_ms'] / b:.2f}" if b else ""
        print(f"| {r['N']} | {r['K']} | {r['M']} | `{cfg}` | {r['ours_ms'] * 1e3:.1f} | {r['gemm_only_ms'] * 1e3:.1f} | "
              f"{r['quant_only_ms'] * 1e3:.1f} | {r['cublas_ms'] * 1e3:.1f} | {r0} | {r['cublas_ms'] / r['ours_ms']:.2f} | {ovh} | "
              f"{r['achieved_TBps']:.2f} | {r['achieved_TFLOPs']:.0f} | {w} | {nv} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
