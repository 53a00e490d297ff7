#!/usr/bin/env python
"""Issue 36 item 0, measured before the kernels are judged: the timer's flush, PDL on and off, and the
practical ceiling of streaming the same NVFP4 bytes, on a CUDA GPU, in one process.

For each shape and M (k = 128 BF16 channels unless ``--k``):

* **flush modes**: cuBLAS BF16 ``F.linear`` and the FourSight W4A4 linear (the tile the autotuner
  chose, dynamic activation scale) timed by :func:`foursight.kernels.tuning.time_gpu` on one weight
  copy with each flush (``memset``: the timer before issue 36; ``read``: its default now; ``none``: a
  warm L2), and on rotated weight copies (``rotate``: the copies' bytes exceed the L2, no flush; and
  ``rotate+read``, what the benchmarks run);
* **PDL A/B**: the linear with ``FOURSIGHT_PDL=1`` and ``=0``, same tile, rotated copies (the
  fragment form only; a ``quant_in`` tile has no quantizer launch to overlap);
* **static scale**: the linear with a static activation scale (its own autotuned tile: at M <= 4 the
  quantization may run inside the GEMM);
* **ceiling**: one Triton launch that only streams the layer's bytes (fragment codes, scales,
  ``W[:, S]``) with 16-byte loads and XORs them: the practical floor of any kernel over this weight
  form; ``copy_TBps`` a 1 GiB device copy.

``--ncu-target``: the process Nsight Compute profiles (``device_v4.sh``): per M, after warm-up and
autotuning, one W4A4 call and one cuBLAS call between ``cudaProfilerStart``/``Stop`` (run ncu with
``--profile-from-start off``).

Usage (GPU)::

    python benchmarks/kernels/probe_v4.py --out $OUT [--shapes 8192x8192,14336x4096] [--ms 1,16,64]
    python benchmarks/kernels/probe_v4.py --out /tmp/p --dry-run     # CPU: provenance and arguments only

Writes ``probe_v4.json`` and ``probe_v4.md`` (after every row).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_splice_gemm as bsg  # noqa: E402  (benchmarks/kernels/bench_splice_gemm.py)
from probe_breakdown import with_pdl  # noqa: E402  (benchmarks/kernels/probe_breakdown.py)

import foursight.kernels.api as fk  # noqa: E402
import foursight.kernels.api as fk_api  # noqa: E402
import foursight.kernels.tuning as fk_tuning  # noqa: E402
from foursight.channels import relative_error  # noqa: E402
from foursight.layer import quantize_weight, reference_linear  # noqa: E402

MODES = ("memset", "read", "none")


@triton.jit
def _stream_kernel(p0, n0, p1, n1, p2, n2, out_ptr, P0, P1, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Programs [0, P0) read int32 buffer 0, [P0, P0 + P1) buffer 1, the rest buffer 2; each reads
    BLOCK x ITERS words (16-byte loads) and writes one XOR (so nothing is optimized away)."""
    pid = tl.program_id(0)
    if pid < P0:
        ptr, n, base = p0, n0, pid
    elif pid < P0 + P1:
        ptr, n, base = p1, n1, pid - P0
    else:
        ptr, n, base = p2, n2, pid - P0 - P1
    acc = tl.zeros((BLOCK,), tl.int32)
    start = base.to(tl.int64) * BLOCK * ITERS
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def stream_call(pw, out):
    """One launch reading every byte of ``pw``'s fragment form and BF16 columns once."""
    fw = pw.fragment
    bufs = [fw.words.reshape(-1), fw.scales.reshape(-1), pw.weight_bf16.reshape(-1)]
    views = []
    for b in bufs:
        nbytes = b.numel() * b.element_size()
        views.append(b.view(torch.uint8)[: nbytes // 4 * 4].view(torch.int32) if nbytes >= 4 else fw.words.reshape(-1)[:1])
    block, iters = 1024, 8
    per = block * iters
    progs = [triton.cdiv(v.numel(), per) for v in views]

    def run():
        _stream_kernel[(sum(progs),)](views[0], views[0].numel(), views[1], views[1].numel(), views[2], views[2].numel(),
                                      out, progs[0], progs[1], BLOCK=block, ITERS=iters, num_warps=4)
    return run, sum(v.numel() * 4 for v in views)


def _us(fn, flush) -> float:
    return fk_tuning.time_gpu(fn, flush=flush) * 1e3


def _rot_us(fns, flush="none") -> float:
    def one_pass():
        for f in fns:
            f()
    return fk_tuning.time_gpu(one_pass, flush=flush) / len(fns) * 1e3


def row_for(N: int, K: int, M: int, k: int, qw, pws, sink) -> dict:
    row = {"N": N, "K": K, "M": M, "k": k}
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    ws = [w] + [w.clone() for _ in range(bsg._rotations(N * K * 2) - 1)]
    for mode in MODES:
        row[f"cublas_{mode}_us"] = _us(lambda: torch.nn.functional.linear(x, w), mode)
    row["cublas_rotate_us"] = _rot_us([lambda wi=wi: torch.nn.functional.linear(x, wi) for wi in ws])
    row["cublas_rotate_read_us"] = _rot_us([lambda wi=wi: torch.nn.functional.linear(x, wi) for wi in ws], "read")
    del ws, w
    pw = pws[0]
    y = fk.splice_linear(x, pw)  # autotunes with the package timer (read flush)
    cfg = fk_tuning.TUNED.get(fk_api.linear_key(fk.datapath_for(M), M, pw, True, False, x.dtype, False))
    row["config"] = str(cfg)
    row["rel_err"] = relative_error(y, reference_linear(x, qw, out_dtype=torch.float32))
    for mode in MODES:
        row[f"w4a4_{mode}_us"] = _us(lambda: fk.splice_linear(x, pw, config=cfg), mode)
    lin = [lambda p=p: fk.splice_linear(x, p, config=cfg) for p in pws]
    row["w4a4_rotate_us"] = _rot_us(lin)
    row["w4a4_rotate_read_us"] = _rot_us(lin, "read")
    if isinstance(cfg, fk.FragmentConfig) and not (cfg.quant_in and M <= 4):
        row["w4a4_pdl_on_us"] = _rot_us([with_pdl(True, f) for f in lin])
        row["w4a4_pdl_off_us"] = _rot_us([with_pdl(False, f) for f in lin])
        row["pdl_errors"] = list(fk_api.PDL_ERRORS)
    gs = torch.tensor([2.0], device="cuda")
    ys = fk.splice_linear(x, pw, input_global_scale=gs)
    cfg_s = fk_tuning.TUNED.get(fk_api.linear_key(fk.datapath_for(M), M, pw, True, True, x.dtype, False))
    row["static_config"] = str(cfg_s)
    row["static_rel_err"] = relative_error(ys, reference_linear(x, qw, input_global_scale=gs, out_dtype=torch.float32))
    row["w4a4_static_rotate_us"] = _rot_us([lambda p=p: fk.splice_linear(x, p, input_global_scale=gs, config=cfg_s) for p in pws])
    calls = [stream_call(p, sink) for p in pws]
    row["stream_us"] = _rot_us([c[0] for c in calls])
    row["stream_bytes"] = calls[0][1]
    row["stream_TBps"] = row["stream_bytes"] / (row["stream_us"] * 1e-6) / 1e12
    row["w4a4_TBps"] = row["stream_bytes"] / (row["w4a4_rotate_us"] * 1e-6) / 1e12
    row["cublas_TBps"] = N * K * 2 / (row["cublas_rotate_us"] * 1e-6) / 1e12
    return row


def markdown(res: dict) -> str:
    p = res["provenance"]
    lines = [f"# Issue 36 item 0: timer flush, PDL, streaming ceiling ({res.get('gpu', '?')}, {res.get('date_utc', '')} UTC)", "",
             f"Commit `{p['commit']}`, kernels sha256 `{p['kernels_sha256'][:16]}`, Triton {p['triton']}. Command "
             f"`{res.get('command', '')}`. µs per call, foursight.kernels.tuning.time_gpu; `rot` = rotated weight copies "
             f"(no flush), `rot+read` = rotated copies with the read flush. Copy ceiling {res.get('ceilings', {}).get('copy_TBps', 0):.2f} TB/s.", "",
             "| N×K | M | cuBLAS memset / read / none / rot / rot+read | W4A4 memset / read / none / rot / rot+read | PDL on / off | "
             "static | stream µs (TB/s) | W4A4 TB/s | cuBLAS TB/s | tile | static tile |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda r, key: f"{r[key]:.1f}" if isinstance(r.get(key), float) else "–"  # noqa: E731
    for r in res["rows"]:
        cb = " / ".join(f(r, f"cublas_{m}_us") for m in (*MODES, "rotate", "rotate_read"))
        w4 = " / ".join(f(r, f"w4a4_{m}_us") for m in (*MODES, "rotate", "rotate_read"))
        lines.append(f"| {r['N']}×{r['K']} | {r['M']} | {cb} | {w4} | {f(r, 'w4a4_pdl_on_us')} / {f(r, 'w4a4_pdl_off_us')} | "
                     f"{f(r, 'w4a4_static_rotate_us')} | {f(r, 'stream_us')} ({r.get('stream_TBps', 0):.2f}) | {r.get('w4a4_TBps', 0):.2f} | "
                     f"{r.get('cublas_TBps', 0):.2f} | {r.get('config', r.get('error', ''))} | {r.get('static_config', '')} |")
    if res.get("not_run"):
        lines += ["", f"Not run (time budget): {', '.join(res['not_run'])}."]
    return "\n".join(lines) + "\n"


def layers_for(N: int, K: int, k: int):
    w = torch.randn(N, K, device="cuda") * 0.02
    ch = torch.sort(torch.randperm(K, device="cuda")[:k]).values.to(torch.int32)
    qw = quantize_weight(w, ch)
    pw = fk.prepare_weight(qw)
    r = bsg._rotations(N * K // 2 + N * K // 16 + N * k * 2)
    return qw, [pw] + [bsg._clone_prepared(pw) for _ in range(r - 1)]


def ncu_target(args) -> None:
    """Per M: warm up and autotune, then one W4A4 call and one cuBLAS call inside the profiler range."""
    N, K = (int(v) for v in args.shapes.split(",")[0].split("x"))
    qw, pws = layers_for(N, K, args.k)
    pw = pws[0]
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    chosen = {}
    if args.configs_from and Path(args.configs_from).exists():  # the tiles the probe's autotuner chose
        from foursight.kernels.configs import config_from_str

        for r in json.loads(Path(args.configs_from).read_text()).get("rows", []):
            if r.get("config") and r["config"] != "None":
                chosen[(r["N"], r["K"], r["M"])] = config_from_str(r["config"])
    for M in (int(v) for v in args.ms.split(",")):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        cfg = chosen.get((N, K, M))
        for _ in range(3):
            fk.splice_linear(x, pw, config=cfg)
            torch.nn.functional.linear(x, w)
        if cfg is None:
            cfg = fk_tuning.TUNED.get(fk_api.linear_key(fk.datapath_for(M), M, pw, True, False, x.dtype, False))
        print(f"[probe_v4 ncu] M={M} {N}x{K} k={args.k} tile {cfg}", file=sys.stderr, flush=True)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fk.splice_linear(x, pw, config=cfg)
        torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/probe_v4")
    ap.add_argument("--shapes", default="8192x8192,14336x4096")
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=90.0)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--ncu-target", action="store_true")
    ap.add_argument("--configs-from", default="", help="--ncu-target: probe_v4.json whose rows name the tile per (N, K, M)")
    args = ap.parse_args()
    if args.ncu_target:
        return ncu_target(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"provenance": bsg.provenance(), "args": vars(args), "command": " ".join(sys.argv), "rows": [],
           "timer": fk_tuning.time_gpu.__doc__.split("\n\n")[0], "default_flush": fk_tuning.DEFAULT_FLUSH}
    if args.dry_run:
        res["dry_run"] = True
        (out / "probe_v4.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return
    if not torch.cuda.is_available():
        sys.exit("probe_v4: needs a CUDA GPU")
    res.update(gpu=torch.cuda.get_device_name(0), date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
    t0 = time.time()
    n = 2**30
    a = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    res["ceilings"] = {"copy_TBps": 2 * n / (fk_tuning.time_gpu(lambda: b.copy_(a), flush="none") * 1e-3) / 1e12}
    del a, b
    sink = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        if time.time() - t0 > args.budget_s:
            res.setdefault("not_run", []).append(shape)
            continue
        qw, pws = layers_for(N, K, args.k)
        for M in (int(v) for v in args.ms.split(",")):
            if time.time() - t0 > args.budget_s:
                res.setdefault("not_run", []).append(f"{shape} M={M}")
                continue
            try:
                row = row_for(N, K, M, args.k, qw, pws, sink)
            except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
                row = {"N": N, "K": K, "M": M, "k": args.k, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            (out / "probe_v4.json").write_text(json.dumps(res, indent=1))
            (out / "probe_v4.md").write_text(markdown(res))
        del qw, pws
    res["tune_log"] = {str(k): [(str(c), t, e) for c, t, e in v] for k, v in fk_tuning.TUNE_LOG.items()}
    (out / "probe_v4.json").write_text(json.dumps(res, indent=1))
    (out / "probe_v4.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
