#!/usr/bin/env python
"""Breakdown of one FourSight W4A4 linear on a CUDA GPU: activation quantization, the GEMM alone, the
BF16 channel segment, and the whole call with and without programmatic dependent launch (PDL).

For each shape and M (k = 128 BF16 channels unless ``--k``), in one process, medians of CUDA-graph
replays over rotated weight copies (:mod:`bench_splice_gemm`'s timing):

* ``quant_us``: the activation-quantization kernel alone (the bf16 ``q*s`` operand the fragment form reads,
  and the dense ``X[:, S]`` copy where the layer has BF16 channels, as ``splice_linear`` launches it);
* ``gemm_us``: the fragment GEMM alone on that operand and copy (the configuration the autotuner chose for the
  linear), and ``gemm_k0_us`` the same tile on the layer with k = 0: ``segment_us`` = their difference
  is what the BF16 columns cost;
* ``linear_pdl_us`` / ``linear_nopdl_us``: the whole ``splice_linear`` with the same configuration,
  PDL on (``FOURSIGHT_PDL=1``: the GEMM's programs prefetch weights into L2 while the quantizer runs)
  and off; ``w4a16_us`` the W4A16 call (no quantizer); ``cublas_us`` BF16 ``F.linear``.

Usage (GPU)::

    python benchmarks/kernels/probe_breakdown.py --out $OUT/breakdown [--shapes 8192x8192,14336x4096] [--ms 1,16,64]
    python benchmarks/kernels/probe_breakdown.py --out /tmp/b --dry-run      # CPU: provenance and arguments only

Writes ``breakdown.json`` and ``breakdown.md`` (after every row).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_splice_gemm as bsg  # noqa: E402  (benchmarks/kernels/bench_splice_gemm.py)
from common import ms_per_call  # noqa: E402  (benchmarks/common.py)

import foursight.kernels.api as fk  # noqa: E402
import foursight.kernels.act_quant as fk_aq  # noqa: E402
import foursight.kernels.api as fk_api  # noqa: E402
import foursight.kernels.tuning as fk_tuning  # noqa: E402
from foursight.kernels.fragment import fragment_launch  # noqa: E402
from foursight.channels import relative_error  # noqa: E402
from foursight.layer import quantize_weight, reference_linear  # noqa: E402


def _us(fns) -> float:
    return ms_per_call(fns) * 1e3


def with_pdl(on: bool, fn):
    """``fn`` run with ``FOURSIGHT_PDL`` set to 1 (``on``) or 0, the environment restored after (the kernels read
    their switches once: :func:`foursight.kernels.forms.configure` re-reads them, the same host cost in both arms)."""
    def run():
        old = os.environ.get("FOURSIGHT_PDL")
        os.environ["FOURSIGHT_PDL"] = "1" if on else "0"
        fk_api.configure()
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop("FOURSIGHT_PDL", None)
            else:
                os.environ["FOURSIGHT_PDL"] = old
            fk_api.configure()
    return run


def row_for(N: int, K: int, M: int, k: int, layers: dict) -> dict:
    row = {"N": N, "K": K, "M": M, "k": k}
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    qw, pws = layers[k]
    _, pws0 = layers[0]
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    ws = [w] + [w.clone() for _ in range(bsg._rotations(N * K * 2) - 1)]
    row["cublas_us"] = _us([lambda wi=wi: torch.nn.functional.linear(x, wi) for wi in ws])
    del ws
    y = fk.splice_linear(x, pws[0])  # autotunes (PDL as configured in the environment)
    key = fk_api.linear_key(fk.datapath_for(M), M, pws[0], True, False, x.dtype, False)
    cfg = fk_tuning.TUNED.get(key)
    row["config"] = str(cfg)
    ref = reference_linear(x, qw, out_dtype=torch.float32)
    row["rel_err"] = relative_error(y, ref)
    pw = pws[0]
    cols = getattr(cfg, "q_split", 1)  # the quantizer as the chosen tile runs it (programs per row)
    # the quantizer as splice_linear launches it: it also writes the dense X[:, S] copy where the layer has
    # BF16 channels and the tile reads it (kernels.api, since 06f8db5), and the GEMM below reads that copy
    write_xs = isinstance(cfg, fk.FragmentConfig) and pw.num_channels > 0
    row["quant_us"] = _us([lambda: fk_aq.act_quant_launch(x, pw.channel_mask, pw.bf16_channels, None, False, True, write_xs,
                                                           deq_dtype=torch.bfloat16, cols=cols)])
    if isinstance(cfg, fk.FragmentConfig):
        _, _, deq, gs, xs = fk_aq.act_quant_launch(x, pw.channel_mask, pw.bf16_channels, None, False, True, write_xs,
                                                   deq_dtype=torch.bfloat16, cols=cols)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        row["gemm_us"] = _us([lambda p=p: fragment_launch(cfg, deq, gs, x, p, None, out, True, xs=xs) for p in pws])
        row["gemm_k0_us"] = _us([lambda p=p: fragment_launch(cfg, deq, gs, x, p, None, out, True) for p in pws0])
        row["segment_us"] = row["gemm_us"] - row["gemm_k0_us"]
    for on in (True, False):
        row[f"linear_{'pdl' if on else 'nopdl'}_us"] = _us([with_pdl(on, lambda p=p: fk.splice_linear(x, p, config=cfg)) for p in pws])
    row["w4a16_us"] = _us([lambda p=p: fk.splice_linear(x, p, act_quant=False) for p in pws])
    row["bytes_fp4_k"] = N * K // 2 + N * K // 16 + N * k * 2
    return row


def markdown(res: dict) -> str:
    p = res["provenance"]
    lines = [f"# One W4A4 call, broken down ({res.get('gpu', '?')}, {res.get('date_utc', '')} UTC)", "",
             f"Commit `{p['commit']}`, kernels sha256 `{p['kernels_sha256'][:16]}`, Triton {p['triton']}, PDL available {p['pdl']}. "
             f"Command `{res.get('command', '')}`. Times in µs: foursight.kernels.tuning.time_gpu over rotated weights (L2 flushed before each pass).", "",
             "| N×K | M | k | cuBLAS | quant | GEMM | GEMM k=0 | BF16 segment | linear, PDL | linear, no PDL | W4A16 | form |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda r, key: f"{r[key]:.1f}" if isinstance(r.get(key), float) else ""  # noqa: E731
    for r in res["rows"]:
        lines.append(f"| {r['N']}×{r['K']} | {r['M']} | {r['k']} | {f(r, 'cublas_us')} | {f(r, 'quant_us')} | {f(r, 'gemm_us')} | "
                     f"{f(r, 'gemm_k0_us')} | {f(r, 'segment_us')} | {f(r, 'linear_pdl_us')} | {f(r, 'linear_nopdl_us')} | "
                     f"{f(r, 'w4a16_us')} | {r.get('config', '')} |")
    if res.get("not_run"):
        lines += ["", f"Not run (time budget): {', '.join(res['not_run'])}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/breakdown")
    ap.add_argument("--shapes", default="8192x8192,14336x4096,4096x14336")
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"provenance": bsg.provenance(), "args": vars(args), "command": " ".join(sys.argv), "rows": []}
    if args.dry_run:
        res["dry_run"] = True
        (out / "breakdown.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return
    if not torch.cuda.is_available():
        sys.exit("probe_breakdown: needs a CUDA GPU")
    res.update(gpu=torch.cuda.get_device_name(0), date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
    t0 = time.time()
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        if time.time() - t0 > args.budget_s:
            res.setdefault("not_run", []).append(shape)
            continue
        w = torch.randn(N, K, device="cuda") * 0.02
        layers = {}
        for k in sorted({0, args.k}):
            ch = torch.sort(torch.randperm(K, device="cuda")[:k]).values.to(torch.int32)
            qw = quantize_weight(w, ch)
            pw = fk.prepare_weight(qw)
            r = bsg._rotations(N * K // 2 + N * K // 16 + N * k * 2)
            layers[k] = (qw, [pw] + [bsg._clone_prepared(pw) for _ in range(r - 1)])
        for M in (int(v) for v in args.ms.split(",")):
            if time.time() - t0 > args.budget_s:
                res.setdefault("not_run", []).append(f"{shape} M={M}")
                continue
            row = row_for(N, K, M, args.k, layers)
            res["rows"].append(row)
            res["pdl_errors"] = list(fk_api.PDL_ERRORS)
            print(json.dumps(row), flush=True)
            (out / "breakdown.json").write_text(json.dumps(res, indent=1))
            (out / "breakdown.md").write_text(markdown(res))
        del layers
    (out / "breakdown.json").write_text(json.dumps(res, indent=1))
    (out / "breakdown.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
