#!/usr/bin/env python
"""Compile the FourSight Triton kernels for sm_90 (H100/H200) on a machine without a GPU and count
the SASS instructions of their loops.

Triton ships ``ptxas`` and ``cuobjdump``, so ``triton.compile`` with a ``GPUTarget("cuda", 90, 32)``
works on a CPU-only machine. This is how the decode loop was tuned between device runs (figures in
docs/kernels.md). Integer arguments are marked divisible by 16 and unit strides are specialized,
as Triton does at launch for contiguous tensors. The local Triton may differ from the GPU machine's
(3.9 here, 3.6 on the H200), so counts are a guide, not the shipped SASS (the benchmark dumps that).

Usage::

    python benchmarks/sass_offline.py            # every kernel, default tiles
    python benchmarks/sass_offline.py gemv1 ss   # a subset

Per kernel it prints the instruction count, the loops (backward branches) with their length and
most frequent opcodes and, for the loop over K, instructions per weight element per thread.
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from foursight.kernels.act_quant import _act_quant_kernel
from foursight.kernels.dequant import _dequant_weight_kernel
from foursight.kernels.fragment import _fragment_gemm_kernel
from foursight.kernels.gemv import _splice_gemv1_kernel
from foursight.kernels.ss import _splice_gemm_ss_kernel
from foursight.kernels.swap import _splice_gemm_kernel

_INTS = ("M", "N", "K", "KS", "SPLITS", "GROUPS_PER_SPLIT", "CHUNKS_PER_SPLIT", "FIRST_CHUNKS", "KCP", "NP")

# name: (kernel, pointer types, constexprs, num_warps, num_stages, weight elements per thread per K step)
CASES = {
    "gemv1": (_splice_gemv1_kernel,
              {"x_ptr": "*bf16", "a_ptr": "*fp16", "ch_ptr": "*i32", "wq_ptr": "*i32", "ws_ptr": "*u8",
               "wb_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16"},
              dict(stride_xk=1, stride_on=1, A_MODE=1, HAS_BIAS=False, HAS_KS=True,
                   BN=8, BK=1024, BLOCK_KS=128, USE_ASM=True, INTERP=False), 4, 1, 8 * 1024 // 128),
    "ss": (_splice_gemm_ss_kernel,
           {"a_ptr": "*fp16", "xs_ptr": "*bf16", "ch_ptr": "*i32", "wp_ptr": "*u8", "ws_ptr": "*u8", "wb_ptr": "*bf16",
            "bias_ptr": "*bf16", "out_ptr": "*bf16"},
           dict(stride_ak=1, stride_xsk=1, stride_on=1, A_QUANT=True, DOT_BF16=False, XS_DENSE=True, HAS_BIAS=False,
                HAS_KS=True, EVEN_K=True, BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, BLOCK_KS=64, GROUP_M=8, PREFETCH=True,
                INTERP=False), 8, 3, 128 * 64 // 256),
    "swap": (_splice_gemm_kernel,
             {"a_ptr": "*fp16", "x_ptr": "*bf16", "ch_ptr": "*i32", "wp_ptr": "*u8", "ws_ptr": "*u8",
              "wb_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16"},
             dict(stride_ak=1, stride_xk=1, stride_on=1, A_QUANT=True, DOT_BF16=False, HAS_BIAS=False,
                  HAS_KS=True, SPLIT=False, EVEN_K=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, BLOCK_KS=64, GROUP_M=8,
                  INTERP=False), 4, 3, 64 * 256 // 128),
    "fragment": (_fragment_gemm_kernel,
                 {"a_ptr": "*bf16", "x_ptr": "*bf16", "ch_ptr": "*i32", "wf_ptr": "*i32", "sf_ptr": "*u8",
                  "wb_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16"},
                 dict(A_QUANT=True, HAS_BIAS=False, HAS_KS=True, SPLIT=False, SCALE_BF16=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                      BLOCK_KS=64, GROUP_M=8, INTERP=False), 4, 3, 64 * 128 // 128),
    "fragment256": (_fragment_gemm_kernel,
                    {"a_ptr": "*bf16", "x_ptr": "*bf16", "ch_ptr": "*i32", "wf_ptr": "*i32", "sf_ptr": "*i16",
                     "wb_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "cnt_ptr": "*i32"},
                    dict(A_QUANT=True, HAS_BIAS=False, HAS_KS=True, SPLIT=True, SCALE_BF16=True, BLOCK_M=16, BLOCK_N=64,
                         BLOCK_K=256, BLOCK_KS=64, GROUP_M=8, INTERP=False), 4, 3, 64 * 256 // 128),
    "act_quant": (_act_quant_kernel,
                  {"x_ptr": "*bf16", "smask_ptr": "*u8", "ch_ptr": "*i32", "packed_ptr": "*u8", "scale_ptr": "*u8",
                   "deq_ptr": "*fp16", "xs_ptr": "*bf16"},
                  dict(stride_xk=1, BLOCK_K=4096, ONE_PASS=True, HAS_CH=True, STATIC_GS=False, WRITE_PACKED=False,
                       WRITE_DEQ=True, WRITE_XS=False, BLOCK_KS=128, DIV6_RECIP=True, ROWS=1, FQ=False), 8, 1, 4096 // 256),
    "act_fakequant": (_act_quant_kernel,
                      {"x_ptr": "*bf16", "smask_ptr": "*u8", "ch_ptr": "*i32", "packed_ptr": "*u8", "scale_ptr": "*u8",
                       "deq_ptr": "*bf16", "xs_ptr": "*bf16"},
                      dict(stride_xk=1, BLOCK_K=8192, ONE_PASS=True, HAS_CH=True, STATIC_GS=False, WRITE_PACKED=False,
                           WRITE_DEQ=True, WRITE_XS=False, BLOCK_KS=128, DIV6_RECIP=True, ROWS=1, FQ=True), 16, 1, 8192 // 512),
    "dequant": (_dequant_weight_kernel,
                {"wp_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": "*bf16"},
                dict(DIV_GS=False, BN=32, BK=256), 4, 1, 32 * 256 // 128),
}


def compile_sm90(fn, ptr_types: dict, consts: dict, num_warps: int, num_stages: int):
    """``triton.compile`` for sm_90 with launch-like specialization (see the module docstring)."""
    sig = {}
    params = inspect.signature(fn.fn).parameters
    # a constexpr parameter left out of ``consts`` takes its default, as at launch
    consts = {**{p: v.default for p, v in params.items() if "constexpr" in str(v.annotation) and v.default is not v.empty},
              **consts}
    for p in params:
        if p in consts:
            sig[p] = "constexpr"
        elif p in ptr_types:
            sig[p] = ptr_types[p]
        elif p.startswith("stride") or p in _INTS:
            sig[p] = "i32"
        else:
            sig[p] = "*fp32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
             if t.startswith("*") or (t == "i32" and n not in ("M", "N", "SPLITS", "GROUPS_PER_SPLIT", "CHUNKS_PER_SPLIT", "FIRST_CHUNKS", "KCP", "NP"))}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def sass_of(compiled) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def loops(sass: str) -> list[tuple[int, collections.Counter]]:
    """(length, opcode counts) of every loop body, found as a backward branch."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    out = []
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            out.append((len(body), ops))
    return out


def main(names: list[str]) -> None:
    for name in names or list(CASES):
        fn, ptrs, consts, nw, ns, per_thread = CASES[name]
        sass = sass_of(compile_sm90(fn, ptrs, {k: v for k, v in consts.items() if k in fn.arg_names}, nw, ns))
        total = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass))
        print(f"== {name}: {total} instructions; constexprs {consts}, {nw} warps")
        found = loops(sass)
        for i, (n, ops) in enumerate(found):
            main_loop = i == 0 and not name.startswith("act_")
            extra = f" = {n / per_thread:.1f} per weight element per thread" if main_loop else ""
            if main_loop and "BM" in consts:
                extra += f" (for all {consts['BM']} activation rows)"
            print(f"   loop {i}: {n} instructions{extra}; {ops.most_common(12)}")
        if name.startswith("act_"):
            print(f"   straight-line: {total / per_thread:.1f} instructions per element per thread (BLOCK_K = {consts['BLOCK_K']}, {32 * nw} threads)")


if __name__ == "__main__":
    main(sys.argv[1:])
