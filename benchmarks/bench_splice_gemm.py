#!/usr/bin/env python
"""Benchmark SpliceGEMM (fused activation quantization + GEMM) on a CUDA GPU.

Every figure is a ratio or a rate measured in this process on this GPU:

* cuBLAS BF16 (``torch.nn.functional.linear`` on the BF16 weight),
* a naive PyTorch emulation (fake-quantize X, dequantize the FP4 weight to bf16 every call, two
  bf16 matmuls),
* the same kernel with k = 0,
* the two ceilings measured first: device-to-device copy bandwidth (bytes read + written) and an
  8192^3 bf16 matmul.

Timing: medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``) for the kernel and
cuBLAS, each graph running the op on R rotating copies of the weights so that the weights streamed
per replay exceed the 60 MB L2 several times (decode is otherwise an L2 benchmark); the naive
emulation cannot be captured (it copies a lookup table host->device) and is timed with
``do_bench`` (events). Speed is never asserted.

Usage (on the GPU machine; see docs/kernels.md)::

    python benchmarks/bench_splice_gemm.py --out benchmarks/results            # full grid
    python benchmarks/bench_splice_gemm.py --out /tmp/r --quick                # a subset

Writes ``splice_gemm.json`` and ``splice_gemm.md`` into ``--out`` (after every shape, so a run
stopped early still leaves its results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

import foursight.kernels as fk
import foursight.kernels.api as fk_api
from foursight.layer import QuantizedWeight, quantize_activation as ref_quantize_activation, quantize_weight, reference_linear
from foursight.kernels.reference import naive_emulation

L2_BYTES = 60 * 2**20
ROTATE_BYTES = 240 * 2**20  # bytes streamed per graph replay, >= 4x L2


# ---------------------------------------------------------------------------------------------
# baselines
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# timing helpers
# ---------------------------------------------------------------------------------------------


def _graph_ms(fns, rep_ms: int = 60) -> float:
    """Median ms of one call, from CUDA-graph replays of ``fns`` run back to back."""
    def all_():
        for f in fns:
            f()
    all_()
    torch.cuda.synchronize()
    return do_bench_cudagraph(all_, rep=rep_ms, return_mode="median") / len(fns)


def _rotations(bytes_per_call: int) -> int:
    return int(min(32, max(1, math.ceil(ROTATE_BYTES / max(bytes_per_call, 1)))))


def _clone_prepared(pw):
    return dataclasses.replace(pw, **{f.name: getattr(pw, f.name).clone() for f in dataclasses.fields(pw)
                                      if isinstance(getattr(pw, f.name), torch.Tensor)}, _cache={})


def measure_ceilings() -> dict:
    n = 2**30  # 1 GiB
    a = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    copy_tbs = 2 * n / (t * 1e-3) / 1e12
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t = do_bench(lambda: x @ y, warmup=100, rep=400, return_mode="median")
    tflops = 2 * m**3 / (t * 1e-3) / 1e12
    return {"copy_TBps": copy_tbs, "bf16_matmul_TFLOPs": tflops}


def check_configs() -> dict:
    """Run each candidate of the decode/mid/prefill lists on a ragged 1024 x 4112 layer (W4A4 and
    W4A16) against the reference; drop the ones that fail. Returns {config: "ok" | reason}."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 4112, device="cuda", generator=g) * 0.02
    ch = torch.sort(torch.randperm(4112, device="cuda", generator=g)[:128]).values.to(torch.int32)
    qw = quantize_weight(w, ch)
    pw = fk.prepare_weight(qw)
    out = {}
    for path, lst in (("decode", fk_api.DECODE_CONFIGS), ("mid", fk_api.MID_CONFIGS), ("prefill", fk_api.PREFILL_CONFIGS)):
        keep = []
        for cfg in lst:
            ms = [1, 3] if cfg[0] == "gemv" else [{"decode": 13, "mid": 100, "prefill": 300}[path]]
            verdict = "ok"
            for M in ms:
                x = torch.randn(M, 4112, device="cuda", generator=g).bfloat16()
                try:
                    for aq in (True, False):
                        y = fk.splice_linear(x, pw, act_quant=aq, path=path, config=cfg).float()
                        ref = reference_linear(x, qw, act_quant=aq, out_dtype=torch.float32)
                        rel = ((y - ref).norm() / ref.norm()).item()
                        if not rel < 5e-3:
                            verdict = f"rel err {rel:.2e} (M={M}, act_quant={aq})"
                except Exception as e:
                    verdict = f"{type(e).__name__}: {str(e)[:160]}"
            out["/".join(map(str, cfg))] = verdict
            if verdict == "ok":
                keep.append(cfg)
        lst[:] = keep
    return out


# ---------------------------------------------------------------------------------------------
# SASS inspection
# ---------------------------------------------------------------------------------------------


def sass_report(compiled, tag: str, out_dir: Path) -> dict:
    """Registers/spills/shared memory and instruction counts of a compiled Triton kernel."""
    rep = {"tag": tag, "n_regs": getattr(compiled, "n_regs", None), "n_spills": getattr(compiled, "n_spills", None),
           "shared_bytes": getattr(getattr(compiled, "metadata", None), "shared", None)}
    cubin = compiled.asm.get("cubin")
    cuobjdump = None
    for cand in [os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"), "cuobjdump"]:
        if os.path.exists(cand) or subprocess.run(["which", cand], capture_output=True).returncode == 0:
            cuobjdump = cand
            break
    if cubin is None or cuobjdump is None:
        rep["sass"] = "unavailable"
        return rep
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    sass = subprocess.run([cuobjdump, "--dump-sass", path], capture_output=True, text=True).stdout
    ops = {}
    for line in sass.splitlines():
        parts = line.split("*/")
        if len(parts) < 2:
            continue
        ins = parts[1].strip().split(" ")[0].strip()
        if ins.startswith("@"):
            ins = parts[1].strip().split(" ")[1] if len(parts[1].strip().split(" ")) > 1 else ins
        op = ins.split(".")[0]
        if op:
            ops[op] = ops.get(op, 0) + 1
    for key in ("HGMMA", "HMMA", "WARPGROUP", "LDL", "STL", "LDGSTS", "UTMALDG", "SYNCS", "LOP3", "HMUL2", "HFMA2", "F2F", "PRMT", "SHF", "I2F"):
        rep[key] = sum(v for k, v in ops.items() if k.startswith(key))
    (out_dir / f"sass_{tag}.txt").write_text(sass)
    return rep


# ---------------------------------------------------------------------------------------------
# main grid
# ---------------------------------------------------------------------------------------------


def run(args) -> dict:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.cuda.get_device_properties(0)
    res = {
        "env": {
            "gpu": dev.name, "sm_count": dev.multi_processor_count, "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "command": " ".join(sys.argv),
        },
        "method": "medians of CUDA-graph replays; weights rotated over R copies per replay (>= 240 MB streamed); "
                  "naive emulation timed with do_bench (events, no graph)",
        "rows": [], "quant": [], "datapaths": [], "sass": [],
    }
    # bit-exactness of the activation quantization with the reference on this GPU, for both ways of
    # computing block_amax / 6 (see kernels/act_quant.py): the shipped default must be the exact one
    xq = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16) * 3
    chq = torch.arange(0, 4096, 33, device="cuda", dtype=torch.int32)
    rq = ref_quantize_activation(xq, chq)
    diag = {}
    default = fk_api.DIV6_RECIP_ON_CUDA
    for flag in (True, False):
        fk_api.DIV6_RECIP_ON_CUDA = flag
        aq = fk.quantize_activation(xq, chq)
        diag[f"div6_recip={flag}"] = {"scale_mismatches": int((aq.scale.view(torch.uint8) != rq.scale.view(torch.uint8)).sum()),
                                      "code_mismatches": int((aq.packed != rq.packed).sum())}
    fk_api.DIV6_RECIP_ON_CUDA = default
    res["quant_exactness_check"] = diag
    print("quant exactness:", diag, flush=True)
    # every candidate configuration computes the reference function on this GPU, or it is dropped
    # from the autotuner's lists (and reported): a fast wrong kernel must not be timed
    res["config_check"] = check_configs()
    print("config check:", res["config_check"], flush=True)
    res["ceilings"] = measure_ceilings()
    print("ceilings:", res["ceilings"], flush=True)
    # SASS of the first prefill and decode candidates (4096 x 4096, k = 128): HGMMA or not
    N = K = 4096
    w = torch.randn(N, K, device="cuda") * 0.02
    ch = torch.sort(torch.randperm(K, device="cuda")[:128]).values.to(torch.int32)
    pw = fk.prepare_weight(quantize_weight(w, ch))
    sass_cases = ((4096, "prefill_ss", fk_api.PREFILL_CONFIGS[0]), (4096, "prefill_swap", ("swap", 128, 128, 64, 8, 3, 0)),
                  (1, "decode_gemv1", fk_api.DECODE_CONFIGS[0]), (16, "decode_swap", ("swap", 16, 64, 256, 4, 3, 0)))
    for M, tag, cfg in sass_cases:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        try:
            compiled = fk_api._linear_run(cfg, x, pw, None, None, True, out)
            res["sass"].append(dict(sass_report(compiled, tag, out_dir), config=[str(c) for c in cfg]))
        except Exception as e:  # report, do not lose the run
            res["sass"].append({"tag": tag, "config": [str(c) for c in cfg], "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(res["sass"][-1]), flush=True)
    torch.manual_seed(0)
    shapes = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192)]
    ms = [1, 4, 16, 64, 256, 1024, 4096]
    ks_all = [0, 64, 128, 256]
    if args.quick:
        shapes, ms = [(4096, 4096), (14336, 4096)], [1, 16, 64, 256, 4096]
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]
    t_start = time.time()
    for (N, K) in shapes:
        w = torch.randn(N, K, device="cuda") * 0.02
        w_bf16 = w.to(torch.bfloat16)
        bytes_bf16 = N * K * 2
        for M in ms:
            if time.time() - t_start > args.budget_s:
                print("time budget reached; stopping the grid", flush=True)
                break
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            r_cub = _rotations(bytes_bf16 + M * K * 2)
            ws = [w_bf16] + [w_bf16.clone() for _ in range(r_cub - 1)]
            t_cublas = _graph_ms([lambda wi=wi: F.linear(x, wi) for wi in ws])
            del ws
            t_naive = None
            row_base = {"N": N, "K": K, "M": M, "cublas_ms": t_cublas}
            ks = ks_all if (N, K) == shapes[0] and M in (1, 4096) else [0, 128]
            for k in ks:
                ch = torch.sort(torch.randperm(K, device="cuda")[:k]).values.to(torch.int32)
                qw = quantize_weight(w, ch)
                pw = fk.prepare_weight(qw)
                y = fk.splice_linear(x, pw)  # autotunes on first use
                ref = reference_linear(x, qw, out_dtype=torch.float32)
                rel = ((y.float() - ref).norm() / ref.norm()).item()
                bytes_fp4 = N * K // 2 + N * K // 16 + N * k * 2
                r = _rotations(bytes_fp4 + M * K * 2)
                pws = [pw] + [_clone_prepared(pw) for _ in range(r - 1)]
                t_ours = _graph_ms([lambda p=p: fk.splice_linear(x, p) for p in pws])
                row = dict(row_base, k=k, ours_ms=t_ours, rel_err_vs_reference=rel, rotations=r,
                           path=fk.datapath_for(M))
                cfg = fk_api.TUNED.get(fk_api.linear_key(fk.datapath_for(M), M, pw, True, False, x.dtype, False))
                row["config"] = [str(v) for v in cfg] if cfg else None
                # GEMM alone (activation already quantized)
                fp4_a = fk_api.DECODE_FP4_A and fk.datapath_for(M) == "decode"
                packed, scale, deq, gs, _ = fk_api._act_quant_launch(x, pw.channel_mask, pw.bf16_channels, None, fp4_a, not fp4_a, False)
                qa = (packed, scale, gs) if fp4_a else (deq, None, gs)
                row["gemm_only_ms"] = _graph_ms([lambda p=p: fk.splice_gemm(x, p, qa) for p in pws])
                if k == 128 and fk.datapath_for(M) == "decode":  # the other activation operand form, for the record
                    packed, scale, deq, gs, _ = fk_api._act_quant_launch(x, pw.channel_mask, pw.bf16_channels, None, not fp4_a, fp4_a, False)
                    qa2 = (packed, scale, gs) if not fp4_a else (deq, None, gs)
                    fk.splice_gemm(x, pw, qa2)
                    row["gemm_other_A_form_ms"] = _graph_ms([lambda p=p: fk.splice_gemm(x, p, qa2) for p in pws])
                row["quant_only_ms"] = _graph_ms([lambda: fk_api._act_quant_launch(x, pw.channel_mask, pw.bf16_channels, None, fp4_a, not fp4_a, False)])
                if k == 128:
                    if M in (1, 16, 4096):
                        row["w4a16_ms"] = _graph_ms([lambda p=p: fk.splice_linear(x, p, act_quant=False) for p in pws])
                    if t_naive is None:
                        naive_emulation(x, qw)
                        t_naive = do_bench(lambda: naive_emulation(x, qw), warmup=5, rep=max(20, int(20 * M / 256)), return_mode="median")
                    row["naive_ms"] = t_naive
                row["bytes_min"] = bytes_fp4 + M * K * 2 + M * N * 2
                row["achieved_TBps"] = row["bytes_min"] / (t_ours * 1e-3) / 1e12
                row["achieved_TFLOPs"] = 2 * M * N * (K + k) / (t_ours * 1e-3) / 1e12
                row["cublas_TFLOPs"] = 2 * M * N * K / (t_cublas * 1e-3) / 1e12
                row["cublas_TBps"] = (bytes_bf16 + M * K * 2 + M * N * 2) / (t_cublas * 1e-3) / 1e12
                res["rows"].append(row)
                print(json.dumps({kk: (round(v, 5) if isinstance(v, float) else v) for kk, v in row.items()}), flush=True)
                del pws
            # activation quantization alone, QuantizedActivation form (packed + scale + x[:, S]), k = 128
            if K not in {q["K"] for q in res["quant"] if q["M"] == M}:
                ch = torch.sort(torch.randperm(K, device="cuda")[:128]).values.to(torch.int32)
                xs = [x] + [x.clone() for _ in range(_rotations(M * K * 2) - 1)]
                maskq = torch.zeros(K, dtype=torch.uint8, device="cuda")
                maskq[ch.long()] = 1
                t_q = _graph_ms([lambda xi=xi: fk_api._act_quant_launch(xi, maskq, ch, None, True, False, True) for xi in xs])
                qa_k = fk.quantize_activation(x, ch)
                qa_r = ref_quantize_activation(x, ch)
                exact = bool(torch.equal(qa_k.packed, qa_r.packed) and torch.equal(qa_k.scale.view(torch.uint8), qa_r.scale.view(torch.uint8)))
                qbytes = M * K * 2 + M * K // 2 + M * K // 16 + M * 4 + M * 128 * 2
                res["quant"].append({"M": M, "K": K, "k": 128, "ms": t_q, "bytes": qbytes,
                                     "TBps": qbytes / (t_q * 1e-3) / 1e12, "bit_exact_vs_reference": exact})
        _write(res, out_dir)
    # datapath sweep around the decode/prefill threshold
    if time.time() - t_start > args.budget_s + 60:
        return res
    for (N, K) in [(4096, 4096), (14336, 4096)] if not args.quick else [(4096, 4096)]:
        w = torch.randn(N, K, device="cuda") * 0.02
        ch = torch.sort(torch.randperm(K, device="cuda")[:128]).values.to(torch.int32)
        pw = fk.prepare_weight(quantize_weight(w, ch))
        pws = [pw] + [_clone_prepared(pw) for _ in range(_rotations(N * K // 2) - 1)]
        for M in ([8, 16, 32, 64, 128] if not args.quick else [16, 64]):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            entry = {"N": N, "K": K, "M": M, "k": 128}
            for path in ("decode", "mid", "prefill"):
                fk.splice_linear(x, pw, path=path)
                entry[f"{path}_ms"] = _graph_ms([lambda p=p: fk.splice_linear(x, p, path=path) for p in pws])
            res["datapaths"].append(entry)
            print(json.dumps(entry), flush=True)
    return res


def _ratio(a, b):
    return None if (a is None or b is None or b == 0) else a / b


def _write(res: dict, out_dir: Path) -> None:
    res["tuned"] = [{"key": [str(v) for v in k], "config": [str(c) for c in v]} for k, v in fk.TUNED.items()]
    res["tune_log"] = [{"key": [str(v) for v in k], "candidates": [{"config": [str(c) for c in cfg], "ms": t, "error": e}
                                                                  for cfg, t, e in v]}
                       for k, v in fk_api.TUNE_LOG.items()]
    (out_dir / "splice_gemm.json").write_text(json.dumps(res, indent=1))
    (out_dir / "splice_gemm.md").write_text(markdown(res))


def markdown(res: dict) -> str:
    c = res.get("ceilings", {})
    lines = [
        f"# SpliceGEMM on {res['env']['gpu']} ({res['env']['date_utc']} UTC)",
        "",
        f"Command: `{res['env']['command']}`; torch {res['env']['torch']}, triton {res['env']['triton']}.",
        f"Ceilings measured in the same process: copy {c.get('copy_TBps', 0):.2f} TB/s (read + write), "
        f"bf16 matmul 8192^3 {c.get('bf16_matmul_TFLOPs', 0):.0f} TFLOP/s. {res['method']}.",
        "",
        "Times are medians in microseconds; `ours` = fused activation quantization + SpliceGEMM (W4A4, dynamic "
        "per-row activation scale). `x cuBLAS` = cuBLAS BF16 time / ours (>1 = faster). `k-ovh` = ours(k) / ours(k=0) - 1. "
        "TB/s counts the minimum bytes (FP4 weight + scales + BF16 columns + X + Y); TFLOP/s counts 2·M·N·(K+k).",
        "",
        "| N | K | M | k | path | kernel | ours µs | GEMM-only µs | quant µs | cuBLAS µs | x cuBLAS | k-ovh | TB/s | TFLOP/s | W4A16 µs | naive µs | x naive | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["N"], r["K"], r["M"]): r["ours_ms"] for r in res["rows"] if r["k"] == 0}
    for r in res["rows"]:
        b = base.get((r["N"], r["K"], r["M"]))
        ovh = f"{(r['ours_ms'] / b - 1) * 100:+.1f}%" if (b and r["k"]) else ""
        naive = r.get("naive_ms")
        lines.append(
            f"| {r['N']} | {r['K']} | {r['M']} | {r['k']} | {r['path']} | {'/'.join(r.get('config') or ['?'])} | {r['ours_ms'] * 1e3:.1f} | {r['gemm_only_ms'] * 1e3:.1f} | "
            f"{r['quant_only_ms'] * 1e3:.1f} | {r['cublas_ms'] * 1e3:.1f} | {r['cublas_ms'] / r['ours_ms']:.2f} | {ovh} | "
            f"{r['achieved_TBps']:.2f} | {r['achieved_TFLOPs']:.0f} | "
            f"{(r['w4a16_ms'] * 1e3) if r.get('w4a16_ms') else float('nan'):.1f} | "
            f"{(naive * 1e3) if naive else float('nan'):.0f} | {(naive / r['ours_ms']) if naive else float('nan'):.1f} | {r['rel_err_vs_reference']:.1e} |"
        )
    if res["quant"]:
        lines += ["", "## Activation quantization alone (QuantizedActivation form, k = 128)", "",
                  "| M | K | µs | TB/s | % of copy | bit-exact |", "|---|---|---|---|---|---|"]
        for q in res["quant"]:
            lines.append(f"| {q['M']} | {q['K']} | {q['ms'] * 1e3:.1f} | {q['TBps']:.2f} | "
                         f"{100 * q['TBps'] / c.get('copy_TBps', 1):.0f}% | {q['bit_exact_vs_reference']} |")
    if res["datapaths"]:
        lines += ["", "## Datapath sweep (k = 128): µs per call with each datapath forced", "",
                  "| N | K | M | decode | mid | prefill |", "|---|---|---|---|---|---|"]
        for d in res["datapaths"]:
            lines.append(f"| {d['N']} | {d['K']} | {d['M']} | {d['decode_ms'] * 1e3:.1f} | {d['mid_ms'] * 1e3:.1f} | {d['prefill_ms'] * 1e3:.1f} |")
    if res["sass"]:
        lines += ["", "## SASS of the tuned kernels (N = K = 4096, k = 128)", "",
                  "| datapath | config (BM, BN, BK, warps, stages) | regs | spills | HGMMA | HMMA | LDL/STL | LDGSTS |", "|---|---|---|---|---|---|---|---|"]
        for s in res["sass"]:
            lines.append(f"| {s['tag']} | {s.get('config')} | {s.get('n_regs')} | {s.get('n_spills')} | {s.get('HGMMA')} | {s.get('HMMA')} | "
                         f"{s.get('LDL')}/{s.get('STL')} | {s.get('LDGSTS')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ms", default="", help="comma-separated M values (default: 1,4,16,64,256,1024,4096)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new shapes after this many seconds")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_splice_gemm: needs a CUDA GPU")
    res = run(args)
    _write(res, Path(args.out))
    print((Path(args.out) / "splice_gemm.md").read_text())


if __name__ == "__main__":
    main()
