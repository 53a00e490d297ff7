"""Kernel form: the swap-AB SpliceGEMM tile (``_splice_gemm_kernel``): decode with 2..16 rows, mid.

NVFP4 x NVFP4 (or BF16/FP16 x NVFP4) GEMM with the BF16 channel segment spliced into the same fp32
accumulator. Reference: :func:`foursight.layer.reference_linear`.

``Y[M, N] = deq(A) · deq(W)ᵀ + X[:, S] · W_bf16ᵀ (+ bias)``

Layout and numerics (swap form)
-------------------------------
* The kernel computes the transposed tile ``Yᵀ[BN, BM]`` ("swap AB"): the weight, dequantized in
  registers, is the left operand of the MMA (on Hopper the register operand of ``wgmma``), the
  activation tile the right operand. For decode (M <= 16) this puts the large dimension N on the
  MMA's M side, so a 16-row activation costs no padding to 64.
* FP4 tiles are decoded with integer ops into fp16 holding ``e2m1 * 2^-14`` (E2M1 bits placed in
  fp16's exponent/mantissa; the code 1 becomes an fp16 subnormal), then multiplied by the E4M3
  block scale (decoded the same way). All of these products are exact in fp16: the MMA sees the
  exact ``q * s`` values (times a power of two) and accumulates in fp32.
* The global scales (per-row activation ``gs_a[m]``, per-output-row weight ``gs_w[n]``) are
  applied once to the accumulator after the FP4 K-tiles; the loop then continues over the BF16
  channel segment (``k`` gathered columns of X against ``W_bf16``) into the same accumulator;
  the bias is added last. The order of operations is the reference's (FP4 part, + BF16 part,
  + bias, in fp32).

Operand modes (constexpr)
-------------------------
* ``A_QUANT``: A is the dequantized activation ``q * s`` in fp16 [M, K] written by the
  activation-quantization kernel (exact values).
* ``not A_QUANT``: W4A16, A is X itself (bf16 or fp16; the FP4 weight is decoded to X's dtype).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from foursight.nvfp4 import BLOCK_SIZE

from .configs import SwapConfig
from .launch import block_ks, weight_args
from .primitives import bf16_rne, fp4_tile, mma, tile_ids
from .tile_steps import bf16_segment, global_scales
from .runtime import interpreting, resident_programs

if TYPE_CHECKING:
    from .prepared import PreparedWeight


@triton.jit
def _splice_gemm_kernel(
    a_ptr, stride_am, stride_ak,  # A: fp16 q*s (A_QUANT) or X (W4A16) [M, K]
    a_gs_ptr,  # fp32 [M] activation global scale (A_QUANT)
    x_ptr, stride_xm, stride_xk,  # X [M, K], source of the BF16 segment
    ch_ptr,  # int32 [KS] channel indices
    wp_ptr, stride_wpn,  # W packed uint8 [N, K/2]
    ws_ptr, stride_wsn,  # W scale bytes uint8 [N, K/16]
    w_gs_ptr,  # fp32 [N] weight global scale per output row
    wb_ptr, stride_wbn,  # W_bf16 [N, KS]
    bias_ptr,  # [N]
    out_ptr, stride_om, stride_on,  # [M, N] (or the fp32 split-K workspace [SPLIT, M, N] when SPLIT)
    M, N, K, KS,
    GROUPS_PER_SPLIT,  # K/16-groups per split (a multiple of BLOCK_K/16); grid axis 1 = split index
    A_QUANT: tl.constexpr,
    DOT_BF16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_KS: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KS: tl.constexpr,
    GROUP_M: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (offs_m % M).to(tl.int64)  # wrapped rows: loads need no mask along M/N
    rn = (offs_n % N).to(tl.int64)

    G: tl.constexpr = BLOCK_K // 16
    g = tl.arange(0, G)
    j8 = tl.arange(0, 8)
    KG = K // 16
    kg_start = pid_k * GROUPS_PER_SPLIT
    kg_end = tl.minimum(KG, kg_start + GROUPS_PER_SPLIT)

    w_ptrs = wp_ptr + rn[:, None, None] * stride_wpn + g[None, :, None] * 8 + j8[None, None, :]
    ws_ptrs = ws_ptr + rn[:, None] * stride_wsn + g[None, :]
    w_ptrs += kg_start * 8
    ws_ptrs += kg_start
    k16 = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * stride_am + (kg_start * 16 + k16)[None, :] * stride_ak

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kg0 in range(kg_start, kg_end, G):
        if EVEN_K:
            p = tl.load(w_ptrs).to(tl.int32)
            sb = tl.load(ws_ptrs).to(tl.int32)
        else:
            gm = (kg0 + g) < KG
            p = tl.load(w_ptrs, mask=gm[None, :, None], other=0).to(tl.int32)
            sb = tl.load(ws_ptrs, mask=gm[None, :], other=0).to(tl.int32)
        w = fp4_tile(p, sb, BLOCK_N, BLOCK_K)
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(kg0 * 16 + k16)[None, :] < K, other=0.0)
        a_ptrs += BLOCK_K * stride_ak
        if DOT_BF16:
            w = w.to(tl.bfloat16)
        acc = mma(w, tl.trans(a), acc, INTERP)
        w_ptrs += G * 8
        ws_ptrs += G

    # global scales, once per tile: products carried 2^-14 per FP4-decoded operand
    acc = global_scales(acc, a_gs_ptr, w_gs_ptr, rm, rn, 16384.0, A_QUANT, True)

    # the spliced BF16 channel segment (gathered from X): more K-steps into the same accumulator
    if HAS_KS:
        if pid_k == 0:
            acc = bf16_segment(acc, x_ptr, stride_xm, stride_xk, ch_ptr, wb_ptr, stride_wbn, rm, rn, 0, KS,
                                BLOCK_KS, False, True, True, INTERP)

    omask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    if SPLIT:
        # fp32 partial of this K split; _split_reduce_kernel sums the splits, adds the bias, casts
        part = out_ptr + pid_k.to(tl.int64) * M * N + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(part, acc, mask=omask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None].to(tl.int64) * stride_on
        if INTERP and out_ptr.dtype.element_ty == tl.bfloat16:
            acc = bf16_rne(acc, INTERP)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _split_reduce_kernel(ws_ptr, bias_ptr, out_ptr, stride_om, stride_on, M, N, SPLITS,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    """out[m, n] = sum_s ws[s, m, n] (+ bias[n]), cast to out's dtype. ws: fp32 [SPLITS, M, N]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    m = offs // N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    if INTERP and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = bf16_rne(acc, INTERP)
    tl.store(out_ptr + m * stride_om + n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _split_plan(m: int, n: int, k_dim: int, bm: int, bn: int, bk: int, split: int, device) -> tuple[int, int]:
    """(number of K splits, K/16-groups per split). ``split`` 0 = automatic, 1 = no split."""
    kg, g = k_dim // BLOCK_SIZE, bk // BLOCK_SIZE
    steps = triton.cdiv(kg, g)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split == 0:
        target = resident_programs(device)  # about 4 programs per SM (8 under the interpreter)
        split = 1 if 2 * tiles >= target else min(triton.cdiv(target, tiles), steps)
        split = max(1, min(split, (256 * 2**20) // max(1, 4 * m * n)))  # workspace <= 256 MB
    split = max(1, min(split, steps))
    gps = triton.cdiv(steps, split) * g
    return triton.cdiv(kg, gps), gps


def swap_launch(cfg: SwapConfig, a, a_gs, x, pw: PreparedWeight, bias, out, a_quant: bool, dot_bf16: bool):
    """Launch the swap-AB kernel (+ the split-K reduction when K is split).

    ``a``: the fp16 ``q*s`` activation (``a_quant``, with ``a_gs`` its per-row global scales) or X
    itself (W4A16); ``x``: the source of the BF16 segment's columns."""
    m = x.shape[0]
    bm, bn, bk, nw, ns = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages
    n, k_dim = pw.out_features, pw.in_features
    kk = pw.num_channels
    splits, gps = _split_plan(m, n, k_dim, bm, bn, bk, cfg.split_k, out.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), splits)
    dummy = pw.weight_global_scale
    target = torch.empty((splits, m, n), dtype=torch.float32, device=out.device) if splits > 1 else out
    compiled = _splice_gemm_kernel[grid](
        a, a.stride(0), a.stride(1),
        a_gs if a_gs is not None else dummy,
        x, x.stride(0), x.stride(1),
        *weight_args(pw, bias),
        target, out.stride(0), out.stride(1),
        m, n, k_dim, kk, gps,
        A_QUANT=a_quant, DOT_BF16=dot_bf16, HAS_BIAS=bias is not None, HAS_KS=kk > 0, SPLIT=splits > 1,
        EVEN_K=(k_dim % bk == 0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_KS=block_ks(kk, 64),
        GROUP_M=8,
        INTERP=interpreting(),
        num_warps=nw, num_stages=ns,
    )
    if splits > 1:
        blk = 1024
        _split_reduce_kernel[(triton.cdiv(m * n, blk),)](
            target, bias if bias is not None else dummy, out, out.stride(0), out.stride(1), m, n, splits,
            HAS_BIAS=bias is not None, BLOCK=blk, INTERP=interpreting(), num_warps=4,
        )
    return compiled


def launch(cfg, ops, pw, bias, out, pdl: bool = False):
    """The form's launch in the kernel-form table's signature (:class:`~.forms.Operands` ``ops``); the MMA in
    bf16 where A is bf16 X (W4A16)."""
    return swap_launch(cfg, ops.a, ops.a_gs, ops.x, pw, bias, out, ops.a_quant,
                       not ops.a_quant and ops.x.dtype == torch.bfloat16)
