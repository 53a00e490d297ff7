#!/usr/bin/env python
"""The register-streaming Gluon form (:mod:`foursight.kernels.experimental.gluon_stream`, issue 36 item 3) against the
autotuned default (the fragment form) and cuBLAS BF16 on a CUDA sm_90 GPU.

For each shape, M and k (BF16 columns), on random layers with rotated weight copies (as
:mod:`bench_splice_gemm` times them, the read flush before each pass), the W4A4 call with a dynamic
activation scale (quantizer + GEMM):

* ``cublas``: ``F.linear`` in BF16, timed before and after the FourSight rows (the minimum is the baseline);
* ``auto``: ``splice_linear`` with the autotuner's choice among the default candidates (the configuration is
  recorded);
* one column per :data:`~foursight.kernels.configs.STREAM_CONFIGS` tile the autotuner offers at that M
  (:func:`foursight.kernels.api.stream_candidates`), forced;
* ``quant``: the quantizer alone (8 programs per row, with the ``X[:, S]`` copy where k > 0), so that the
  GEMM's own time and streaming rate can be estimated (call minus quantizer, an upper bound on the rate:
  the two overlap only across calls).

Each form is timed in ``--rounds`` interleaved rounds (minimum written, every round kept), checked against
``reference_linear`` (relative error) and for bit-identity over three calls.

Usage (GPU)::

    python benchmarks/kernels/probe_stream.py --out $OUT/stream [--shapes 8192x8192,...] [--ms 1,16] [--budget-s 200]
    python benchmarks/kernels/probe_stream.py --out /tmp/s --dry-run     # CPU: provenance and the plan only

Writes ``stream.json`` and ``stream.md`` (after every row).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_splice_gemm as bsg  # noqa: E402  (benchmarks/kernels/bench_splice_gemm.py)
from probe_v4 import _rot_us, layers_for  # noqa: E402  (rotated copies; their timing with a flush)

import foursight.kernels.act_quant as fk_aq  # noqa: E402
import foursight.kernels.api as fk  # noqa: E402
import foursight.kernels.tuning as fk_tuning  # noqa: E402
from foursight.channels import relative_error  # noqa: E402
from foursight.kernels.configs import STREAM_CONFIGS  # noqa: E402
from foursight.layer import reference_linear  # noqa: E402

SHAPES = "8192x8192,14336x4096,4096x14336"


def weight_bytes(N: int, K: int, k: int) -> int:
    """Bytes of the fragment form the GEMM streams: 0.5625 B a weight plus the BF16 columns."""
    return N * K * 9 // 16 + N * k * 2


def row_for(N: int, K: int, M: int, k: int, qw, pws, rounds: int) -> dict:
    row = {"N": N, "K": K, "M": M, "k": k}
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    ws = [w] + [w.clone() for _ in range(bsg._rotations(N * K * 2) - 1)]
    cublas = [lambda wi=wi: torch.nn.functional.linear(x, wi) for wi in ws]
    row["cublas_before_us"] = round(_rot_us(cublas, "read"), 2)
    ref = reference_linear(x, qw, out_dtype=torch.float32)
    fns = {"auto": [lambda p=p: fk.splice_linear(x, p) for p in pws]}
    y = fns["auto"][0]()  # autotunes with the package timer
    row["auto_config"] = str(fk_tuning.TUNED.get(fk.linear_key(fk.datapath_for(M), M, pws[0], True, False, x.dtype, False)))
    row["auto_rel_err"] = relative_error(y, ref)
    for cfg in fk.stream_candidates(M):  # the tiles the autotuner offers at this M
        tag = str(cfg)
        try:
            y1 = fk.splice_linear(x, pws[0], config=cfg)
            torch.cuda.synchronize()
            row[f"{tag}_rel_err"] = relative_error(y1, ref)
            row[f"{tag}_repeat_identical"] = all(torch.equal(fk.splice_linear(x, pws[0], config=cfg), y1) for _ in range(2))
            fns[tag] = [lambda p=p, c=cfg: fk.splice_linear(x, p, config=c) for p in pws]
        except Exception as e:  # noqa: BLE001 - record a failing tile, keep the others
            row[f"{tag}_error"] = f"{type(e).__name__}: {str(e)[:600]}"
    fns["quant"] = [lambda p=p: fk_aq.act_quant_launch(x, p.channel_mask, p.bf16_channels, None, False, True, k > 0,
                                                       deq_dtype=torch.bfloat16, cols=8)[2] for p in pws]
    names = list(fns)
    for r in range(rounds):
        for v in (names if r % 2 == 0 else names[::-1]):
            row.setdefault(f"{v}_us_rounds", []).append(round(_rot_us(fns[v], "read"), 2))
    for v in names:
        row[f"{v}_us"] = min(row[f"{v}_us_rounds"])
    row["cublas_after_us"] = round(_rot_us(cublas, "read"), 2)
    row["cublas_us"] = min(row["cublas_before_us"], row["cublas_after_us"])
    wb = weight_bytes(N, K, k)
    for v in names:
        if v != "quant":
            row[f"{v}_x_cublas"] = round(row["cublas_us"] / row[f"{v}_us"], 3)
            gemm = row[f"{v}_us"] - row["quant_us"]
            row[f"{v}_gemm_tbps"] = round(wb / gemm / 1e6, 2) if gemm > 0 else None
    del ws, w
    return row


def markdown(res: dict) -> str:
    p = res["provenance"]
    tags = [str(c) for c in STREAM_CONFIGS]
    lines = [f"# The register-streaming Gluon form on {res.get('gpu', '?')} ({res.get('date_utc', '')} UTC)", "",
             f"Commit `{p['commit']}`, kernels sha256 `{p['kernels_sha256'][:16]}`, Triton {p['triton']}, torch {p['torch']}. "
             f"Command `{res['command']}`. W4A4 with a dynamic activation scale (quantizer + GEMM), µs per call, minimum over "
             "the rounds (every round in stream.json), rotated weight copies with the read flush. cuBLAS: the faster of its "
             "timings before and after the FourSight rows. `x` = cuBLAS / call; TB/s = the fragment bytes (0.5625 B a weight "
             "plus the BF16 columns) over (call − quantizer alone).", "",
             "| N×K | M | k | cuBLAS (before / after) | auto (x, TB/s) | " + " | ".join(f"`{t}` (x, TB/s)" for t in tags)
             + " | quantizer | rel err auto / stream | repeat bit-identical |",
             "|---|---|---|---|---|" + "---|" * len(tags) + "---|---|---|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['N']}×{r['K']} | {r['M']} | {r['k']} | error: {r['error'][:300]} |")
            continue

        def c(v):
            if f"{v}_us" not in r:  # failed, or a tile not offered at this M
                return "error" if f"{v}_error" in r else "—"
            return f"{r[f'{v}_us']:.1f} ({r[f'{v}_x_cublas']:.2f}x, {r[f'{v}_gemm_tbps']})"
        errs = " / ".join(f"{r[f'{t}_rel_err']:.1e}" for t in tags if f"{t}_rel_err" in r)
        reps = ", ".join(str(r.get(f"{t}_repeat_identical", "-")) for t in tags)
        lines.append(f"| {r['N']}×{r['K']} | {r['M']} | {r['k']} | {r['cublas_us']:.1f} ({r['cublas_before_us']:.1f} / "
                     f"{r['cublas_after_us']:.1f}) | {c('auto')} | " + " | ".join(c(t) for t in tags)
                     + f" | {r['quant_us']:.1f} | {r['auto_rel_err']:.1e} / {errs} | {reps} |")
    lines += ["", "auto's tiles: " + "; ".join(f"{r['N']}×{r['K']} M = {r['M']} k = {r['k']}: `{r.get('auto_config')}`"
                                               for r in res["rows"] if "error" not in r)]
    errs = [f"{r['N']}×{r['K']} M={r['M']} k={r['k']} `{t}`: {r[f'{t}_error'][:300]}" for r in res["rows"] for t in tags
            if f"{t}_error" in r]
    if errs:
        lines += ["", "Errors:", *[f"- {e}" for e in errs]]
    if res.get("not_run"):
        lines += ["", f"Not run (time budget): {', '.join(res['not_run'])}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/stream")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--ks", default="0,128")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"provenance": bsg.provenance(), "args": vars(args), "command": " ".join(sys.argv), "rows": [],
           "stream_configs": [str(c) for c in STREAM_CONFIGS]}
    if args.dry_run:
        res["dry_run"] = True
        (out / "stream.json").write_text(json.dumps(res, indent=1))
        print(json.dumps({k: v for k, v in res.items() if k != "provenance"}, indent=1))
        return
    if not torch.cuda.is_available():
        sys.exit("probe_stream: needs a CUDA GPU")
    res.update(gpu=torch.cuda.get_device_name(0), date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
    t0 = time.time()
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        for k in (int(v) for v in args.ks.split(",")):
            qw, pws = layers_for(N, K, k)
            for M in (int(v) for v in args.ms.split(",")):
                if time.time() - t0 > args.budget_s:
                    res.setdefault("not_run", []).append(f"{shape} M={M} k={k}")
                    continue
                try:
                    row = row_for(N, K, M, k, qw, pws, args.rounds)
                except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
                    row = {"N": N, "K": K, "M": M, "k": k, "error": f"{type(e).__name__}: {str(e)[:600]}"}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                (out / "stream.json").write_text(json.dumps(res, indent=1))
                (out / "stream.md").write_text(markdown(res))
            del qw, pws
            torch.cuda.empty_cache()
    print(markdown(res))


if __name__ == "__main__":
    main()
