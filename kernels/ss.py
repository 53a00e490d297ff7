"""Kernel form: the SS SpliceGEMM tile (``_splice_gemm_ss_kernel``): ``Y[BM, BN]`` with both MMA
operands in shared memory.

The activation tile (fp16 ``q*s`` or X) is the left operand; the weight tile is decoded in registers
(:func:`~.primitives.fp4_tile`, exact ``e2m1·s·2^-14`` in fp16) and reaches the MMA through shared
memory. The BF16 segment follows as extra K steps on the same accumulator; global scales once per
tile, then the bias. Reference: :func:`foursight.layer.reference_linear`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .configs import SSConfig
from .launch import block_ks, weight_args
from .primitives import bf16_rne, fp4_tile, mma, tile_ids
from .runtime import interpreting

if TYPE_CHECKING:
    from .prepared import PreparedWeight


@triton.jit
def _splice_gemm_ss_kernel(
    a_ptr, stride_am, stride_ak,  # A: fp16 q*s [M, K] (A_QUANT) or X (W4A16)
    a_gs_ptr,  # fp32 [M] (A_QUANT)
    xs_ptr, stride_xsm, stride_xsk,  # BF16 segment source: contiguous X[:, S] [M, KS] (XS_DENSE) or X [M, K]
    ch_ptr,  # int32 [KS] (gather when not XS_DENSE)
    wp_ptr, stride_wpn,
    ws_ptr, stride_wsn,
    w_gs_ptr,
    wb_ptr, stride_wbn,
    bias_ptr,
    out_ptr, stride_om, stride_on,
    M, N, K, KS,
    A_QUANT: tl.constexpr,
    DOT_BF16: tl.constexpr,
    XS_DENSE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_KS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KS: tl.constexpr,
    GROUP_M: tl.constexpr,
    PREFETCH: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Prefill tile ``Y[BM, BN]``: the activation tile is the left MMA operand, the weight tile is
    decoded in registers (``fp4_tile``: exact ``e2m1*s*2^-14`` in fp16) and becomes the right
    operand through shared memory. The BF16 segment follows as extra K steps on the same
    accumulator, reading X[:, S] from the contiguous copy the quantization kernel wrote."""
    pid = tl.program_id(0)
    pid_m, pid_n = tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    G: tl.constexpr = BLOCK_K // 16
    g = tl.arange(0, G)
    j8 = tl.arange(0, 8)
    k16 = tl.arange(0, BLOCK_K)
    KG = K // 16

    w_ptrs = wp_ptr + rn[:, None, None] * stride_wpn + g[None, :, None] * 8 + j8[None, None, :]
    ws_ptrs = ws_ptr + rn[:, None] * stride_wsn + g[None, :]
    a_ptrs = a_ptr + rm[:, None] * stride_am + k16[None, :] * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        gm = g < KG
        p_nx = tl.load(w_ptrs, mask=gm[None, :, None], other=0)
        sb_nx = tl.load(ws_ptrs, mask=gm[None, :], other=0)
    for kg0 in range(0, KG, G):
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(kg0 * 16 + k16)[None, :] < K, other=0.0)
        if PREFETCH:
            # the packed weight of the next step is loaded before this step's decode and MMA
            p = p_nx.to(tl.int32)
            sb = sb_nx.to(tl.int32)
            gm = (kg0 + G + g) < KG
            p_nx = tl.load(w_ptrs + G * 8, mask=gm[None, :, None], other=0)
            sb_nx = tl.load(ws_ptrs + G, mask=gm[None, :], other=0)
        elif EVEN_K:
            p = tl.load(w_ptrs).to(tl.int32)
            sb = tl.load(ws_ptrs).to(tl.int32)
        else:
            gm = (kg0 + g) < KG
            p = tl.load(w_ptrs, mask=gm[None, :, None], other=0).to(tl.int32)
            sb = tl.load(ws_ptrs, mask=gm[None, :], other=0).to(tl.int32)
        w = fp4_tile(p, sb, BLOCK_N, BLOCK_K)
        if DOT_BF16:
            w = w.to(tl.bfloat16)
        acc = mma(a, tl.trans(w), acc, INTERP)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += G * 8
        ws_ptrs += G

    wgs = tl.load(w_gs_ptr + rn)
    if A_QUANT:
        ags = tl.load(a_gs_ptr + rm)
        acc = acc * (16384.0 / (ags[:, None] * wgs[None, :]))
    else:
        acc = acc * (16384.0 / wgs)[None, :]

    if HAS_KS:
        offs_c = tl.arange(0, BLOCK_KS)
        for c0 in range(0, KS, BLOCK_KS):
            cm = (c0 + offs_c) < KS
            if XS_DENSE:
                xs = tl.load(xs_ptr + rm[:, None] * stride_xsm + (c0 + offs_c)[None, :] * stride_xsk, mask=cm[None, :], other=0.0)
            else:
                ch = tl.load(ch_ptr + c0 + offs_c, mask=cm, other=0).to(tl.int64)
                xs = tl.load(xs_ptr + rm[:, None] * stride_xsm + ch[None, :] * stride_xsk, mask=cm[None, :], other=0.0)
            wb = tl.load(wb_ptr + rn[:, None] * stride_wbn + (c0 + offs_c)[None, :], mask=cm[None, :], other=0.0)
            acc = mma(bf16_rne(xs.to(tl.float32), INTERP).to(tl.bfloat16), tl.trans(wb), acc, INTERP)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    omask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    if INTERP and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = bf16_rne(acc, INTERP)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


def ss_launch(cfg: SSConfig, a, a_gs, x, xs, pw: PreparedWeight, bias, out, a_quant: bool, dot_bf16: bool):
    """Launch the SS kernel. ``a``/``a_gs`` as in :func:`.swap.swap_launch`; ``xs`` = contiguous
    X[:, S] or None (then the BF16 segment gathers the S columns from ``x``)."""
    m = x.shape[0]
    bm, bn, bk, nw, ns, prefetch = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.prefetch
    n, k_dim = pw.out_features, pw.in_features
    kk = pw.num_channels
    dummy = pw.weight_global_scale
    src = xs if (xs is not None and kk) else x
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    return _splice_gemm_ss_kernel[grid](
        a, a.stride(0), a.stride(1),
        a_gs if a_gs is not None else dummy,
        src, src.stride(0), src.stride(1),
        *weight_args(pw, bias),
        out, out.stride(0), out.stride(1),
        m, n, k_dim, kk,
        A_QUANT=a_quant, DOT_BF16=dot_bf16, XS_DENSE=xs is not None, HAS_BIAS=bias is not None, HAS_KS=kk > 0,
        EVEN_K=(k_dim % bk == 0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_KS=block_ks(kk, 64),
        GROUP_M=8,
        PREFETCH=prefetch,
        INTERP=interpreting(),
        num_warps=nw, num_stages=ns,
    )


def launch(cfg, ops, pw, bias, out, pdl: bool = False):
    """The form's launch in the kernel-form table's signature (:class:`~.forms.Operands` ``ops``); the MMA in
    bf16 where A is bf16 X (W4A16)."""
    return ss_launch(cfg, ops.a, ops.a_gs, ops.x, ops.xs, pw, bias, out, ops.a_quant,
                     not ops.a_quant and ops.x.dtype == torch.bfloat16)
