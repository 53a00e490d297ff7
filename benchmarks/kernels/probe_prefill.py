#!/usr/bin/env python
"""Time the dequantize-then-cuBLAS datapath and its parts against cuBLAS BF16 and the fused kernels
(GPU only). Figures are the package's timer (foursight.kernels.tuning.time_gpu: CUDA-graph replays, L2
flushed before each pass) over rotated weight copies, in one process.

Usage: python benchmarks/kernels/probe_prefill.py --out DIR [--ms 256,1024,4096]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from bench_splice_gemm import _clone_prepared, _rotations  # noqa: E402  (benchmarks/kernels/bench_splice_gemm.py)
from common import ms_per_call  # noqa: E402  (benchmarks/common.py)

import foursight.kernels.api as fk  # noqa: E402
import foursight.kernels.act_quant as fk_aq  # noqa: E402
import foursight.kernels.api as fk_api  # noqa: E402
import foursight.kernels.tuning as fk_tuning  # noqa: E402
from foursight.kernels.configs import PREFILL_CONFIGS  # noqa: E402
from foursight.kernels.dequant import dequant_weight  # noqa: E402
from foursight.channels import relative_error  # noqa: E402
from foursight.layer import quantize_weight, reference_linear  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/probe")
    ap.add_argument("--ms", default="64,256,1024,4096")
    ap.add_argument("--shapes", default="8192x8192,14336x4096,4096x14336")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    deq_cfgs = [c for c in PREFILL_CONFIGS if isinstance(c, fk.DequantConfig)]
    for shp in args.shapes.split(","):
        N, K = (int(v) for v in shp.split("x"))
        w = torch.randn(N, K, device="cuda") * 0.02
        wb = w.bfloat16()
        ch = torch.sort(torch.randperm(K, device="cuda")[:128]).values.to(torch.int32)
        qw = quantize_weight(w, ch)
        pw = fk.prepare_weight(qw)
        pws = [pw] + [_clone_prepared(pw) for _ in range(_rotations(N * K // 2) - 1)]
        wbs = [wb] + [wb.clone() for _ in range(_rotations(N * K * 2) - 1)]
        for M in (int(v) for v in args.ms.split(",")):
            x = torch.randn(M, K, device="cuda").bfloat16()
            row = {"N": N, "K": K, "M": M, "k": 128}
            row["cublas_us"] = 1e3 * ms_per_call([lambda wi=wi: F.linear(x, wi) for wi in wbs])
            for aq in (True, False):
                tag = "w4a4" if aq else "w4a16"
                ref = reference_linear(x, qw, act_quant=aq, out_dtype=torch.float32)
                for cfg in deq_cfgs:
                    y = fk.splice_linear(x, pw, act_quant=aq, config=cfg)
                    rel = relative_error(y, ref)
                    t = 1e3 * ms_per_call([lambda p=p: fk.splice_linear(x, p, act_quant=aq, config=cfg) for p in pws])
                    row[f"{tag}_{cfg}_us"] = t
                    row[f"{tag}_{cfg}_rel"] = rel
                y = fk.splice_linear(x, pw, act_quant=aq)  # autotuned over every candidate of the datapath
                key = fk_api.linear_key(fk.datapath_for(M), M, pw, aq, False, x.dtype, False)
                row[f"{tag}_tuned_cfg"] = str(fk_tuning.TUNED[key])
                row[f"{tag}_tuned_us"] = 1e3 * ms_per_call([lambda p=p: fk.splice_linear(x, p, act_quant=aq) for p in pws])
                row[f"{tag}_tuned_rel"] = relative_error(y, ref)
                row[f"{tag}_tune_log"] = [(str(c), t, e) for c, t, e in fk_tuning.TUNE_LOG.get(key, [])]
            # the parts of the dequant datapath (first config)
            cfg = deq_cfgs[0]
            row["part_dequant_weight_us"] = 1e3 * ms_per_call([lambda p=p: dequant_weight(cfg, p, False) for p in pws])
            post = torch.ones(1, device="cuda")
            row["part_fakequant_act_us"] = 1e3 * ms_per_call([lambda: fk_aq.act_quant_launch(x, pw.channel_mask, pw.bf16_channels, None, False, True, False, post=post)])
            a = torch.randn(M, K, device="cuda").bfloat16()
            row["part_mm_us"] = 1e3 * ms_per_call([lambda wi=wi: torch.mm(a, wi.t()) for wi in wbs])
            rows.append(row)
            print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if "tune_log" not in k}), flush=True)
            (out / "probe_prefill.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
