#!/usr/bin/env python
"""Why the BF16 columns of the fragment form cost more than their bytes: the k = 0 and k = 128 variants of
the fragment kernel compiled offline for sm_90a **as one H100 launch would build them**, side by side.

For each case (a configuration tag, M, N x K, k BF16 columns) this script repeats what
:func:`foursight.kernels.fragment.fragment_launch` does on the GPU, without a GPU:

* the variant compiled for the resident-program estimate (the launcher's ``warmup`` call), its registers
  and shared memory, and the programs per SM the CUDA occupancy rule gives on an H100 (132 SMs, 64 K
  registers, 228 KiB shared memory and 2048 threads per SM: ``torch.cuda.get_device_properties``);
* the split plan (:func:`~foursight.kernels.split_k.split_plan`) and the BF16-segment plan
  (:func:`~foursight.kernels.split_k.segment_plan`) that estimate gives;
* the variant actually launched, with the launch's integer specialization (Triton marks an int argument
  divisible by 16, and makes one equal to 1 a constant), its registers, spill stack, shared memory and
  programs per SM, and the waves its grid takes;
* where its instructions sit: the loads issued before the FP4 main loop, the shared-memory stores among
  them that come **before the main loop's first asynchronous copy** (each such store waits for the
  column loads it stores, so the FP4 stream starts only after they arrived), the main loop's length, and
  what runs between the main loop and the split's first workspace store (the columns' tail: its loops,
  MMAs, loads, barriers).

Usage::

    python benchmarks/kernels/sass_columns.py --out benchmarks/results/sass/columns_<label>.json
    PYTHONPATH=/path/to/triton-3.6 python benchmarks/kernels/sass_columns.py ...   # the device's Triton

Static counts, a guide to where the time can go, not a timing. Writes a JSON (commit, kernels sha256,
Triton version, every figure) and, next to it, a markdown table of the same numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import git_commit, kernels_sha256  # noqa: E402  (benchmarks/common.py)
from sass import compile_kernel, instructions, opcode, sass_of  # noqa: E402  (benchmarks/kernels/sass.py)

#: the H100 80GB HBM3 of the 2026-12-06 run (torch.cuda.get_device_properties)
H100 = dict(sms=132, regs=65536, smem=233472, threads=2048)

#: (label, M, configuration tag, k): the measured cells of benchmarks/results/h100-2026-12-06-v4/splice_gemm.json
#: (8192 x 8192, W4A4: w4a4_k0_config and w4a4_k128_config) and the columns-late candidates
CASES = (
    ("M=16 k=0", 16, "fragment/16/64/256/3/0/128/4/True/False/False/8", 0),
    ("M=16 k=128", 16, "fragment/16/64/256/3/0/128/4/True/False/False/8", 128),
    ("M=64 k=0", 64, "fragment/64/64/128/3/0/0/4/False/False/False/1", 0),
    ("M=64 k=128", 64, "fragment/64/64/128/3/0/0/4/False/False/False/8", 128),
)
N = K = 8192


def _spec(v: int):
    """Triton's launch specialization of an int argument: ('constexpr', 1), ('i32', 'D') (divisible by 16) or ('i32', '')."""
    if v == 1:
        return "constexpr", 1
    return "i32", "D" if v % 16 == 0 else ""


def _resource(compiled) -> dict:
    """REG and STACK of the cubin (``cuobjdump --dump-resource-usage``) and Triton's shared-memory size."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", out)
    return {"regs": int(m.group(1)), "stack_bytes": int(m.group(2)), "shared_bytes": int(compiled.metadata.shared)}


def per_sm(res: dict, num_warps: int) -> dict:
    """Programs per SM on the H100 by the CUDA occupancy rule, as :func:`foursight.kernels.runtime.resident_programs`."""
    warp_regs = -(-max(res["regs"], 1) * 32 // 256) * 256
    by_regs = H100["regs"] // (warp_regs * num_warps)
    by_smem = H100["smem"] // (res["shared_bytes"] + 1024)
    by_threads = H100["threads"] // (32 * num_warps)
    return {"by_regs": by_regs, "by_smem": by_smem, "per_sm": max(1, min(by_regs, by_smem, by_threads, 32))}


def _compile(fn, values: dict, ptr_types: dict, consts: dict, opts: dict):
    params = inspect.signature(fn.fn).parameters
    consts = {**{p: v.default for p, v in params.items() if "constexpr" in str(v.annotation) and v.default is not v.empty},
              **{k: v for k, v in consts.items() if k in params}}
    sig, div16 = {}, []
    for p in params:
        if p in consts:
            sig[p] = "constexpr"
        elif p in ptr_types:
            sig[p], _ = ptr_types[p], div16.append(p)
        else:
            ty, attr = _spec(values[p])
            if ty == "constexpr":
                sig[p] = "constexpr"
                consts[p] = 1
            else:
                sig[p] = ty
                if attr == "D":
                    div16.append(p)
    return compile_kernel(fn, 90, sig, consts, div16, **opts)


def layout(sass: str) -> dict:
    """Where the instructions sit relative to the FP4 main loop (the first loop with asynchronous copies)."""
    ins = [(a, t, opcode(t)) for a, t in instructions(sass)]
    idx = {a: i for i, (a, _t, _o) in enumerate(ins)}
    loops = []
    for i, (a, t, _o) in enumerate(ins):
        m = re.search(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?(0x[0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in idx:
            loops.append((idx[int(m.group(1), 16)], i))
    main = next((lp for lp in loops if any(o.startswith("LDGSTS") for _a, _t, o in ins[lp[0]:lp[1] + 1])), None)
    if main is None:
        return {"error": "no loop with asynchronous copies"}
    first_async = next(i for i, (_a, _t, o) in enumerate(ins) if o.startswith("LDGSTS"))

    def count(lo: int, hi: int, *prefixes: str) -> int:
        return sum(1 for _a, _t, o in ins[lo:hi] if o.startswith(prefixes))

    pre_ldg = [o for _a, _t, o in ins[:first_async] if o.startswith("LDG") and not o.startswith("LDGSTS")]
    sts_before = count(0, first_async, "STS")
    end = main[1] + 1
    # the split's first workspace store: the first STG after the main loop
    tail_end = next((i for i in range(end, len(ins)) if ins[i][2].startswith("STG")), len(ins))
    tail_loops = [lp for lp in loops if end <= lp[0] < tail_end]
    tail_ldg = [o for _a, _t, o in ins[end:tail_end] if o.startswith("LDG")]
    return {
        "instructions": len(ins),
        "first_async_copy_at": first_async,
        "loads_before_first_async_copy": len(pre_ldg),
        "load_kinds_before_first_async_copy": {k: pre_ldg.count(k) for k in sorted(set(pre_ldg))},
        "shared_stores_before_first_async_copy": sts_before,
        "main_loop": {"start": main[0], "end": main[1], "instructions": main[1] - main[0] + 1,
                      "hgmma": count(main[0], end, "HGMMA"), "async_copies": count(main[0], end, "LDGSTS"),
                      "bar_sync": count(main[0], end, "BAR")},
        "tail": {"instructions": tail_end - end, "loops": [b - a + 1 for a, b in tail_loops],
                 "hgmma": count(end, tail_end, "HGMMA"), "ldg": count(end, tail_end, "LDG"),
                 "ldg_kinds": {k: tail_ldg.count(k) for k in sorted(set(tail_ldg))},
                 "sts": count(end, tail_end, "STS"), "lds": count(end, tail_end, "LDS"), "bar_sync": count(end, tail_end, "BAR"),
                 "warpgroup_waits": count(end, tail_end, "WARPGROUP.DEPBAR"), "local_memory": count(end, tail_end, "STL", "LDL")},
        "local_memory_ops": count(0, len(ins), "STL", "LDL"),
        "local_memory_ops_in_main_loop": count(main[0], end, "STL", "LDL"),
        "sass_sha256": hashlib.sha256("\n".join(t for _a, t, _o in ins).encode()).hexdigest()[:16],
    }


def _package():
    """(fragment module, split_plan, segment_plan, SCALES_AS_BF16, DIV6_RECIP_ON_CUDA) of the imported package:
    today's modules, or where commit add1f24 (the H100 run) kept them (fragment.py, act_quant.py)."""
    import importlib

    frag = importlib.import_module("foursight.kernels.fragment")
    try:
        sk = importlib.import_module("foursight.kernels.split_k")
    except ImportError:
        sk = frag
    try:
        layout_mod = importlib.import_module("foursight.kernels.fragment_layout")
    except ImportError:
        layout_mod = frag
    prim = importlib.import_module("foursight.kernels.primitives")
    div6 = getattr(prim, "DIV6_RECIP_ON_CUDA", None)
    if div6 is None:
        div6 = importlib.import_module("foursight.kernels.act_quant").DIV6_RECIP_ON_CUDA
    return frag, sk.split_plan, sk.segment_plan, layout_mod.SCALES_AS_BF16, div6


def case_row(label: str, m: int, tag: str, kk: int, dense: bool = False) -> dict:
    from foursight.kernels.configs import config_from_str

    frag, split_plan, segment_plan, SCALES_AS_BF16, DIV6_RECIP_ON_CUDA = _package()

    cfg = config_from_str(tag)
    bm, bn, bk, nw = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps
    kcp, step = K // 128, bk // 128
    tiles = triton.cdiv(m, bm) * triton.cdiv(N, bn)
    a_rows = frag.a_rows_for(m, bm) if cfg.narrow else 0
    consts = dict(A_QUANT=True, HAS_BIAS=False, HAS_KS=kk > 0, SCALE_BF16=SCALES_AS_BF16, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                  BLOCK_KS=16, GROUP_M=8, INTERP=False, A_ROWS=a_rows, QUANT_IN=False, DIV6_RECIP=DIV6_RECIP_ON_CUDA,
                  PERSISTENT=cfg.persistent)
    late = bool(getattr(cfg, "cols_late", False))
    if late or dense:
        consts.update(SEG_LATE=late, XS_DENSE=dense and kk > 0)
    opts = {"num_warps": nw, "num_stages": cfg.num_stages, **({"maxnreg": cfg.max_regs} if cfg.max_regs else {})}
    scale_cols = K // 16 if SCALES_AS_BF16 else K // 32
    ptrs = {"a_ptr": "*bf16", "a_gs_ptr": "*fp32", "x_ptr": "*bf16", "ch_ptr": "*i32" if kk else "*u8", "wf_ptr": "*i32",
            "sf_ptr": "*i16", "w_gs_ptr": "*fp32", "wb_ptr": "*bf16" if kk else "*fp32", "bias_ptr": "*fp32",
            "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "smask_ptr": "*u8"}
    base = dict(stride_am=K, stride_xm=kk if dense else K, stride_wfn=K // 8, stride_sfn=scale_cols, stride_wbn=kk, stride_om=N,
                M=m, N=N, K=K, KS=kk, KCP=kcp, NP=N, TILES=tiles)
    # the launcher's resident-program estimate: the warmup variant (splits 2, 16 chunks, segment 16, SPLIT)
    est = _compile(frag._fragment_gemm_kernel, {**base, "SPLITS": 2, "CHUNKS_PER_SPLIT": 16, "FIRST_CHUNKS": 16, "SEG_PER_SPLIT": 16},
                   ptrs, {**consts, "SPLIT": True}, opts)
    est_res = _resource(est)
    est_occ = per_sm(est_res, nw)
    slots = est_occ["per_sm"] * H100["sms"]
    splits, cps, first = split_plan(m, N, kcp, kk, bm, bn, step, cfg.split_k, slots)
    bks, seg = segment_plan(kk, splits, late=True) if late else segment_plan(kk, splits)
    consts["BLOCK_KS"] = bks
    launched = _compile(frag._fragment_gemm_kernel, {**base, "SPLITS": splits, "CHUNKS_PER_SPLIT": cps, "FIRST_CHUNKS": first,
                                                      "SEG_PER_SPLIT": seg}, ptrs, {**consts, "SPLIT": splits > 1}, opts)
    res = _resource(launched)
    occ = per_sm(res, nw)
    cols = [max(0, min(kk, (p + 1) * seg) - p * seg) for p in range(splits)] if kk else [0] * splits
    programs = tiles * splits
    steps = [-(-c // bks) for c in cols]
    gathered = 0 if dense else tiles * sum(cols) * m  # X[:, S] elements gathered by channel index, all programs
    return {
        "case": label, "M": m, "N": N, "K": K, "k": kk, "config": tag, "x_s": "dense (the quantizer's copy)" if dense else "gathered from X",
        "estimate_variant": {**est_res, **est_occ, "slots": slots},
        "plan": {"tiles": tiles, "splits": splits, "chunks_per_split": cps, "programs": programs, "block_ks": bks,
                 "columns_per_split": cols,
                 "column_steps_before_the_loop": [0 if late else min(1, t) for t in steps],
                 "column_steps_after_the_loop": [t if late else max(0, t - 1) for t in steps],
                 # each gathered 2-byte element is about one 32-byte sector of its own (random channels):
                 # an upper bound of the gather's L2 -> SM traffic; W[:, S] is N x k x 2 bytes
                 "x_s_gathered_elements": gathered, "x_s_gather_sector_bytes_upper_bound": gathered * 32,
                 "w_s_bytes": N * kk * 2,
                 # what every tile reads besides: the activation tile over all of K (from L2) and the FP4 weight
                 "a_bytes_all_tiles": tiles * m * K * 2, "fp4_bytes": N * K * 9 // 16},
        "launched_variant": {**res, **occ, "slots": occ["per_sm"] * H100["sms"],
                             "waves": round(programs / (occ["per_sm"] * H100["sms"]), 2)},
        "sass": layout(sass_of(launched)),
    }


def write_md(res: dict, path: str) -> None:
    rows = res["cases"]
    lines = [
        "# The BF16 columns in the compiled fragment kernel (sm_90a, offline)",
        "",
        f"Commit `{res['commit'][:12]}`, kernels sha256 `{res['kernels_sha256'][:16]}`, Triton {res['triton']}, "
        f"target {res['target']}. Written by `benchmarks/kernels/sass_columns.py` (its docstring defines every column). "
        "8192 x 8192, W4A4, the H100's occupancy rule (132 SMs). Static counts, not a timing.",
        "",
        "| case | config | X[:, S] | regs (stack B) | shared KiB | programs/SM (estimate / launched) | splits x tiles | columns per split | "
        "column steps before / after the loop | loads before the FP4 stream starts | shared stores waiting on them | main loop instr. | "
        "tail instr. (loops, static) | tail HGMMA / LDG / BAR | X[:, S] gather sectors (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, lv, ev, p = r["sass"], r["launched_variant"], r["estimate_variant"], r["plan"]
        t = s.get("tail", {})
        lines.append(
            f"| {r['case']} | `{r['config']}` | {r['x_s'] if r['k'] else '–'} | {lv['regs']} ({lv['stack_bytes']}) | {lv['shared_bytes'] / 1024:.1f} | "
            f"{ev['per_sm']} / {lv['per_sm']} | {p['splits']} x {p['tiles']} | {p['columns_per_split']} | "
            f"{p['column_steps_before_the_loop']} / {p['column_steps_after_the_loop']} | "
            f"{s.get('loads_before_first_async_copy')} | {s.get('shared_stores_before_first_async_copy')} | "
            f"{s.get('main_loop', {}).get('instructions')} | {t.get('instructions')} ({t.get('loops')}) | "
            f"{t.get('hgmma')} / {t.get('ldg')} / {t.get('bar_sync')} | {p['x_s_gather_sector_bytes_upper_bound'] / 1e6:.1f} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON to write (a .md with the same stem beside it)")
    ap.add_argument("--cases", default="", help="comma-separated case labels (default: all)")
    args = ap.parse_args(argv)
    want = {c.strip() for c in args.cases.split(",") if c.strip()}
    rows = []
    for label, m, tag, kk, *dense in CASES + extra_cases():
        if want and label not in want:
            continue
        rows.append(case_row(label, m, tag, kk, *dense))
        r = rows[-1]
        print(f"{label:28s} {tag:52s} regs {r['launched_variant']['regs']:3d} stack {r['launched_variant']['stack_bytes']:3d} "
              f"per SM {r['estimate_variant']['per_sm']}/{r['launched_variant']['per_sm']} splits {r['plan']['splits']} "
              f"cols {r['plan']['columns_per_split']} pre-loads {r['sass']['loads_before_first_async_copy']} "
              f"pre-STS {r['sass']['shared_stores_before_first_async_copy']} loop {r['sass']['main_loop']['instructions']} "
              f"tail {r['sass']['tail']}", flush=True)
    res = {"commit": os.environ.get("SASS_COMMIT") or git_commit(), "kernels_sha256": kernels_sha256(),
           "triton": triton.__version__, "target": "sm_90a (GPUTarget cuda 90)", "machine": H100, "cases": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    write_md(res, os.path.splitext(args.out)[0] + ".md")
    print(f"wrote {args.out}")


def extra_cases() -> tuple:
    """The ``cols_late`` candidates of :mod:`foursight.kernels.configs` (if the imported package has them) at
    k = 128, with X[:, S] gathered (as ``splice_linear`` runs them) and read dense (``fragment_launch(xs=...)``)."""
    try:
        from foursight.kernels.configs import COLUMNS_LATE_CONFIGS
    except ImportError:
        return ()
    out = []
    for c in COLUMNS_LATE_CONFIGS:
        out.append((f"M={c.block_m} k=128 cols_late", c.block_m, str(c), 128, False))
        out.append((f"M={c.block_m} k=128 cols_late + dense X[:, S]", c.block_m, str(c), 128, True))
    return tuple(out)


if __name__ == "__main__":
    main(sys.argv[1:])
