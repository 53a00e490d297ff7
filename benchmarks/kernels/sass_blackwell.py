#!/usr/bin/env python
"""Compile the dot_scaled form (``foursight.kernels.experimental.dot_scaled``) for sm_100a and sm_120a on a
machine without a GPU, and check that its FP4 main loop runs on the block-scaled FP4 tensor cores.

Triton ships ``ptxas`` (with Blackwell support) and ``cuobjdump``, so ``triton.compile`` with
``GPUTarget("cuda", 100 | 120, 32)`` works on a CPU-only machine (as ``benchmarks/kernels/sass_offline.py``
does for sm_90). For every configuration of ``dot_scaled.CONFIGS``, with and without the BF16
segment, per architecture it checks:

* the PTX holds the block-scaled FP4 MMA with E4M3 scales per 16 elements:
  sm_100a ``tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`` whose instruction descriptor
  (a ``mov.b32`` constant) says E2M1 × E2M1 with UE4M3 scales (bits 7-9 = 1, 10-11 = 1, bit 23 = 0);
  sm_120a ``mma.sync ... kind::mxf4nvf4.block_scale.scale_vec::4X ... e2m1.e2m1 ... ue4m3``;
* the SASS holds the matching instruction (``UTCOMMA.4X`` on sm_100a, ``OMMA.SF...E2M1.E2M1.UE4M3.4X``
  on sm_120a), and no BF16 fallback: without the BF16 segment there is no BF16/FP16 MMA at all
  (``HMMA``, ``UTCHMMA``); with it, no loop that holds a block-scaled MMA also holds a BF16 MMA or a
  float-to-bf16 pack (``F2FP``: Triton's emulation decodes FP4 to bf16 in the loop);
* the shared memory fits the architecture (227 KB on sm_100, 99 KB on sm_120).

It also compiles the configurations for sm_90a (the H200: no FP4 tensor cores, Triton emulates
``dot_scaled`` in BF16 there; reported, not checked) and one deliberately wrong tile (an unswapped 16-row tile, which tcgen05 cannot run in
FP4) and expects the checker to reject it on sm_100a: the check can fail.

Usage::

    python benchmarks/kernels/sass_blackwell.py                                  # print the table
    python benchmarks/kernels/sass_blackwell.py --out benchmarks/results/blackwell_sass   # also .json and .md

Exit status 1 if any shipped configuration fails a check. Compiling is not running: nothing here
says the kernel is correct or fast on Blackwell.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import git_commit  # noqa: E402  (benchmarks/common.py)
from sass import compile_kernel, instructions, loops, opcode, sass_of  # noqa: E402  (benchmarks/kernels/sass.py)

from foursight.kernels.experimental.dot_scaled import CONFIGS, DotScaledConfig, dot_scaled_kernel  # noqa: E402

ARCHS = {100: "sm_100a", 120: "sm_120a"}
SMEM_MAX = {100: 232448, 120: 101376, 90: 232448}
PTRS = {"a_ptr": "*u8", "as_ptr": "*u8", "a_gs_ptr": "*fp32", "wp_ptr": "*u8", "ws_ptr": "*u8", "w_gs_ptr": "*fp32",
        "xs_ptr": "*bf16", "wb_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
#: integer arguments Triton marks divisible by 16 at launch for the shapes served (strides of contiguous rows, K)
DIV16 = ("stride_am", "stride_asm", "stride_wpn", "stride_wsn", "stride_xsm", "stride_wbn", "stride_om", "K")
BF16_MMA = ("HMMA", "UTCHMMA")


def compile_for(cap: int, cfg: DotScaledConfig, has_ks: bool, has_bias: bool = False):
    """``triton.compile`` of the dot_scaled kernel for ``cap`` with launch-like specialization."""
    fn = dot_scaled_kernel
    params = list(inspect.signature(fn.fn).parameters)
    consts = dict(SWAP=cfg.swap, HAS_BIAS=has_bias, HAS_KS=has_ks, EVEN_K=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, BLOCK_KS=cfg.block_ks, GROUP_M=cfg.group_m, EMULATE_MMA=False, INTERP=False,
                  stride_on=1)
    sig = {p: "constexpr" if p in consts else PTRS.get(p, "i32") for p in params}
    div16 = [p for p in params if p in PTRS or p in DIV16]
    return compile_kernel(fn, cap, sig, consts, div16, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _idescs(ptx: str) -> list[int]:
    """Instruction descriptors of the tcgen05 block-scaled MMAs (resolved through ``mov.b32`` constants)."""
    movs = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(-?\d+);", ptx))
    out = []
    for m in re.finditer(r"tcgen05\.mma\.cta_group::\d\.kind::mxf4nvf4\.block_scale\.block16\s+\[[^\]]*\],\s*[^,]+,\s*[^,]+,\s*(%r\d+|\d+)", ptx):
        v = m.group(1)
        out.append(int(movs.get(v, v)) & 0xFFFFFFFF if (v in movs or v.isdigit()) else -1)
    return out


def check(cap: int, compiled, has_ks: bool) -> dict:
    """Every check of the module docstring for one compiled kernel; ``ok`` is their conjunction."""
    ptx, sass = compiled.asm["ptx"], sass_of(compiled)
    ops = collections.Counter(opcode(t) for _, t in instructions(sass))
    if cap == 100:
        fp4_ptx = len(re.findall(r"tcgen05\.mma\.cta_group::\d\.kind::mxf4nvf4\.block_scale\.block16", ptx))
        descs = _idescs(ptx)
        desc_ok = bool(descs) and all(d >= 0 and (d >> 7) & 7 == 1 and (d >> 10) & 3 == 1 and not (d >> 23) & 1 for d in descs)
        fp4_sass = sum(n for op, n in ops.items() if op.startswith("UTCOMMA") and ".4X" in op)
    else:
        fp4_ptx = len(re.findall(r"mma\.sync\.aligned\.m16n8k64\.row\.col\.kind::mxf4nvf4\.block_scale\.scale_vec::4X\.f32\.e2m1\.e2m1\.f32\.ue4m3", ptx))
        descs, desc_ok = [], True
        fp4_sass = sum(n for op, n in ops.items() if op.startswith("OMMA.SF") and "E2M1.E2M1.UE4M3.4X" in op)
    is_fp4 = lambda op: (op.startswith("UTCOMMA") or op.startswith("OMMA.SF"))  # noqa: E731
    is_bf16 = lambda op: op.split(".")[0] in BF16_MMA or op.startswith("F2FP")  # noqa: E731
    bf16_mma = sum(n for op, n in ops.items() if op.split(".")[0] in BF16_MMA)
    fp4_loops = [body for body in loops(sass) if any(is_fp4(op) for op in body)]
    mixed = [body for body in fp4_loops if any(is_bf16(op) for op in body)]
    smem = compiled.metadata.shared
    res = {
        "fp4_mma_ptx": fp4_ptx, "idesc": [hex(d) for d in descs], "idesc_e2m1_ue4m3": desc_ok,
        "fp4_mma_sass": fp4_sass, "fp4_loops": len(fp4_loops), "bf16_mma_sass": bf16_mma,
        "fp4_loops_with_bf16": len(mixed), "shared_bytes": smem, "instructions": sum(ops.values()),
        "sass_mma_opcodes": sorted({op for op in ops if "MMA" in op}),
    }
    res["ok"] = bool(fp4_ptx and desc_ok and fp4_sass and fp4_loops and not mixed and smem <= SMEM_MAX[cap]
                     and (has_ks or bf16_mma == 0))
    return res


def run() -> list[dict]:
    rows = []
    cases = [(name, cfg, ks, True) for name, cfg in CONFIGS.items() for ks in (False, True)]
    # a tile tcgen05 cannot run in FP4 (unswapped, 16 token rows): the checker must reject it on sm_100a
    bad = DotScaledConfig.__new__(DotScaledConfig)
    for k, v in dict(swap=False, block_m=16, block_n=128, block_k=256, block_ks=64, group_m=8, num_warps=4, num_stages=3).items():
        object.__setattr__(bad, k, v)
    cases.append(("negative-control ss/16", bad, False, False))
    for name, cfg, ks, shipped in cases:
        for cap in ARCHS:
            res = check(cap, compile_for(cap, cfg, ks), ks)
            rows.append({"config": name, "tile": f"{'swap' if cfg.swap else 'ss'} {cfg.block_m}x{cfg.block_n}x{cfg.block_k}",
                         "warps": cfg.num_warps, "stages": cfg.num_stages, "bf16_segment": ks, "arch": ARCHS[cap],
                         "shipped": shipped, **res})
            r = rows[-1]
            print(f"{r['arch']:8} {name:24} {r['tile']:18} ks={int(ks)} ok={r['ok']!s:5} fp4 mma ptx/sass {r['fp4_mma_ptx']}/{r['fp4_mma_sass']}"
                  f" fp4 loops {r['fp4_loops']} (with bf16 {r['fp4_loops_with_bf16']}) bf16 mma {r['bf16_mma_sass']}"
                  f" smem {r['shared_bytes']} {r['sass_mma_opcodes']}", flush=True)
    # sm_90a (H200), for reference: no FP4 tensor cores, so Triton emulates dot_scaled in BF16 (what the GPU
    # test tests/test_blackwell_gpu.py runs on the H200); reported, not checked
    for name, cfg in CONFIGS.items():
        c = compile_for(90, cfg, True)
        ops = collections.Counter(opcode(t) for _, t in instructions(sass_of(c)))
        rows.append({"config": name, "tile": f"{'swap' if cfg.swap else 'ss'} {cfg.block_m}x{cfg.block_n}x{cfg.block_k}",
                     "warps": cfg.num_warps, "stages": cfg.num_stages, "bf16_segment": True, "arch": "sm_90a", "shipped": True,
                     "fp4_mma_ptx": 0, "idesc": [], "idesc_e2m1_ue4m3": False, "fp4_mma_sass": 0, "fp4_loops": 0,
                     "bf16_mma_sass": sum(n for op, n in ops.items() if "MMA" in op), "fp4_loops_with_bf16": 0,
                     "shared_bytes": c.metadata.shared, "instructions": sum(ops.values()),
                     "sass_mma_opcodes": sorted({op for op in ops if "MMA" in op}), "ok": None})
        print(f"sm_90a   {name:24} emulated: {rows[-1]['sass_mma_opcodes']} smem {rows[-1]['shared_bytes']}", flush=True)
    return rows


def _ptxas_version() -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    try:
        return subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    except Exception:
        return "unknown"


def write(rows: list[dict], out: str) -> None:
    meta = {"commit": git_commit(), "triton": triton.__version__, "ptxas": _ptxas_version(),
            "command": "python benchmarks/kernels/sass_blackwell.py --out " + out}
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# dot_scaled form: offline compile for Blackwell (no GPU)", "",
             f"Commit `{meta['commit']}` (the code compiled; uncommitted changes to other files aside), Triton {meta['triton']}, "
             f"ptxas `{meta['ptxas']}`. Command: `{meta['command']}`.", "",
             "| arch | config | tile (BM x BN x BK) | BF16 segment | FP4 MMA (PTX / SASS) | tcgen05 idesc (E2M1, UE4M3) | SASS MMA opcodes | FP4 loops (with BF16 ops) | BF16 MMA | smem B | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arch']} | {r['config']} | {r['tile']} | {'yes' if r['bf16_segment'] else 'no'} | {r['fp4_mma_ptx']} / {r['fp4_mma_sass']} | "
                     f"{(', '.join(sorted(set(r['idesc']))) + (' yes' if r['idesc_e2m1_ue4m3'] else ' **no**')) if r['idesc'] else '–'} | "
                     f"{', '.join('`' + o + '`' for o in r['sass_mma_opcodes'])} | {r['fp4_loops']} ({r['fp4_loops_with_bf16']}) | "
                     f"{r['bf16_mma_sass']} | {r['shared_bytes']} | {'emulated (not checked)' if r['ok'] is None else 'yes' if r['ok'] else '**no**'} |")
    lines += ["", "The negative control is not a shipped configuration: an unswapped 16-row tile, which sm_100a cannot run on "
              "the FP4 tensor cores (tcgen05's FP4 MMA needs M = 128); Triton emulates it in BF16 there, and the check must say "
              "no. sm_120a's `mma.sync` m16n8k64 takes it natively, so there it passes.", ""]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    rows = run()
    if args.out:
        write(rows, args.out)
    shipped_ok = all(r["ok"] for r in rows if r["shipped"] and r["ok"] is not None)
    control_rejected = not any(r["ok"] for r in rows if not r["shipped"] and r["arch"] == "sm_100a")
    print(f"shipped configurations pass: {shipped_ok}; negative control rejected on sm_100a: {control_rejected}")
    return 0 if shipped_ok and control_rejected else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
