#!/usr/bin/env python
"""Does cuBLAS BF16's time depend on the weights' values? (issue 36's baseline)

In one H100 session the grid (``bench_splice_gemm.py``: weights ``randn * 0.02``) put cuBLAS at
8192², M = 1 at 56 µs, while the probe (``probe_v4.py``: weights ``randn``) put it at 48 µs, with
the same timer, the same rotated copies and the same read flush (benchmarks/results/h100-2026-12-06d-v4/).
Every W4A4 ratio is judged against that baseline, so this probe times ``F.linear`` on weights drawn
at several scales, everything else equal, in interleaved rounds (A B C A B C …, so a drift of the
clocks hits every scale alike), and reports the median per scale.

Scales: ``1.0`` (the probe's), ``0.02`` (the grid's, close to a real 8B layer's weights), and
``zeros`` (no bit toggles at all: the floor of any value effect).

Usage (GPU)::

    python benchmarks/kernels/probe_baseline_values.py --out /tmp/bv
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import bench_splice_gemm as bsg  # noqa: E402  (the grid's rotation count)
from common import ms_per_call  # noqa: E402  (benchmarks/common.py)

SCALES = ("1.0", "0.02", "zeros")


def weights(n: int, k: int, scale: str, gen: torch.Generator) -> torch.Tensor:
    if scale == "zeros":
        return torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
    return (torch.randn(n, k, device="cuda", generator=gen) * float(scale)).to(torch.bfloat16)


def run(args) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            r = bsg._rotations(n * k * 2 + m * k * 2)
            copies = {s: [weights(n, k, s, gen) for _ in range(r)] for s in SCALES}
            times = {s: [] for s in SCALES}
            for _ in range(args.rounds):
                for s in SCALES:
                    times[s].append(1e3 * ms_per_call([lambda w=w: torch.nn.functional.linear(x, w) for w in copies[s]]))
            row = {"N": n, "K": k, "M": m, "copies": r, "us": {s: statistics.median(v) for s, v in times.items()},
                   "us_rounds": times}
            rows.append(row)
            print(f"[probe_baseline_values] {n}x{k} M={m}: " + ", ".join(f"{s} {row['us'][s]:.1f} µs" for s in SCALES),
                  flush=True)
            del copies
            torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(0), "provenance": bsg.provenance(), "rounds": args.rounds, "rows": rows,
            "method": "common.ms_per_call (foursight.kernels.tuning.time_gpu, read flush before each pass of the "
                      "rotated copies), median over interleaved rounds"}


def markdown(res: dict) -> str:
    lines = [f"# cuBLAS BF16 time by weight values ({res['gpu']})", "",
             f"Commit `{res['provenance']['commit']}`, kernels sha256 `{res['provenance']['kernels_sha256'][:16]}`, "
             f"torch {res['provenance']['torch']}; {res['method']}; {res['rounds']} rounds. µs per call.", "",
             "| N×K | M | copies | " + " | ".join(f"w = {s}" if s == "zeros" else f"w ~ N(0, {s}²)" for s in SCALES)
             + " | 0.02 / 1.0 |", "|---|---|---|" + "---|" * (len(SCALES) + 1)]
    for r in res["rows"]:
        u = r["us"]
        lines.append(f"| {r['N']}×{r['K']} | {r['M']} | {r['copies']} | " + " | ".join(f"{u[s]:.1f}" for s in SCALES)
                     + f" | {u['0.02'] / u['1.0']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/probe_baseline_values")
    ap.add_argument("--shapes", default="8192x8192,14336x4096,4096x14336")
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_baseline_values: needs a CUDA GPU")
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "baseline_values.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "baseline_values.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
