#!/usr/bin/env python
"""What the BF16 columns of the fragment form cost on a CUDA GPU, and what ``FragmentConfig.cols_late``
and a dense ``X[:, S]`` change (issue 36 item 1; the offline analysis is in docs/kernels.md, "Why the
columns cost more than their bytes").

For each shape and M, on layers with k = 0 and k = 128 BF16 columns (random weights, rotated copies as
:mod:`bench_splice_gemm` times them, the read flush before each pass), the W4A4 call with a dynamic
activation scale (quantizer + GEMM), every variant with a **forced** configuration (no autotuning):

* ``k0``: the k = 0 layer with the tile the H100 grid chose for k = 0 (``w4a4_k0_config`` of
  benchmarks/results/h100-2026-12-06-v4/splice_gemm.json), ``k0_same``: the k = 0 layer with the k = 128
  tile (at M = 64 the two differ in the quantizer's ``q_split``);
* ``k128``: the k = 128 layer with the k = 128 tile the grid chose (the columns loaded before the FP4 loop);
* ``late``: the same tile with ``cols_late`` (the columns loaded after the loop), through ``splice_linear``;
* ``late_dense`` / ``dense``: the quantizer also writes ``X[:, S]`` contiguous (``write_xs``) and the GEMM
  reads it densely (``fragment_launch(xs=...)``), with and without ``cols_late`` (at 48451cc
  ``splice_linear`` asked for the copy for ``cols_late`` tiles only, so ``late`` read it too; since the
  H100 measured ``dense`` cheapest, ``api.linear_run`` asks for it for every fragment tile);
* ``quant`` / ``quant_xs``: the quantizer alone without and with the ``X[:, S]`` copy.

Each variant is timed in ``--rounds`` interleaved rounds (the minimum and every round are written), and
checked against ``reference_linear`` (relative error) and, where the arithmetic is the same, bit for bit
against ``k128`` (dense vs gathered ``X[:, S]``; ``late`` where every split's columns are one step of the
same width in both plans, M = 16 here).

Usage (GPU)::

    python benchmarks/kernels/probe_columns.py --out $OUT/columns [--shapes 8192x8192] [--ms 16,64] [--budget-s 180]
    python benchmarks/kernels/probe_columns.py --out /tmp/c --dry-run     # CPU: provenance and the plan only

Writes ``columns.json`` and ``columns.md`` (after every row).
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
from foursight.channels import relative_error  # noqa: E402
from foursight.kernels.configs import config_from_str  # noqa: E402
from foursight.kernels.fragment import fragment_launch  # noqa: E402
from foursight.layer import reference_linear  # noqa: E402

#: M -> (k = 0 tile, k = 128 tile) the H100 grid chose at 8192 x 8192 (splice_gemm.json of h100-2026-12-06-v4)
MEASURED = {
    16: ("fragment/16/64/256/3/0/128/4/True/False/False/8", "fragment/16/64/256/3/0/128/4/True/False/False/8"),
    64: ("fragment/64/64/128/3/0/0/4/False/False/False/1", "fragment/64/64/128/3/0/0/4/False/False/False/8"),
}
VARIANTS = ("k0", "k0_same", "k128", "late", "dense", "late_dense", "quant", "quant_xs")


def late_of(tag: str) -> str:
    return tag + "/True"


def calls(x, pws0, pws, k0_tag: str, k128_tag: str) -> dict:
    """variant -> list of callables (one per rotated layer copy), each returning the output."""
    c0, c1, cl = config_from_str(k0_tag), config_from_str(k128_tag), config_from_str(late_of(k128_tag))
    m, n = x.shape[0], pws[0].out_features

    def dense(cfg, pw):
        _, _, deq, gs, xs = fk_aq.act_quant_launch(x, pw.channel_mask, pw.bf16_channels, None, False, True, True,
                                                   deq_dtype=torch.bfloat16, cols=cfg.q_split)
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
        fragment_launch(cfg, deq, gs, x, pw, None, out, True, xs=xs)
        return out

    def quant(pw, xs: bool):
        return fk_aq.act_quant_launch(x, pw.channel_mask, pw.bf16_channels, None, False, True, xs,
                                      deq_dtype=torch.bfloat16, cols=c1.q_split)[2]

    return {
        "k0": [lambda p=p: fk.splice_linear(x, p, config=c0) for p in pws0],
        "k0_same": [lambda p=p: fk.splice_linear(x, p, config=c1) for p in pws0],
        "k128": [lambda p=p: fk.splice_linear(x, p, config=c1) for p in pws],
        "late": [lambda p=p: fk.splice_linear(x, p, config=cl) for p in pws],
        "dense": [lambda p=p: dense(c1, p) for p in pws],
        "late_dense": [lambda p=p: dense(cl, p) for p in pws],
        "quant": [lambda p=p: quant(p, False) for p in pws],
        "quant_xs": [lambda p=p: quant(p, True) for p in pws],
    }


def row_for(N: int, K: int, M: int, qw0, pws0, qw, pws, rounds: int) -> dict:
    k0_tag, k128_tag = MEASURED[M]
    row = {"N": N, "K": K, "M": M, "k": qw.bf16_channels.numel(), "k0_config": k0_tag, "k128_config": k128_tag,
           "late_config": late_of(k128_tag)}
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    fns = calls(x, pws0, pws, k0_tag, k128_tag)
    ref0 = reference_linear(x, qw0, out_dtype=torch.float32)
    ref = reference_linear(x, qw, out_dtype=torch.float32)
    outs = {v: fns[v][0]() for v in VARIANTS}  # compiles every variant; one output each for the checks
    torch.cuda.synchronize()
    for v in ("k0", "k0_same"):
        row[f"{v}_rel_err"] = relative_error(outs[v], ref0)
    for v in ("k128", "late", "dense", "late_dense"):
        row[f"{v}_rel_err"] = relative_error(outs[v], ref)
    row["dense_equals_k128"] = bool(torch.equal(outs["dense"], outs["k128"]))
    row["late_dense_equals_late"] = bool(torch.equal(outs["late_dense"], outs["late"]))
    row["late_equals_k128"] = bool(torch.equal(outs["late"], outs["k128"]))
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for v in order:
            row.setdefault(f"{v}_us_rounds", []).append(round(_rot_us(fns[v], "read"), 2))
    for v in VARIANTS:
        row[f"{v}_us"] = min(row[f"{v}_us_rounds"])
    for v in ("k128", "late", "dense", "late_dense"):
        row[f"{v}_over_k0_us"] = round(row[f"{v}_us"] - row["k0_same_us"], 2)
    row["columns_bytes"] = N * row["k"] * 2
    return row


def markdown(res: dict) -> str:
    p = res["provenance"]
    lines = [f"# The BF16 columns on {res.get('gpu', '?')} ({res.get('date_utc', '')} UTC)", "",
             f"Commit `{p['commit']}`, kernels sha256 `{p['kernels_sha256'][:16]}`, Triton {p['triton']}, torch {p['torch']}. "
             f"Command `{res['command']}`. W4A4, dynamic activation scale, forced configurations; µs per call, "
             "minimum over the rounds (every round in columns.json), rotated weight copies with the read flush "
             "(foursight.kernels.tuning.time_gpu). `+cols` = the variant minus `k0_same` (the k = 0 layer on the k = 128 tile).", "",
             "| N×K | M | k0 | k0_same | k128 (+cols) | late (+cols) | dense (+cols) | late_dense (+cols) | quant / quant_xs | "
             "columns' bytes | rel err k128 / late / late_dense | bit-identical: dense=k128, late_dense=late, late=k128 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['N']}×{r['K']} | {r['M']} | error: {r['error'][:200]} |")
            continue
        def c(v):
            return f"{r[f'{v}_us']:.1f} ({r[f'{v}_over_k0_us']:+.1f})"
        lines.append(f"| {r['N']}×{r['K']} | {r['M']} | {r['k0_us']:.1f} | {r['k0_same_us']:.1f} | {c('k128')} | {c('late')} | "
                     f"{c('dense')} | {c('late_dense')} | {r['quant_us']:.1f} / {r['quant_xs_us']:.1f} | "
                     f"{r['columns_bytes'] / 1e6:.1f} MB | {r['k128_rel_err']:.1e} / {r['late_rel_err']:.1e} / {r['late_dense_rel_err']:.1e} | "
                     f"{r['dense_equals_k128']}, {r['late_dense_equals_late']}, {r['late_equals_k128']} |")
    lines += ["", "Tiles: " + "; ".join(f"M = {m}: k0 `{a}`, k128 `{b}`, late `{late_of(b)}`" for m, (a, b) in MEASURED.items())]
    if res.get("not_run"):
        lines += ["", f"Not run (time budget): {', '.join(res['not_run'])}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/columns")
    ap.add_argument("--shapes", default="8192x8192")
    ap.add_argument("--ms", default="16,64")
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=180.0)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    if any(m not in MEASURED for m in ms):
        sys.exit(f"probe_columns: --ms must be among {sorted(MEASURED)} (the measured tiles)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"provenance": bsg.provenance(), "args": vars(args), "command": " ".join(sys.argv), "rows": [],
           "variants": VARIANTS, "tiles": {str(m): {"k0": a, "k128": b, "late": late_of(b)} for m, (a, b) in MEASURED.items()}}
    for m in ms:  # the tags parse and the late tile is a candidate of the package
        config_from_str(late_of(MEASURED[m][1]))
    if args.dry_run:
        res["dry_run"] = True
        (out / "columns.json").write_text(json.dumps(res, indent=1))
        print(json.dumps({k: v for k, v in res.items() if k != "provenance"}, indent=1))
        return
    if not torch.cuda.is_available():
        sys.exit("probe_columns: needs a CUDA GPU")
    res.update(gpu=torch.cuda.get_device_name(0), date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
    t0 = time.time()
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        qw0, pws0 = layers_for(N, K, 0)
        qw, pws = layers_for(N, K, args.k)
        for M in ms:
            if time.time() - t0 > args.budget_s:
                res.setdefault("not_run", []).append(f"{shape} M={M}")
                continue
            try:
                row = row_for(N, K, M, qw0, pws0, qw, pws, args.rounds)
            except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
                row = {"N": N, "K": K, "M": M, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            (out / "columns.json").write_text(json.dumps(res, indent=1))
            (out / "columns.md").write_text(markdown(res))
        del qw0, pws0, qw, pws
    print(markdown(res))


if __name__ == "__main__":
    main()
