#!/usr/bin/env python
"""Benchmark SpliceGEMM (activation quantization + GEMM, as an engine calls it) on a CUDA GPU.

Every figure is a time measured in this process on this GPU, or a ratio of two such times:

* FourSight W4A4 (dynamic per-row activation scale) and W4A16, k in {0, 64, 128} BF16 channels,
  through the public ``splice_linear`` with the in-product autotuner (every candidate checked
  against the reference on the device before it is timed; rejected candidates are listed);
* cuBLAS BF16 (``F.linear``), FP8 rowwise ``torch._scaled_mm`` (GEMM alone, and with its dynamic
  per-token activation quantization in eager PyTorch), GemLite 0.6.0.post2 A16W4 int4 (group 64;
  a carried wheel), all from :mod:`baselines`;
* the ceilings measured first: device-to-device copy (bytes read + written), an 8192^3 bf16 matmul;
* bit-stability and batch invariance of the default path (a row computed alone vs in a batch).

cuBLAS BF16 is timed twice per (shape, M): first, after an untimed warm-up of about ``--warmup-ms`` of
GPU work (cuBLAS on the rotated copies), and again after that M's FourSight rows (``cublas_after_ms``).
The ratios use the faster of the two (:func:`cublas_ref_ms`), the conservative figure for FourSight. Why:
at M = 1 the first timing read 15–17 % slower than the second on an H100, and the warm-up, which rules out
clocks still ramping after the shape's build, did not remove the gap; its cause is not found
(benchmarks/results/h100-2026-12-06e-v4/, docs/kernels.md).

Timing: the package's timer (:func:`foursight.kernels.tuning.time_gpu`, CUDA-graph replays with the
L2 flushed before each pass; :func:`common.ms_per_call`), each pass running the op on R rotating
copies of the weights so that the bytes streamed per pass exceed the 60 MB L2 several times (decode
is otherwise an L2 benchmark). The results of 2026-12-05 and before were timed with Triton's
``do_bench_cudagraph`` (no flush between replays). Speed is never asserted.

Usage (on the GPU machine; see docs/kernels.md)::

    python benchmarks/kernels/bench_splice_gemm.py --out benchmarks/results            # full grid
    python benchmarks/kernels/bench_splice_gemm.py --out /tmp/r --quick                # a subset

Writes ``splice_gemm.json`` and ``splice_gemm.md`` into ``--out`` (after every shape, so a run
stopped early still leaves its results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import triton

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import baselines  # noqa: E402  (benchmarks/kernels/baselines.py)
from common import git_commit, gpu_clocks, kernels_sha256, ms_per_call  # noqa: E402  (benchmarks/common.py)

import foursight.kernels.api as fk  # noqa: E402
import foursight.kernels.act_quant as fk_aq  # noqa: E402
import foursight.kernels.api as fk_api  # noqa: E402
import foursight.kernels.tuning as fk_tuning  # noqa: E402
from foursight.kernels.configs import DECODE_CONFIGS, MID_CONFIGS, PREFILL_CONFIGS  # noqa: E402
from foursight.channels import relative_error  # noqa: E402
from foursight.fp8 import quantize_weight_fp8  # noqa: E402
from foursight.layer import quantize_activation as ref_quantize_activation, quantize_weight, reference_linear  # noqa: E402

L2_BYTES = 60 * 2**20
ROTATE_BYTES = 240 * 2**20  # bytes streamed per graph replay, >= 4x L2


# ---------------------------------------------------------------------------------------------
# timing helpers
# ---------------------------------------------------------------------------------------------


def _rotations(bytes_per_call: int) -> int:
    return int(min(32, max(1, math.ceil(ROTATE_BYTES / max(bytes_per_call, 1)))))


def _clone_prepared(pw):
    """A copy of a prepared layer with its own device tensors (the weight rotation): tensor fields and
    tensor fields of dataclass fields (the fragment form) are cloned."""
    def clone(v):
        if isinstance(v, torch.Tensor):
            return v.clone()
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return dataclasses.replace(v, **{f.name: clone(getattr(v, f.name)) for f in dataclasses.fields(v)
                                             if isinstance(getattr(v, f.name), torch.Tensor)})
        return v
    return dataclasses.replace(pw, **{f.name: clone(getattr(pw, f.name)) for f in dataclasses.fields(pw) if f.name != "_cache"},
                               _cache={})


def provenance() -> dict:
    """What produced a result file: git commit of the tree (``FOURSIGHT_COMMIT`` when the copy has no
    git), sha256 of the kernels folder's files, Triton/torch versions, the default candidate lists."""
    kdir = Path(fk.__file__).resolve().parent
    from foursight.kernels import configs  # noqa: PLC0415
    from foursight.kernels.runtime import pdl_supported  # noqa: PLC0415

    return {"commit": git_commit(), "kernels_sha256": kernels_sha256(kdir), "kernels_dir": str(kdir), "triton": triton.__version__,
            "torch": torch.__version__, "pdl": pdl_supported(),
            "default_configs": {name: [str(c) for c in getattr(configs, name)] for name in ("DECODE_CONFIGS", "MID_CONFIGS", "PREFILL_CONFIGS")},
            "fp16_configs": {p: [str(c) for c in cs] for p, cs in configs.FP16_CONFIGS.items()}}


def measure_ceilings() -> dict:
    n = 2**30  # 1 GiB
    a = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = fk_tuning.time_gpu(lambda: b.copy_(a))
    copy_tbs = 2 * n / (t * 1e-3) / 1e12
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t = fk_tuning.time_gpu(lambda: x @ y)
    tflops = 2 * m**3 / (t * 1e-3) / 1e12
    return {"copy_TBps": copy_tbs, "bf16_matmul_TFLOPs": tflops}


def check_configs() -> dict:
    """Run each candidate of the decode/mid/prefill lists on a ragged 1024 x 4112 layer (W4A4 and
    W4A16) against the reference. Returns {config: "ok" | reason}; the in-product autotuner
    applies the same check again before it times a candidate."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 4112, device="cuda", generator=g) * 0.02
    ch = torch.sort(torch.randperm(4112, device="cuda", generator=g)[:128]).values.to(torch.int32)
    qw = quantize_weight(w, ch)
    pw = fk.prepare_weight(qw)
    out = {}
    for path, lst in (("decode", DECODE_CONFIGS), ("mid", MID_CONFIGS), ("prefill", PREFILL_CONFIGS)):
        for cfg in lst:
            M = 1 if isinstance(cfg, fk.GemvConfig) else {"decode": 13, "mid": 100, "prefill": 300}[path]
            verdict = "ok"
            x = torch.randn(M, 4112, device="cuda", generator=g).bfloat16()
            try:
                for aq in (True, False):
                    y = fk.splice_linear(x, pw, act_quant=aq, path=path, config=cfg).float()
                    ref = reference_linear(x, qw, act_quant=aq, out_dtype=torch.float32)
                    rel = relative_error(y, ref)
                    if not rel < 5e-3:
                        verdict = f"rel err {rel:.2e} (M={M}, act_quant={aq})"
            except Exception as e:
                verdict = f"{type(e).__name__}: {str(e)[:160]}"
            out[f"{path}:{cfg}"] = verdict
    return out


SHAPES = [(8192, 8192), (14336, 4096), (4096, 14336)]
#: SmolLM2-135M-Instruct's linear layers (fused q/k/v and gate/up as the engines run them)
SMOL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
#: the M values of the other shapes with ``--short`` (a device session's time does not fit the full grid three times)
SHORT_MS = [1, 16, 64, 256, 1024, 4096]
SMOL_MS = [1, 16, 64, 256, 4096]


#: untimed GPU work before each row's first timed baseline (``--warmup-ms``)
WARMUP_MS = 80.0


def warm_up(fns: list, target_ms: float) -> float:
    """Run passes over ``fns`` (untimed, synchronized every few passes) until about ``target_ms`` of GPU
    time has run, so that the timing after it does not meet the GPU's clocks still ramping after an idle
    spell. Returns the GPU milliseconds run (0 for ``target_ms <= 0``); stops after ``4 * target_ms`` of
    wall time whatever the GPU time (tiny calls whose launch overhead exceeds their GPU time)."""
    if target_ms <= 0:
        return 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    while True:
        for _ in range(4):
            for f in fns:
                f()
        end.record()
        end.synchronize()
        ran = start.elapsed_time(end)
        if ran >= target_ms or time.perf_counter() - t0 > 4e-3 * target_ms:
            return ran


def cublas_ref_ms(row: dict) -> float | None:
    """The cuBLAS BF16 time the ratios divide: the faster of the row's two cuBLAS timings (``cublas_ms``,
    timed first; ``cublas_after_ms``, timed after that M's FourSight rows), or the one a row has (files
    written before the second timing existed)."""
    ts = [t for t in (row.get("cublas_ms"), row.get("cublas_after_ms")) if t]
    return min(ts) if ts else None


def _baseline_rows(N, K, M, w, x, row, warmup_ms: float = WARMUP_MS):
    """Time cuBLAS BF16, FP8 rowwise (GEMM alone / with activation quantization) and GemLite A16W4
    on the same x and weights, with rotated weight copies, after an untimed cuBLAS warm-up of about
    ``warmup_ms``. Returns the cuBLAS calls (they hold the copies) for the second timing after the
    FourSight rows."""
    wb = w.to(torch.bfloat16)
    ws = [wb] + [wb.clone() for _ in range(_rotations(N * K * 2 + M * K * 2) - 1)]
    cublas = [baselines.bf16_call(x, wi) for wi in ws]
    row["warmup_gpu_ms"] = warm_up(cublas, warmup_ms)
    row["cublas_ms"] = ms_per_call(cublas)
    del ws
    why = baselines.fp8_available(x.device)
    if why is None:
        wq, sb = quantize_weight_fp8(wb)
        xq, sa = baselines.quantize_act_fp8(x)
        r = _rotations(N * K + M * K)
        wqs = [(wq, sb)] + [(wq.clone(), sb.clone()) for _ in range(r - 1)]
        row["fp8_gemm_ms"] = ms_per_call([baselines.fp8_rowwise_gemm_call(xq, sa, a, b) for a, b in wqs])
        row["fp8_linear_ms"] = ms_per_call([baselines.fp8_rowwise_linear_call(x, a, b) for a, b in wqs])
        y = baselines.fp8_rowwise_linear_call(x, wq, sb)().float()
        ref = x.float() @ w.float().t()
        row["fp8_rel_err_vs_fp32"] = relative_error(y, ref)
        del wqs
    else:
        row["fp8_error"] = why
    try:
        r = _rotations(N * K // 2 + M * K * 2)
        calls = [baselines.gemlite_int4_call(x, wb) for _ in range(min(r, 4))]
        row["gemlite_ms"] = ms_per_call(calls)
        del calls
    except Exception as e:  # recorded, never fatal
        row["gemlite_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return cublas


def run(args) -> dict:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.cuda.get_device_properties(0)
    res = {
        "provenance": provenance(),
        "env": {
            "gpu": dev.name, "sm_count": dev.multi_processor_count, "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "command": " ".join(sys.argv),
        },
        "method": "foursight.kernels.tuning.time_gpu (CUDA-graph replays, L2 flushed before each pass); weights rotated over R copies per pass (>= 240 MB streamed); "
                  f"before each (shape, M) row's first timed baseline, about {args.warmup_ms:g} ms of untimed cuBLAS calls on the rotated copies (warmup_gpu_ms: the GPU time run); "
                  "cuBLAS timed again after that M's FourSight rows (cublas_after_ms); ratios use the faster of the two",
        "args": vars(args),
        "rows": [], "quant": [], "batch_invariance": [],
    }
    xq = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16) * 3
    chq = torch.arange(0, 4096, 33, device="cuda", dtype=torch.int32)
    rq = ref_quantize_activation(xq, chq)
    aq = fk.quantize_activation(xq, chq)
    res["quant_exactness_check"] = {"scale_mismatches": int((aq.scale.view(torch.uint8) != rq.scale.view(torch.uint8)).sum()),
                                    "code_mismatches": int((aq.packed != rq.packed).sum())}
    print("quant exactness:", res["quant_exactness_check"], flush=True)
    res["config_check"] = {} if args.skip_config_check else check_configs()
    print("config check:", res["config_check"], flush=True)
    res["ceilings"] = measure_ceilings()
    print("ceilings:", res["ceilings"], flush=True)
    try:
        baselines.load_gemlite()
        res["gemlite"] = dict(baselines.GEMLITE_INFO)
    except Exception as e:
        res["gemlite"] = {"error": f"{type(e).__name__}: {e}"}
    torch.manual_seed(0)
    shapes = [(s, MS if (i == 0 or not args.short) else SHORT_MS) for i, s in enumerate(SHAPES)] + [(s, SMOL_MS) for s in SMOL_SHAPES]
    if args.quick:
        shapes = [((8192, 8192), [1, 16, 64, 256, 4096])]
    if args.ms:
        shapes = [(s, [int(v) for v in args.ms.split(",")]) for s, _ in shapes]
    if args.shapes:
        want = {tuple(int(v) for v in t.split("x")) for t in args.shapes.split(",")}
        shapes = [(s, m) for s, m in shapes if s in want]
    if args.smol_ms:
        shapes = [(s, [int(v) for v in args.smol_ms.split(",")] if s in SMOL_SHAPES else m) for s, m in shapes]
    ks_all = tuple(int(v) for v in args.ks.split(","))
    t_start = time.time()
    for (N, K), ms in shapes:
        if time.time() - t_start > args.budget_s:
            res.setdefault("not_run", []).append(f"{N}x{K}")
            continue
        w = torch.randn(N, K, device="cuda") * 0.02
        layers = {}
        for k in ks_all:
            ch = torch.sort(torch.randperm(K, device="cuda")[:k]).values.to(torch.int32)
            qw = quantize_weight(w, ch)
            pw = fk.prepare_weight(qw)
            r = _rotations(N * K // 2 + N * K // 16 + N * k * 2)
            layers[k] = (qw, [pw] + [_clone_prepared(pw) for _ in range(r - 1)])
        for M in ms:
            if time.time() - t_start > args.budget_s:
                print("time budget reached; stopping the grid", flush=True)
                res.setdefault("not_run", []).append(f"{N}x{K} M>={M}")
                break
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = {"N": N, "K": K, "M": M, "path": fk.datapath_for(M)}
            cublas = _baseline_rows(N, K, M, w, x, row, args.warmup_ms)
            ks = [k for k in ((0, 64, 128) if M in (1, 64, 4096) else (0, 128)) if k in ks_all]
            for k in ks:
                qw, pws = layers[k]
                modes = [True] + ([False] if (k == 128 and (M <= 64 or M == 4096)) else [])
                for act_quant in modes:
                    tag = f"{'w4a4' if act_quant else 'w4a16'}_k{k}"
                    y = fk.splice_linear(x, pws[0], act_quant=act_quant)  # autotunes on first use
                    ref = reference_linear(x, qw, act_quant=act_quant, out_dtype=torch.float32)
                    row[f"{tag}_rel_err"] = relative_error(y, ref)
                    row[f"{tag}_ms"] = ms_per_call([lambda p=p: fk.splice_linear(x, p, act_quant=act_quant) for p in pws])
                    key = fk_api.linear_key(fk.datapath_for(M), M, pws[0], act_quant, False, x.dtype, False)
                    cfg = fk_tuning.TUNED.get(key)
                    row[f"{tag}_config"] = str(cfg) if cfg is not None else None
            row["cublas_after_ms"] = ms_per_call(cublas)  # after the FourSight rows: cublas_ref_ms takes the faster
            del cublas
            row["bytes_fp4_k128"] = N * K // 2 + N * K // 16 + N * 128 * 2 + M * K * 2 + M * N * 2
            row["bytes_bf16"] = N * K * 2 + M * K * 2 + M * N * 2
            if torch.cuda.is_available():
                row["clocks_after"] = gpu_clocks(torch.cuda.current_device())  # the row's clocks, read after its timings
            res["rows"].append(row)
            _write(res, out_dir)  # after every row: a run stopped by its time limit keeps what it measured
            print(json.dumps({kk: (round(v, 5) if isinstance(v, float) else v) for kk, v in row.items()}), flush=True)
            # activation quantization alone (the fp16 q*s form the fused kernels read), k = 128
            if K == 8192 and M == 4096:
                _, pws = layers[128]
                xs = [x] + [x.clone() for _ in range(_rotations(M * K * 2) - 1)]
                t_q = ms_per_call([lambda xi=xi: fk_aq.act_quant_launch(xi, pws[0].channel_mask, pws[0].bf16_channels, None, True, False, True) for xi in xs])
                qbytes = M * K * 2 + M * K // 2 + M * K // 16 + M * 4 + M * 128 * 2
                post = torch.ones(1, device="cuda")
                t_fq = ms_per_call([lambda xi=xi: fk_aq.act_quant_launch(xi, pws[0].channel_mask, pws[0].bf16_channels, None, False, True, False, post=post) for xi in xs])
                res["quant"].append({"M": M, "K": K, "k": 128, "packed_ms": t_q, "packed_bytes": qbytes, "packed_TBps": qbytes / (t_q * 1e-3) / 1e12,
                                     "fakequant_ms": t_fq, "fakequant_TBps": 2 * M * K * 2 / (t_fq * 1e-3) / 1e12})
        del layers
        _write(res, out_dir)
    # batch invariance of the default path: row 0 alone vs row 0 inside a batch of M
    w = torch.randn(4096, 4096, device="cuda") * 0.02
    qw = quantize_weight(w, torch.sort(torch.randperm(4096, device="cuda")[:128]).values.to(torch.int32))
    pw = fk.prepare_weight(qw)
    xb = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for act_quant in (True, False):
        alone = fk.splice_linear(xb[:1], pw, act_quant=act_quant)
        for M in (2, 16, 64, 256, 1024, 4096):
            y = fk.splice_linear(xb[:M], pw, act_quant=act_quant)[:1]
            res["batch_invariance"].append({"act_quant": act_quant, "M": M, "bit_identical_to_M1": bool(torch.equal(y, alone)),
                                            "max_abs_diff": float((y.float() - alone.float()).abs().max()),
                                            "config_M": str(fk_tuning.TUNED.get(fk_api.linear_key(fk.datapath_for(M), M, pw, act_quant, False, xb.dtype, False)))})
    print("batch invariance:", res["batch_invariance"], flush=True)
    return res


def _write(res: dict, out_dir: Path) -> None:
    res["tuned"] = [{"key": [str(v) for v in k], "config": str(v)} for k, v in fk_tuning.TUNED.items()]
    res["pdl_errors"] = list(fk_api.PDL_ERRORS)
    res["tune_log"] = [{"key": [str(v) for v in k], "candidates": [{"config": str(cfg), "ms": t, "error": e} for cfg, t, e in v]}
                       for k, v in fk_tuning.TUNE_LOG.items()]
    (out_dir / "splice_gemm.json").write_text(json.dumps(res, indent=1))
    (out_dir / "splice_gemm.md").write_text(markdown(res))


def _x(row: dict, key: str) -> str:
    """cuBLAS BF16 time (:func:`cublas_ref_ms`) / ``key``'s time, formatted; blank when either is missing."""
    t, c = row.get(key), cublas_ref_ms(row)
    return f"{c / t:.2f}" if t and c else ""


def markdown(res: dict) -> str:
    c = res.get("ceilings", {})
    lines = [
        f"# SpliceGEMM on {res['env']['gpu']} ({res['env']['date_utc']} UTC)",
        "",
        f"Command: `{res['env']['command']}`; torch {res['env']['torch']}, triton {res['env']['triton']}.",
        f"Commit `{res.get('provenance', {}).get('commit', '?')}`, kernels sha256 `{res.get('provenance', {}).get('kernels_sha256', '?')[:16]}`, "
        f"PDL {res.get('provenance', {}).get('pdl')}.",
        f"Ceilings measured in the same process: copy {c.get('copy_TBps', 0):.2f} TB/s (read + write), "
        f"bf16 matmul 8192^3 {c.get('bf16_matmul_TFLOPs', 0):.0f} TFLOP/s. {res['method']}. GemLite: {res.get('gemlite')}.",
        f"Not run (device time): {', '.join(res['not_run'])}." if res.get("not_run") else "",
        "",
        "Every column after `cuBLAS after` is cuBLAS BF16 time / that method's time (> 1 = faster than BF16), "
        "all measured in this process on the same x. cuBLAS is timed twice per row: `cuBLAS µs` first (after "
        "an untimed warm-up), `cuBLAS after` once that M's FourSight rows have run; the ratios divide the faster "
        "(minimum) of the two, the conservative choice for FourSight. W4A4 = FourSight with dynamic per-row activation "
        "quantization inside the timed call; `k` = BF16 channels; FP8 = rowwise `torch._scaled_mm` "
        "(`gemm` = activation quantized beforehand, `+q` = with eager per-token quantization); "
        "GemLite = A16W4 int4 g64. `k-ovh` = W4A4 k=128 time / k=0 time - 1. `form` = the autotuned "
        "W4A4 k=128 configuration.",
        "",
        "| N | K | M | cuBLAS µs | cuBLAS after | W4A4 k=0 | W4A4 k=64 | W4A4 k=128 | W4A16 k=128 | FP8 gemm | FP8 +q | GemLite | k-ovh | form |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        ovh = f"{(r['w4a4_k128_ms'] / r['w4a4_k0_ms'] - 1) * 100:+.1f}%" if r.get("w4a4_k0_ms") and r.get("w4a4_k128_ms") else ""
        after = f"{r['cublas_after_ms'] * 1e3:.1f}" if r.get("cublas_after_ms") else ""
        lines.append(
            f"| {r['N']} | {r['K']} | {r['M']} | {r['cublas_ms'] * 1e3:.1f} | {after} | {_x(r, 'w4a4_k0_ms')} | {_x(r, 'w4a4_k64_ms')} | "
            f"{_x(r, 'w4a4_k128_ms')} | {_x(r, 'w4a16_k128_ms')} | {_x(r, 'fp8_gemm_ms')} | {_x(r, 'fp8_linear_ms')} | "
            f"{_x(r, 'gemlite_ms')} | {ovh} | {r.get('w4a4_k128_config') or ''} |"
        )
    errs = {(r["N"], r["K"]): max(v for k, v in r.items() if k.endswith("_rel_err")) for r in res["rows"]}
    lines += ["", "Largest relative error of FourSight against the PyTorch reference per shape: "
              + ", ".join(f"{n}x{k} {e:.1e}" for (n, k), e in errs.items()) + "."]
    if res["quant"]:
        lines += ["", "## Activation quantization alone (k = 128)", "",
                  "| M | K | packed µs | packed TB/s | % of copy | fake-quant µs | fake-quant TB/s | % of copy |", "|---|---|---|---|---|---|---|---|"]
        for q in res["quant"]:
            cp = c.get("copy_TBps", 1)
            lines.append(f"| {q['M']} | {q['K']} | {q['packed_ms'] * 1e3:.1f} | {q['packed_TBps']:.2f} | {100 * q['packed_TBps'] / cp:.0f}% | "
                         f"{q['fakequant_ms'] * 1e3:.1f} | {q['fakequant_TBps']:.2f} | {100 * q['fakequant_TBps'] / cp:.0f}% |")
    if res.get("batch_invariance"):
        lines += ["", "## Batch invariance (4096 x 4096, k = 128): row 0 computed alone vs inside a batch of M", "",
                  "| mode | M | bit-identical | max abs diff | form at M |", "|---|---|---|---|---|"]
        for b in res["batch_invariance"]:
            lines.append(f"| {'W4A4' if b['act_quant'] else 'W4A16'} | {b['M']} | {b['bit_identical_to_M1']} | {b['max_abs_diff']:.2e} | {b['config_M']} |")
    rejected = [(t["key"], cand["config"], cand["error"]) for t in res.get("tune_log", []) for cand in t["candidates"] if cand["error"]]
    if rejected:
        lines += ["", f"## Candidates the autotuner skipped ({len(rejected)})", ""]
        lines += [f"- {cfg} for {'/'.join(k[1:5])}: {e}" for k, cfg, e in rejected[:40]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--short", action="store_true", help="full M grid on 8192x8192 only, SHORT_MS on the other two shapes")
    ap.add_argument("--ms", default="", help="comma-separated M values (default: the full grid MS)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new shapes after this many seconds")
    ap.add_argument("--shapes", default="", help="comma-separated NxK to keep (e.g. 8192x8192,576x576; default all)")
    ap.add_argument("--smol-ms", default="", help="comma-separated M values for SmolLM2's shapes (default SMOL_MS)")
    ap.add_argument("--ks", default="0,64,128", help="comma-separated BF16 channel counts to run (of 0, 64, 128)")
    ap.add_argument("--warmup-ms", type=float, default=WARMUP_MS,
                    help="untimed cuBLAS work before each row's first timed baseline, GPU milliseconds (0: none)")
    ap.add_argument("--skip-config-check", action="store_true", help="leave out the up-front check of every candidate (the autotuner still checks what it times)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: write the result file's provenance and arguments only")
    args = ap.parse_args()
    if args.dry_run:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        res = {"dry_run": True, "provenance": provenance(), "args": vars(args), "rows": []}
        (out / "splice_gemm.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return
    if not torch.cuda.is_available():
        sys.exit("bench_splice_gemm: needs a CUDA GPU")
    res = run(args)
    _write(res, Path(args.out))
    print((Path(args.out) / "splice_gemm.md").read_text())


if __name__ == "__main__":
    main()
